"""Scores of a LoRA on the world base, reproducible: fixed held-out sets, fixed noise, the job's fixed σ grid.

The sets are encoded as the cache encodes (the family's text encoding at the base's text length, the VAE's sample
for targets and its mode for edit references, the family's latent normalisation), from seeds no training folder
uses. Every score is a mean of per-sample flow-matching losses (or prediction differences) at the
:func:`rayflux.train.flow.eval_sigmas` grid, so two LoRAs are compared on exactly the same noisy inputs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from rayflux.testing import world
from rayflux.testing.world_base import WORLD_TEXT_TOKENS
from rayflux.quality.pretrain import Encoded, encode_world, encoder_pipe

SIGMAS = 5
NOISE_SEED = 777


@dataclass
class ScoreSet:
    """A held-out set: its encoded targets and, for edits, its references (same sizes, same order)."""

    enc: Encoded
    refs: dict[tuple[int, int], torch.Tensor] | None = None


def held_out(base: str | Path, kind: str, count: int, seed: int = 10_000, sizes=world.SIZES_128) -> ScoreSet:
    """``count`` held-out samples of ``kind``: ``prior``, ``shape``, ``colour`` or ``edit``."""
    pipe = encoder_pipe(base)
    rng = random.Random(f"score:{kind}:{seed}")
    size = [sizes[i % len(sizes)] for i in range(count)]
    if kind == "edit":
        pairs = [world.edit_pair(rng) for _ in range(count)]
        targets = [(t, s) for (_, t), s in zip(pairs, size)]
        refs = encode_world(pipe, [(r, s) for (r, _), s in zip(pairs, size)], WORLD_TEXT_TOKENS, mode=True)
        enc = encode_world(pipe, targets, WORLD_TEXT_TOKENS, captions=[world.EDIT_CAPTION] * count)
        return ScoreSet(enc, refs.latents)
    scenes = [world.prior_scene(rng) if kind == "prior" else world.concept_scene(rng, kind) for _ in range(count)]
    return ScoreSet(encode_world(pipe, list(zip(scenes, size)), WORLD_TEXT_TOKENS))


def transformer(
    base: str | Path,
    lora: str | Path | None = None,
    adapter: str = "lora",
    rank: int = 4,
    alpha: float = 4.0,
    targets: str = "attention",
):
    """The base's transformer in fp32, with a LoRA file (diffusers format, as the job exports) applied."""
    from diffusers import FluxTransformer2DModel

    from rayflux.train.adapter import lora as lora_mod

    model = FluxTransformer2DModel.from_pretrained(str(base), subfolder="transformer", torch_dtype=torch.float32)
    if lora is not None:
        lora_mod.add_lora(model, rank, alpha, targets, adapter=adapter)
        lora_mod.load_into(model, lora)
    return model.eval()


def _predict(model, lat, text: dict, sigma: float, noise, refs=None):
    from rayflux.families import Flux1
    from rayflux.families.references import target_prediction
    from rayflux.train import flow

    family = Flux1()
    _, _, h, w = lat.shape
    sig = torch.full((lat.shape[0],), sigma)
    noisy = family.pack(flow.noisy_input(lat, noise, sig))
    refs5 = refs[:, None] if refs is not None else None
    out = model(**family.forward_args(noisy, text, sig, h, w, None, references=refs5), return_dict=False)[0]
    return target_prediction(out, noisy.shape[1]), family.pack(flow.flow_target(lat, noise))


def _walk(ss: ScoreSet, references: str):
    """Yield ``(latents, text, refs, noise, sigma)`` over the set at every grid σ, noise fixed by seed.
    ``references``: ``right``, ``shuffled`` (each sample given another sample's reference) or ``none``."""
    from rayflux.train import flow

    gen = torch.Generator().manual_seed(NOISE_SEED)
    for size, lat in sorted(ss.enc.latents.items()):
        text = {k: v[ss.enc.captions[size]] for k, v in ss.enc.text.items()}
        refs = None
        if references != "none" and ss.refs is not None:
            refs = ss.refs[size] if references == "right" else ss.refs[size].roll(1, dims=0)
        for sigma in flow.eval_sigmas(SIGMAS, "logit_normal").tolist():
            yield lat, text, refs, torch.randn(lat.shape, generator=gen), sigma


@torch.no_grad()
def eval_loss(model, ss: ScoreSet, references: str = "right") -> float:
    """Mean flow-matching loss over the set and the σ grid."""
    total, n = 0.0, 0
    for lat, text, refs, noise, sigma in _walk(ss, references):
        pred, target = _predict(model, lat, text, sigma, noise, refs)
        total += float(((pred - target) ** 2).mean(dim=(1, 2)).sum())
        n += lat.shape[0]
    return total / n


@torch.no_grad()
def drift(model, base_model, ss: ScoreSet) -> float:
    """How far ``model``'s predictions moved from ``base_model``'s on the set: mean squared difference over the
    mean squared base prediction (0: unchanged)."""
    moved, size = 0.0, 0.0
    for lat, text, refs, noise, sigma in _walk(ss, "right"):
        pred, _ = _predict(model, lat, text, sigma, noise, refs)
        ref, _ = _predict(base_model, lat, text, sigma, noise, refs)
        moved += float(((pred - ref) ** 2).mean())
        size += float((ref**2).mean())
    return moved / size
