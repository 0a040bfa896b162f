"""The ``train.optim.name`` (each from its own package, imported only when chosen) with one of diffusers'
learning-rate schedules (the names every diffusers-based trainer accepts), and the mixed-precision choice."""

from __future__ import annotations

import importlib
import logging

import torch

from rayflux.config import TrainConfig
from rayflux.config.optimizer import OPTIMIZERS, refusal

log = logging.getLogger(__name__)

SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "polynomial")
"""``train.optim.lr_scheduler`` values: diffusers' ``get_scheduler`` names, with diffusers' meanings (``constant`` has no
warmup; warmups rise linearly from 0)."""


def check_worker(name: str, device) -> object:
    """The optimizer's package, imported; or a one-line refusal naming the extra that installs it (or the missing
    GPU). The trainer calls it before loading the model, so a worker that cannot run it fails at once."""
    package = OPTIMIZERS[name].package
    try:
        module = importlib.import_module(package)
    except ImportError:
        module = None
    reason = refusal(name, gpu=torch.device(device).type == "cuda", installed=module is not None)
    if reason:
        raise RuntimeError(reason)
    return module


def make_optimizer(params: list, t: TrainConfig, device) -> torch.optim.Optimizer:
    """``train.optim.name`` over ``params`` with ``train.optim.learning_rate`` and ``train.optim.weight_decay``; every other
    setting is its package's default (Adafactor: a fixed learning rate, as kohya and SimpleTuner run it)."""
    name, lr, wd = t.optim.name, t.optim.learning_rate, t.optim.weight_decay
    module = check_worker(name, device)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd)
    if name == "adamw8bit":
        return module.optim.AdamW8bit(params, lr=lr, weight_decay=wd)
    if name == "prodigy":
        if lr < 0.1:
            log.warning(
                "train.optim.name=prodigy with train.optim.learning_rate=%g: Prodigy estimates its own step size and "
                "the learning rate scales it, 1.0 by its convention",
                lr,
            )
        return module.Prodigy(params, lr=lr, weight_decay=wd)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, weight_decay=wd, scale_parameter=False, relative_step=False, warmup_init=False)
    if name == "schedulefree_adamw":
        # Its own warmup replaces the schedule's (the config check allows only constant schedules with it).
        optimizer = module.AdamWScheduleFree(params, lr=lr, weight_decay=wd, warmup_steps=t.optim.warmup_steps)
        optimizer.train()  # it starts in eval mode, and refuses to step there
        return optimizer
    raise ValueError(f"unknown train.optim.name {name!r}")


def has_modes(optimizer) -> bool:
    """Whether the optimizer keeps different weights for training and for use (schedule-free: it trains at an
    interpolation ``y`` and evaluates, renders and exports the average ``x``), switched by its ``train()`` and
    ``eval()``."""
    return callable(getattr(optimizer, "eval", None)) and callable(getattr(optimizer, "train", None))


def build(params: list, t: TrainConfig, total_steps: int, device="cpu"):
    """``train.optim.name`` over the LoRA parameters and diffusers' ``get_scheduler(t.optim.lr_scheduler)`` over
    ``total_steps`` steps (schedule-free: a constant one; its warmup is the optimizer's own).

    diffusers' schedules are ``LambdaLR`` over plain functions, so their ``state_dict`` holds only the step count:
    it goes through ``torch.load(weights_only=True)`` on resume.
    """
    from diffusers.optimization import get_scheduler

    optimizer = make_optimizer(params, t, device)
    schedule_free = t.optim.name == "schedulefree_adamw"
    scheduler = get_scheduler(
        "constant" if schedule_free else t.optim.lr_scheduler,
        optimizer,
        num_warmup_steps=t.optim.warmup_steps,
        num_training_steps=total_steps,
        num_cycles=t.optim.lr_cycles,
        power=t.optim.lr_power,
    )
    return optimizer, scheduler


def step_lr(optimizer, t: TrainConfig) -> float:
    """The learning rate the next step uses: the schedule's, or for schedule-free its own warmup's."""
    group = optimizer.param_groups[0]
    if t.optim.name == "schedulefree_adamw" and group["k"] < t.optim.warmup_steps:
        return group["lr"] * (group["k"] + 1) / t.optim.warmup_steps
    return group["lr"]


def autocast_dtype(mixed_precision: str, device_type: str):
    """The autocast dtype, or None for plain fp32: ``auto`` means bf16 on GPU only (CPU bf16 matmuls are slow)."""
    if mixed_precision == "bf16" or (mixed_precision == "auto" and device_type == "cuda"):
        return torch.bfloat16
    return None


def total_steps(planned_steps: int, max_steps: int) -> int:
    """Optimizer steps of the whole run (every segment): the planned epochs' steps, capped by ``max_steps`` (0: no cap).
    This is the LR schedule's horizon."""
    return min(planned_steps, max_steps) if max_steps else planned_steps
