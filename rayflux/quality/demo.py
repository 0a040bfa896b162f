"""The world-base demo with overrides: ``python -m rayflux.quality.demo [--set KEY=VALUE ...]``.

``python jobs/train_flux.py`` with neither ``--config`` nor ``--set`` runs the demo as it is: a LoRA of the held-back
colour (pink) on the shipped world base (:func:`rayflux.testing.world_base.demo_sets`), with validation grids in
``runs/demo/validation/``. Any ``--set`` given to the job replaces the demo; given here, it is applied on top of the
demo's own (``--set train.max_steps=300``, another ``data.images_dir`` such as the held-back star's).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from rayflux.cli import main_train
from rayflux.testing.world_base import demo_sets


def main(argv: list[str] | None = None) -> int:
    extra = sys.argv[1:] if argv is None else argv
    return main_train([arg for item in demo_sets() for arg in ("--set", item)] + extra, prog="rayflux.quality.demo")


if __name__ == "__main__":
    sys.exit(main())


def picture(run_dir: str | Path, out: str | Path) -> Path:
    """The demo's grids side by side, after the base's own (no LoRA) rendered the same way (the job's validation
    render: same prompts, seeds, steps and guidance), each labelled: what the README shows. ``run_dir`` is a finished
    demo run (``runs/demo``)."""
    from PIL import Image, ImageDraw

    from rayflux import config
    from rayflux.quality.score import transformer
    from rayflux.train.observe import validation

    cfg = config.load(None, demo_sets())
    grids = [("base", validation.grid(validation.render(transformer(cfg.model.path), cfg, "cpu", torch.float32)))]
    for path in sorted((Path(run_dir) / "validation").glob("step-*.png")):
        grids.append((f"step {int(path.stem.split('-')[1])}", Image.open(path).convert("RGB")))
    w, h = grids[0][1].size
    sheet = Image.new("RGB", (len(grids) * (w + 8) - 8, h + 18), "white")
    draw = ImageDraw.Draw(sheet)
    for i, (label, image) in enumerate(grids):
        sheet.paste(image, (i * (w + 8), 18))
        draw.text((i * (w + 8) + 4, 3), label, fill="black")
    sheet.save(out)
    return Path(out)
