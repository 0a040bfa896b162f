"""A fixed, seeded render through a diffusers ``FluxPipeline``, for tests that compare outputs before and after a
LoRA is loaded."""

from __future__ import annotations

import torch


def render(pipe):
    """One 64×64 image of a fixed prompt in two steps from a fixed seed, as a numpy array."""
    return pipe(
        "a red circle on a blue background",
        height=64,
        width=64,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images[0]
