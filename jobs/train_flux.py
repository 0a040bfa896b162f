"""Fine-tune a FLUX LoRA on Ray: ``python jobs/train_flux.py [--config FILE] [--set KEY=VALUE ...] [--only cache]``.

With neither ``--config`` nor ``--set`` it runs the demo on a local Ray: a LoRA of a colour the shipped world base never
saw (pink), with validation grids in ``runs/demo/validation/`` where it appears over the steps.
"""

from __future__ import annotations

import sys

from rayflux.cli import main_train

if __name__ == "__main__":
    sys.exit(main_train())
