"""AdamW with one of diffusers' learning-rate schedules (the names every diffusers-based trainer accepts), and the
mixed-precision choice."""

from __future__ import annotations

import torch

from rayflux.config import TrainConfig

SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")
"""``train.lr_scheduler`` values: diffusers' ``get_scheduler`` names, with diffusers' meanings (``constant`` has no
warmup; warmups rise linearly from 0)."""


def build(params: list, t: TrainConfig, total_steps: int):
    """AdamW over the LoRA parameters and diffusers' ``get_scheduler(t.lr_scheduler)`` over ``total_steps`` steps.

    diffusers' schedules are ``LambdaLR`` over plain functions, so their ``state_dict`` holds only the step count:
    it goes through ``torch.load(weights_only=True)`` on resume.
    """
    from diffusers.optimization import get_scheduler

    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)
    scheduler = get_scheduler(
        t.lr_scheduler,
        optimizer,
        num_warmup_steps=t.warmup_steps,
        num_training_steps=total_steps,
        num_cycles=t.lr_cycles,
        power=t.lr_power,
    )
    return optimizer, scheduler


def autocast_dtype(mixed_precision: str, device_type: str):
    """The autocast dtype, or None for plain fp32: ``auto`` means bf16 on GPU only (CPU bf16 matmuls are slow)."""
    if mixed_precision == "bf16" or (mixed_precision == "auto" and device_type == "cuda"):
        return torch.bfloat16
    return None


def total_steps(planned_steps: int, max_steps: int) -> int:
    """Optimizer steps of the whole run (every segment): the planned epochs' steps, capped by ``max_steps`` (0: no cap).
    This is the LR schedule's horizon."""
    return min(planned_steps, max_steps) if max_steps else planned_steps
