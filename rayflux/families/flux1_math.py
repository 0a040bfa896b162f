"""FLUX.1's latent layout as small pure functions: 2x2 latent patches as tokens, and their position ids.

Conventions are diffusers' ``FluxPipeline`` (``_pack_latents``, ``_unpack_latents``, ``_prepare_latent_image_ids``);
tests/test_flow.py checks them bitwise. Kontext packs its reference images the same way (:mod:`.kontext_math`).
"""

from __future__ import annotations

import torch


def pack(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W] -> [B, (H/2)(W/2), 4C]``: 2x2 patches become tokens, as ``FluxPipeline._pack_latents``."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height and width must be even to pack 2x2, got {h}x{w}")
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack` for a latent of ``height`` x ``width``."""
    b, n, d = tokens.shape
    c = d // 4
    if n != (height // 2) * (width // 2):
        raise ValueError(f"{n} tokens cannot form a {height}x{width} latent")
    x = tokens.view(b, height // 2, width // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, height, width)


def image_ids(height: int, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """``[(H/2)(W/2), 3]`` position ids for packed latent tokens: row in channel 1, column in channel 2."""
    h, w = height // 2, width // 2
    ids = torch.zeros(h, w, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(h, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(w, device=device, dtype=dtype)[None, :]
    return ids.reshape(h * w, 3)


def text_ids(length: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """``[L, 3]`` zeros: text tokens carry no spatial position."""
    return torch.zeros(length, 3, device=device, dtype=dtype)
