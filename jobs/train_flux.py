"""Fine-tune a FLUX LoRA on Ray: ``python jobs/train_flux.py [--config FILE] [--set KEY=VALUE ...] [--only cache]``.

With no arguments it trains the embedded tiny model on generated demo images, on a local Ray.
"""

from __future__ import annotations

import sys

from rayflux.cli import main_train

if __name__ == "__main__":
    sys.exit(main_train())
