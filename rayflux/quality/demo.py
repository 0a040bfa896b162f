"""The world-base demo: ``python -m rayflux.quality.demo [--set KEY=VALUE ...]``.

It trains a LoRA of the held-back ``sks star`` on the shipped world base (:func:`rayflux.testing.world_base.demo_sets`)
with validation grids every 20 steps in ``runs/demo/validation/``; further ``--set`` values override its own. It is
not yet the default demo (``python jobs/train_flux.py``): the base is undertrained and its renders do not follow
their prompts, so the grids do not show the star yet (docs/quality.md, "The demo").
"""

from __future__ import annotations

import sys

from rayflux.cli import main_train
from rayflux.testing.world_base import demo_sets


def main(argv: list[str] | None = None) -> int:
    extra = sys.argv[1:] if argv is None else argv
    return main_train([arg for item in demo_sets() for arg in ("--set", item)] + extra, prog="rayflux.quality.demo")


if __name__ == "__main__":
    sys.exit(main())
