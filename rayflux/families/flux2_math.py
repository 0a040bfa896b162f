"""FLUX.2 latent and position math as small pure functions (tensors in, tensors out; no model, no I/O).

FLUX.2 differs from FLUX.1 in where the 2x2 patches go: the VAE's latent is *patchified* (each 2x2 patch becomes
4x the channels, 32 -> 128 for the real VAE) and normalised per channel by the VAE's batch-norm running statistics;
the transformer then takes every latent cell as one token (no further packing). Positions have four axes
``(t, h, w, l)``: images use ``(t, row, column, 0)``, text ``(0, 0, 0, index)``, and each reference image of an edit
its own ``t``. The conventions are those of diffusers' ``Flux2Pipeline`` and ``Flux2KleinPipeline``; the tests
check every function against them bitwise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

REFERENCE_T_SCALE = 10
"""The t-coordinate step between reference images: reference ``i`` (from 0) sits at ``t = 10 + 10 i``, the target
at ``t = 0``."""


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W] -> [B, 4C, H/2, W/2]``: each 2x2 patch into channels, channel ``4c + 2dy + dx``."""
    b, c, h, w = latents.shape
    if h % 2 or w % 2:
        raise ValueError(f"latent height and width must be even to patchify 2x2, got {h}x{w}")
    x = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return x.reshape(b, c * 4, h // 2, w // 2)


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`patchify`: ``[B, 4C, H, W] -> [B, C, 2H, 2W]``."""
    b, c4, h, w = latents.shape
    if c4 % 4:
        raise ValueError(f"a patchified latent has a multiple of 4 channels, got {c4}")
    x = latents.reshape(b, c4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return x.reshape(b, c4 // 4, h * 2, w * 2)


def _bn_mean_std(latents: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float):
    # The standard deviation is formed in the statistics' own dtype, then both are cast to the latent's, in the
    # same order as the pipelines, so a bf16 latent rounds the same way theirs does.
    std = torch.sqrt(var.reshape(1, -1, 1, 1) + eps)
    cast = {"device": latents.device, "dtype": latents.dtype}
    return mean.reshape(1, -1, 1, 1).to(**cast), std.to(**cast)


def bn_normalize(latents: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` per channel of a patchified ``[B, 4C, H, W]`` latent.

    ``mean``, ``var`` and ``eps`` are the VAE's ``bn.running_mean``, ``bn.running_var`` and
    ``config.batch_norm_eps`` (:func:`vae_bn_stats`)."""
    m, s = _bn_mean_std(latents, mean, var, eps)
    return (latents - m) / s


def bn_denormalize(latents: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float) -> torch.Tensor:
    """Inverse of :func:`bn_normalize`: ``x * sqrt(var + eps) + mean``, before unpatchify and VAE decode."""
    m, s = _bn_mean_std(latents, mean, var, eps)
    return latents * s + m


def normalize_latent(latents: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float) -> torch.Tensor:
    """The latent FLUX.2 works in from the VAE's ``[B, C, H, W]`` output: patchified, then batch-norm normalised
    (``[B, 4C, H/2, W/2]``), as the pipelines encode reference images."""
    return bn_normalize(patchify(latents), mean, var, eps)


def denormalize_latent(latents: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float) -> torch.Tensor:
    """Inverse of :func:`normalize_latent`: what the VAE decodes, ``[B, 4C, H, W] -> [B, C, 2H, 2W]``."""
    return unpatchify(bn_denormalize(latents, mean, var, eps))


def vae_bn_stats(vae) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(mean, var, eps)`` of an ``AutoencoderKLFlux2``, the arguments of :func:`bn_normalize`."""
    return vae.bn.running_mean, vae.bn.running_var, float(vae.config.batch_norm_eps)


def pack(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W] -> [B, H*W, C]``: every cell of a patchified latent is one token, in row-major order."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`pack` for a ``height`` x ``width`` (patchified) latent: ``[B, H*W, C] -> [B, C, H, W]``."""
    b, n, c = tokens.shape
    if n != height * width:
        raise ValueError(f"{n} tokens cannot form a {height}x{width} latent")
    return tokens.permute(0, 2, 1).reshape(b, c, height, width)


def _grid_ids(t: int, height: int, width: int, device=None) -> torch.Tensor:
    ids = torch.zeros(height, width, 4, dtype=torch.int64, device=device)
    ids[..., 0] = t
    ids[..., 1] = torch.arange(height, device=device)[:, None]
    ids[..., 2] = torch.arange(width, device=device)[None, :]
    return ids.reshape(height * width, 4)


def latent_ids(height: int, width: int, device=None) -> torch.Tensor:
    """``[H*W, 4]`` int64 ids ``(0, row, column, 0)`` of a (patchified) latent's tokens, in :func:`pack` order.

    The pipelines build the same rows batched (``[B, H*W, 4]``); the transformer uses the first batch row only."""
    return _grid_ids(0, height, width, device)


def text_ids(length: int, device=None) -> torch.Tensor:
    """``[L, 4]`` int64 ids ``(0, 0, 0, index)`` of ``length`` text tokens."""
    ids = torch.zeros(length, 4, dtype=torch.int64, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids


def reference_t(index: int) -> int:
    """The t-coordinate of reference image ``index`` (0-based) of an edit."""
    return REFERENCE_T_SCALE + REFERENCE_T_SCALE * index


def reference_ids(sizes: Sequence[tuple[int, int]], device=None) -> torch.Tensor:
    """``[sum(h*w), 4]`` int64 ids of the references of one edit, in order: reference ``i`` (its patchified latent
    ``h`` x ``w``) at ``t =`` :func:`reference_t` ``(i)``, its own rows and columns from 0."""
    if not sizes:
        raise ValueError("an edit has at least one reference image")
    return torch.cat([_grid_ids(reference_t(i), h, w, device) for i, (h, w) in enumerate(sizes)])


def cached_references(references: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [B, k*h*w, C], ids [k*h*w, 4])`` of a batch's cached reference latents ``[B, k, C, h, w]`` (the
    cache's ``ref_latent``: normalised, patchified, cut with their target), for :func:`~rayflux.families.references.
    with_references`."""
    b, k, c, h, w = references.shape
    return reference_tokens(list(references.unbind(1))), reference_ids([(h, w)] * k, device=references.device)


def reference_tokens(latents: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[B, sum(h*w), C]``: the packed tokens of each reference's normalised, patchified ``[B, C, h, w]`` latent,
    concatenated in reference order (the order of :func:`reference_ids`)."""
    if not latents:
        raise ValueError("an edit has at least one reference image")
    return torch.cat([pack(x) for x in latents], dim=1)
