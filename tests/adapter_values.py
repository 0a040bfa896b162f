"""The tiny FLUX.1 transformer, and trained-looking adapter values for it: the LoRA, DoRA and LoKr file tests."""

from __future__ import annotations

import torch


def transformer(tiny_model):
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel.from_pretrained(tiny_model, subfolder="transformer")


def randomise(transformer, seed: int) -> None:
    """Seeded random adapter factors, as a trained adapter would have (a fresh LoRA has B = 0: no effect), and DoRA
    magnitudes moved off their base norms."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "lora_" in name or "lokr_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
