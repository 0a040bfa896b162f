"""The world-base demo with overrides: ``python -m rayflux.quality.demo [--set KEY=VALUE ...]``.

``python jobs/train_flux.py`` with neither ``--config`` nor ``--set`` runs the demo as it is: a LoRA of the held-back
colour (pink) on the shipped world base (:func:`rayflux.testing.world_base.demo_sets`), with validation grids in
``runs/demo/validation/``. Any ``--set`` given to the job replaces the demo; given here, it is applied on top of the
demo's own (``--set train.max_steps=300``, another ``data.images_dir`` such as the held-back star's).
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
