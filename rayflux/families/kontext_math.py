"""FLUX.1 Kontext's image conditioning as small pure functions.

Kontext is FLUX.1 with the edit's reference image fed as extra tokens: the reference is encoded like a target
(VAE mode, then ``(x - shift) * scale``), packed 2x2 into tokens exactly as FLUX.1 packs latents, and given the
target's row/column ids with the first axis set to 1, so attention can tell it from the target (axis 0 = 0).
Conventions are those of diffusers' ``FluxKontextPipeline``; the tests check them bitwise.
"""

from __future__ import annotations

import torch

from rayflux.train import flow

REFERENCE_ID = 1
"""The value of the first position axis on every reference token (the target's tokens have 0)."""


def reference_tokens(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W] -> [B, (H/2)(W/2), 4C]``: a normalised reference latent packed as FLUX.1 packs a target."""
    return flow.pack(latents)


def reference_ids(height: int, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """``[(H/2)(W/2), 3]`` ids of a ``height`` x ``width`` reference latent's tokens: ``(1, row, column)``."""
    ids = flow.image_ids(height, width, device=device, dtype=dtype)
    ids[:, 0] = REFERENCE_ID
    return ids
