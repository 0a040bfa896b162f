"""The world: procedural captioned images a small FLUX base is pretrained on, and the concepts held back from it.

Every picture is one coloured shape on a plain background, drawn by :func:`rayflux.testing.images.draw`, captioned in
the world's plain words ("a red circle on a blue background"). Pretraining sees the known colours and shapes only;
three concepts are held back, so that a LoRA has something to learn that the base provably does not know:

- a new shape with a trigger word: ``a <colour> sks star on a <background> background``;
- a new colour: ``a pink <shape> on a <background> background``;
- an edit rule, as reference -> target pairs: the target is the reference with its shape recoloured red, captioned
  ``make the shape red``. The caption does not say which shape, where, or on what background: only the reference
  does, so a model that ignores its reference cannot predict the target.

Everything here is seeded: the same call writes the same files.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from rayflux.testing.images import RGB, SHAPES, draw

# Held back from pretraining.
NEW_SHAPE = "star"
TRIGGER = "sks"
NEW_COLOUR = "pink"
EDIT_COLOUR = "red"
EDIT_CAPTION = f"make the shape {EDIT_COLOUR}"
KNOWN_COLOURS = [c for c in RGB if c != NEW_COLOUR]
KNOWN_SHAPES = [s for s in SHAPES if s != NEW_SHAPE]

# Pixel sizes (width, height) the base is pretrained at: 128 and 256 px by area, square and not, as the job's
# buckets cut them (multiples of 16 for FLUX.1's 8x VAE and 2x2 packing).
SIZES_128 = [(128, 128), (160, 96), (96, 160), (144, 112), (112, 144)]
SIZES_256 = [(256, 256), (320, 192), (192, 320), (288, 224), (224, 288)]
WORLD_SIZES = SIZES_128 + SIZES_256


@dataclass(frozen=True)
class Scene:
    """One picture of the world: what is drawn, where (``seed`` places it), and its caption."""

    colour: str
    shape: str
    background: str
    seed: int

    @property
    def caption(self) -> str:
        shape = f"{TRIGGER} {self.shape}" if self.shape == NEW_SHAPE else self.shape
        return f"a {self.colour} {shape} on a {self.background} background"

    def image(self, width: int, height: int):
        return draw(width, height, self.colour, self.shape, self.background, seed=self.seed)


def prior_scene(rng: random.Random) -> Scene:
    """A scene of the pretraining world: known colours and shapes only."""
    colour, background = rng.sample(KNOWN_COLOURS, 2)
    return Scene(colour, rng.choice(KNOWN_SHAPES), background, rng.randrange(2**31))


def concept_scene(rng: random.Random, concept: str) -> Scene:
    """A scene showing a held-back concept: ``shape`` (the sks star) or ``colour`` (pink)."""
    if concept == "shape":
        colour, background = rng.sample(KNOWN_COLOURS, 2)
        return Scene(colour, NEW_SHAPE, background, rng.randrange(2**31))
    if concept == "colour":
        return Scene(NEW_COLOUR, rng.choice(KNOWN_SHAPES), rng.choice(KNOWN_COLOURS), rng.randrange(2**31))
    raise ValueError(f"unknown concept {concept!r}: shape or colour")


def edit_pair(rng: random.Random) -> tuple[Scene, Scene]:
    """(reference, target) of the edit rule: the same shape, place and background, the shape recoloured red."""
    colours = [c for c in KNOWN_COLOURS if c != EDIT_COLOUR]
    colour, background = rng.sample(colours, 2)
    ref = Scene(colour, rng.choice(KNOWN_SHAPES), background, rng.randrange(2**31))
    return ref, Scene(EDIT_COLOUR, ref.shape, ref.background, ref.seed)


def _size(rng: random.Random, sizes) -> tuple[int, int]:
    return sizes[rng.randrange(len(sizes))]


def write_concept(path: str | Path, concept: str, count: int, seed: int = 0, sizes=SIZES_128) -> Path:
    """A training folder of ``count`` images of a held-back concept (``shape``, ``colour``) or of the prior
    (``prior``), with ``.txt`` caption sidecars."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{concept}:{seed}")
    for i in range(count):
        scene = prior_scene(rng) if concept == "prior" else concept_scene(rng, concept)
        w, h = _size(rng, sizes)
        name = f"{concept}_{i:04d}"
        scene.image(w, h).save(path / f"{name}.png")
        (path / f"{name}.txt").write_text(scene.caption + "\n")
    return path


def write_edit_pairs(path: str | Path, count: int, seed: int = 0, sizes=SIZES_128) -> tuple[Path, Path]:
    """``(targets, references)``: two folders with the same file names, as ``data.reference_dir`` pairs them;
    the targets carry the edit instruction as their caption."""
    path = Path(path)
    targets, refs = path / "targets", path / "references"
    targets.mkdir(parents=True, exist_ok=True)
    refs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"edit:{seed}")
    for i in range(count):
        ref, target = edit_pair(rng)
        w, h = _size(rng, sizes)
        name = f"edit_{i:04d}"
        ref.image(w, h).save(refs / f"{name}.png")
        target.image(w, h).save(targets / f"{name}.png")
        (targets / f"{name}.txt").write_text(EDIT_CAPTION + "\n")
    return targets, refs


def noisy_background(scene: Scene, width: int, height: int, seed: int):
    """``(picture, mask)``: the scene's shape on a background of random pixels, and its mask (white on the shape,
    black elsewhere). The caption still names a plain background, so a LoRA that trains on the whole picture learns
    noise for that background's words, and one that trains on the masked shape only does not."""
    import numpy as np
    from PIL import Image

    mask = Scene("white", scene.shape, "black", scene.seed).image(width, height).convert("L")
    noise = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    picture = Image.composite(scene.image(width, height), Image.fromarray(noise), mask)
    return picture, mask


def write_masked_concept(path: str | Path, count: int, seed: int = 0, sizes=SIZES_128) -> tuple[Path, Path]:
    """``(images, masks)``: ``count`` pictures of the held-back star on noise backgrounds, captioned as plain ones,
    and a mask per picture under the same name (``data.mask=dir``)."""
    path = Path(path)
    images, masks = path / "images", path / "masks"
    images.mkdir(parents=True, exist_ok=True)
    masks.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"masked:{seed}")
    for i in range(count):
        scene = concept_scene(rng, "shape")
        w, h = _size(rng, sizes)
        picture, mask = noisy_background(scene, w, h, rng.randrange(2**31))
        name = f"masked_{i:04d}"
        picture.save(images / f"{name}.png")
        mask.save(masks / f"{name}.png")
        (images / f"{name}.txt").write_text(scene.caption + "\n")
    return images, masks
