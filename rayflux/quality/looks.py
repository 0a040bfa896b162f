"""What the renders show: the world base (with or without a LoRA) renders fixed prompts from fixed seeds, and the
world classifier (:mod:`rayflux.quality.classify`) reads each picture's shape and colour.

- ``concept hit``: the share of the concept's prompts (``a <colour> sks star on a <background> background``) whose
  render reads as a star (for the held-back colour: ``a pink <shape> ...`` read as pink);
- ``prior accuracy``: the share of prompts of the known world whose render reads as the prompt's shape and colour.

A LoRA that learned the star raises the first and keeps the second where the base had it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from rayflux.quality.classify import WorldClassifier, read
from rayflux.testing import world
from rayflux.testing.world_base import WORLD_TEXT_TOKENS, render_guidance

RENDER_SEED = 31337


@dataclass(frozen=True)
class Prompt:
    """A prompt and what a faithful render of it shows."""

    text: str
    shape: str
    colour: str


def prompts(kind: str, count: int) -> list[Prompt]:
    """``count`` fixed prompts: ``shape`` (the sks star in known colours), ``colour`` (pink known shapes) or
    ``prior`` (known shapes and colours)."""
    rng = random.Random(f"looks:{kind}")
    scenes = [world.prior_scene(rng) if kind == "prior" else world.concept_scene(rng, kind) for _ in range(count)]
    return [Prompt(s.caption, s.shape, s.colour) for s in scenes]


def render(
    base: str | Path, transformer, texts: list[str], steps: int = 20, size: int = 128, true_cfg: float | None = None
) -> list:
    """One picture per prompt from the base's pipeline with ``transformer`` (the base's, or one with a LoRA);
    prompt ``i`` starts from seed ``RENDER_SEED + i``. ``true_cfg``: classifier-free guidance away from the empty
    caption (None: the base's own, :func:`rayflux.testing.world_base.render_guidance`; 0: none)."""
    from rayflux.families import Flux1

    pipe = Flux1().pipeline_class().from_pretrained(str(base), transformer=transformer, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    scale = render_guidance(base) if true_cfg is None else true_cfg
    guide = {"negative_prompt": "", "true_cfg_scale": scale} if scale else {}
    images = []
    for i, text in enumerate(texts):
        out = pipe(
            prompt=text,
            **guide,
            height=size,
            width=size,
            num_inference_steps=steps,
            max_sequence_length=WORLD_TEXT_TOKENS,
            generator=torch.Generator().manual_seed(RENDER_SEED + i),
        )
        images.append(out.images[0])
    return images


@dataclass
class Looks:
    """What the classifier read in a model's renders."""

    concept_hit: float
    prior_accuracy: float
    concept_images: list
    prior_images: list


def look(
    base: str | Path, transformer, classifier: WorldClassifier, concept: str = "shape", count: int = 12, steps: int = 20
) -> Looks:
    """Render ``count`` prompts of ``concept`` (``shape``: the star; ``colour``: pink) and ``count`` prior prompts,
    and score what the classifier reads in them."""
    wanted, prior = prompts(concept, count), prompts("prior", count)
    c_images = render(base, transformer, [p.text for p in wanted], steps)
    p_images = render(base, transformer, [p.text for p in prior], steps)
    seen = read(classifier, c_images)
    hits = [s == world.NEW_SHAPE if concept == "shape" else c == world.NEW_COLOUR for s, c in seen]
    right = [(s, c) == (p.shape, p.colour) for (s, c), p in zip(read(classifier, p_images), prior)]
    return Looks(sum(hits) / len(hits), sum(right) / len(right), c_images, p_images)
