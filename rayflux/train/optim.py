"""AdamW with a warmup + constant/cosine learning-rate schedule, and the mixed-precision choice."""

from __future__ import annotations

import math

import torch

from rayflux.config import TrainConfig


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based).

    Warmup is linear from ``1/warmup_steps`` (never 0: a zero first step would waste a batch) up to 1. After it,
    ``constant`` stays at 1 and ``cosine`` falls from 1 to 0 at ``total_steps`` and stays there.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return 0.5 * (1 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_scheduler {schedule!r}")


def build(params: list, t: TrainConfig, total_steps: int):
    """AdamW over the LoRA parameters and its LambdaLR schedule spanning ``total_steps`` optimizer steps."""
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)
    # A closure, not a lambda object with state: LambdaLR then saves only its step count, which is all it needs.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, t.warmup_steps, total_steps, t.lr_scheduler)
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
