"""FLUX.1 Kontext's image conditioning as small pure functions.

Kontext is FLUX.1 with the edit's reference image fed as extra tokens: the reference is encoded like a target
(VAE mode, then ``(x - shift) * scale``), packed 2x2 into tokens exactly as FLUX.1 packs latents, and given the
target's row/column ids with the first axis set to 1, so attention can tell it from the target (axis 0 = 0).
Conventions are those of diffusers' ``FluxKontextPipeline``; the tests check them bitwise.
"""

from __future__ import annotations

import torch

from rayflux.families import flux1_math

REFERENCE_ID = 1
"""The value of the first position axis on every reference token (the target's tokens have 0)."""


def reference_tokens(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W] -> [B, (H/2)(W/2), 4C]``: a normalised reference latent packed as FLUX.1 packs a target."""
    return flux1_math.pack(latents)


def cached_references(references: torch.Tensor, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B, (H/2)(W/2), 4C], ids [(H/2)(W/2), 3])`` of a batch's cached reference latents
    ``[B, 1, C, H, W]`` (the cache's ``ref_latent``). Kontext conditions on exactly one reference image."""
    b, k, c, h, w = references.shape
    if k != 1:
        raise ValueError(f"FLUX.1 Kontext takes one reference image per edit, got {k}")
    return reference_tokens(references[:, 0]), reference_ids(h, w, device=references.device, dtype=dtype)


def reference_ids(height: int, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """``[(H/2)(W/2), 3]`` ids of a ``height`` x ``width`` reference latent's tokens: ``(1, row, column)``."""
    ids = flux1_math.image_ids(height, width, device=device, dtype=dtype)
    ids[:, 0] = REFERENCE_ID
    return ids
