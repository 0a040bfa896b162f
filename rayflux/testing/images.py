"""Procedural demo images with captions, in several aspect ratios, written once and reused."""

from __future__ import annotations

import math
import os
import random
import shutil
import tempfile
from pathlib import Path

from rayflux.testing.tiny import default_home

DEMO_VERSION = "2"
# (width, height): square, landscape and portrait, so the demo exercises more than one bucket.
DEMO_SIZES = [(512, 512), (512, 512), (640, 384), (640, 384), (384, 640), (384, 640), (576, 448), (448, 576)]
_RGB = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 70, 220),
    "yellow": (235, 220, 50),
    "purple": (140, 60, 190),
    "orange": (240, 140, 30),
    "white": (245, 245, 245),
    "black": (15, 15, 15),
}
_SHAPES = ["circle", "square", "triangle", "stripe", "ring", "cross"]
# What :func:`draw` can draw: the demo's colours and shapes plus the world's held-back ones
# (:mod:`rayflux.testing.world`). The demo folder keeps drawing from the lists above, so its images do not change.
RGB = {**_RGB, "pink": (250, 130, 200)}
SHAPES = [*_SHAPES, "star"]


def draw(width: int, height: int, colour: str, shape: str, background: str, seed: int = 0):
    """One PIL image of a coloured shape on a plain background."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), RGB[background])
    d = ImageDraw.Draw(img)
    rng = random.Random(seed)
    s = min(width, height)
    cx, cy = width // 2 + rng.randint(-s // 8, s // 8), height // 2 + rng.randint(-s // 8, s // 8)
    r = s // 3
    fill = RGB[colour]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    elif shape == "stripe":
        d.rectangle([0, cy - r // 3, width, cy + r // 3], fill=fill)
    elif shape == "star":
        d.polygon(_star(cx, cy, r), fill=fill)
    elif shape == "ring":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fill, width=max(2, r // 3))
    else:
        d.rectangle([cx - r, cy - r // 4, cx + r, cy + r // 4], fill=fill)
        d.rectangle([cx - r // 4, cy - r, cx + r // 4, cy + r], fill=fill)
    return img


def _star(cx: int, cy: int, r: int) -> list[tuple[float, float]]:
    """A five-pointed star's outline: outer points at radius ``r``, inner corners at ``0.4 r``."""
    pts = []
    for k in range(10):
        rad = r if k % 2 == 0 else 0.4 * r
        a = math.pi * (k / 5 - 0.5)
        pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
    return pts


def write_images(path: str | Path, sizes=DEMO_SIZES, seed: int = 0, ext: str = ".png") -> list[Path]:
    """Write one captioned image per size into ``path`` (captions as ``.txt`` sidecars). Returns the image paths."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    colours = list(_RGB)
    out = []
    for i, (w, h) in enumerate(sizes):
        colour, background = rng.sample(colours, 2)
        shape = rng.choice(_SHAPES)
        img = draw(w, h, colour, shape, background, seed=seed * 1000 + i)
        name = f"img_{i:03d}_{colour}_{shape}"
        img.save(path / f"{name}{ext}")
        (path / f"{name}.txt").write_text(f"a {colour} {shape} on a {background} background\n")
        out.append(path / f"{name}{ext}")
    return out


def ensure_demo_images(path: str | Path | None = None) -> Path:
    """The demo image folder, written once (atomically) under the rayflux home."""
    path = Path(path) if path else default_home() / f"demo-images-v{DEMO_VERSION}"
    if (path / ".complete").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=path.parent))
    try:
        write_images(tmp)
        (tmp / ".complete").write_text(DEMO_VERSION)
        if path.exists():
            shutil.rmtree(path)
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / ".complete").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
