"""Fine-tune a FLUX LoRA on Ray: ``python jobs/train_flux.py [--config FILE] [--set KEY=VALUE ...] [--only cache]``.

With no arguments it is the demo: a LoRA of a concept the shipped world base was never shown (the ``sks star``,
rayflux/testing/world_base.py) trained on a local Ray, with validation grids in ``runs/demo/validation/`` that show
the star appear. Any argument runs the job as configured (an empty ``model.path``: the embedded tiny model).
"""

from __future__ import annotations

import sys

from rayflux.cli import main_train

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not argv:
        from rayflux.testing.world_base import demo_sets

        argv = [arg for item in demo_sets() for arg in ("--set", item)]
    sys.exit(main_train(argv))
