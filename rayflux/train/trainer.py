"""The LoRA model and its optimizer: build once, then one optimizer step per group of accumulated batches.

Ray-free on purpose: the Ray Train loop and the in-process tests (golden losses, exact resume) drive this same
class, so what the tests pin down is what the workers run.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import random
from dataclasses import dataclass

import numpy as np
import torch

from rayflux import datasets, families, models, plan, plan_base
from rayflux.config import JobConfig
from rayflux.train import base_weights, kohya, lora, optim, step
from rayflux.train.step import EmptyCaption

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What one optimizer step did on this rank."""

    loss: float
    """Mean loss over the step's batches on this rank."""
    grad_norm: float
    """LoRA gradient norm before clipping (after DDP's all-reduce, so the same on every rank)."""
    lr: float
    """Learning rate the step used."""
    samples: int
    """Samples this rank trained on in the step."""


def worker_seed(seed: int, rank: int) -> int:
    """The seed of a rank's global RNGs (LoRA dropout), distinct per rank and stable across runs."""
    return int.from_bytes(hashlib.sha256(f"{seed}:worker:{rank}".encode()).digest()[:8], "little") >> 1


class LoraTrainer:
    """The transformer with its LoRA adapter, AdamW and the LR schedule over ``total_steps`` optimizer steps.

    ``wrap`` turns the transformer into the module the forward pass goes through (Ray Train's ``prepare_model``,
    i.e. DDP with several workers); in-process it is the transformer itself. ``transformer``, when given, is used
    instead of loading ``model.path`` (already on ``device`` in the weight dtype).
    """

    def __init__(self, cfg: JobConfig, device, total_steps: int, rank: int = 0, empty: EmptyCaption | None = None,
                 wrap=None, transformer=None):  # fmt: skip
        t = cfg.train
        self.cfg, self.device, self.empty = cfg, torch.device(device), empty
        self.dtype = models.torch_dtype(cfg.model.dtype, self.device.type)
        self.autocast = optim.autocast_dtype(t.mixed_precision, self.device.type)
        # The same seed on every rank gives every rank the same fresh adapter (DDP also broadcasts rank 0's).
        torch.manual_seed(t.seed)
        base_weights.check_worker(t.base_dtype, self.device)  # before any load: CUDA, compute capability, package
        # A transformer built elsewhere (benchmarks at real widths with random weights) skips model.path.
        if transformer is None:
            transformer = models.load_transformer(cfg.model, str(self.device), self.dtype,
                                                  base_weights.load_kwargs(t.base_dtype))  # fmt: skip
        self.transformer = transformer
        self.family = families.of_transformer(transformer)
        self.params = lora.add_lora(self.transformer, t.rank, t.alpha, t.targets, t.lora_dropout)
        base_weights.convert(self.transformer, t.base_dtype)  # fp8: after the LoRA, so its filter can skip it
        if t.output_format == "kohya":
            kohya.check_targets(sorted(self.transformer.peft_config[lora.ADAPTER].target_modules),
                                self.family.kohya_blocks)  # fmt: skip
        if t.init_lora:
            lora.init_from_file(self.transformer, t.init_lora)
        self.checkpointing = self._plan_memory(rank)
        if self.checkpointing:
            self.transformer.enable_gradient_checkpointing()
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)
        self.shift_config = models.shift_config(cfg.model)
        self.optimizer, self.scheduler = optim.build(self.params, t, total_steps)
        if wrap:
            exclude_frozen_from_ddp(self.transformer)
        self.model = wrap(self.transformer) if wrap else self.transformer
        self.model.train()
        seed_everything(worker_seed(t.seed, rank))

    def _plan_memory(self, rank: int) -> bool:
        """Decide ``train.gradient_checkpointing`` (``auto``: see :func:`rayflux.plan.gradient_checkpointing`) from
        this run's memory estimate, and log the estimate once (rank 0)."""
        t = self.cfg.train
        on_gpu = self.device.type == "cuda"
        device_bytes = torch.cuda.get_device_properties(self.device).total_memory if on_gpu else 0
        pixels = max(ds.resolution for ds in datasets.datasets_of(self.cfg.data))
        trainable = sum(p.numel() for p in self.params)
        linear, other = base_weights.frozen_split(self.transformer)
        frozen = linear + other
        tc = dict(self.transformer.config)
        base = plan_base.weight_bytes(plan_base.BaseCounts(frozen, linear), t.base_dtype, self.dtype.itemsize)
        sizes = (base / frozen, torch.finfo(self.autocast or torch.float32).bits // 8)
        text = models.model_facts(self.cfg.model).text_length
        without, with_ = (plan.estimate(tc, frozen, trainable, pixels, t.batch_size, c, *sizes, text=text)
                          for c in (False, True))  # fmt: skip
        on = plan.gradient_checkpointing(t.gradient_checkpointing, on_gpu, pixels, without.total, device_bytes)
        if rank == 0:
            used = with_ if on else without
            log.info(
                "memory estimate per process at %d px, batch %d: weights %.1f GiB, LoRA + AdamW %.2f GiB, activations "
                "%.1f GiB (%.1f without checkpointing, %.1f with); gradient checkpointing %s (%s)%s",
                pixels, t.batch_size, used.weights / plan.GIB, used.lora_optimizer / plan.GIB,
                used.activations / plan.GIB, without.activations / plan.GIB, with_.activations / plan.GIB,
                "on" if on else "off",
                t.gradient_checkpointing, f"; device {device_bytes / plan.GIB:.0f} GiB" if on_gpu else "",
            )  # fmt: skip
            log.info("frozen base: train.base_dtype=%s (%.2f bytes a parameter, %.1f GiB), train.base_sharding=%s",
                     t.base_dtype, base / frozen, base / plan.GIB, t.base_sharding)  # fmt: skip
        return on

    def train_step(self, batches: list[step.Batch]) -> StepStats:
        """Forward and backward every batch (gradients averaged over them), clip, then one optimizer step."""
        t = self.cfg.train
        lr = self.optimizer.param_groups[0]["lr"]
        step_args = (t, self.guidance_embeds, self.empty, self.device, self.dtype, self.family)
        losses = []
        for i, batch in enumerate(batches):
            # DDP all-reduces gradients only on the last batch of the group; earlier ones just accumulate.
            last = i == len(batches) - 1
            sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            autocast = torch.autocast(self.device.type, self.autocast or torch.float32, enabled=bool(self.autocast))
            with sync:
                with autocast:  # the forward only; backward runs in the dtypes the forward chose
                    loss = step.flow_loss(self.model, batch, *step_args, shift_config=self.shift_config)
                (loss / len(batches)).backward()
            losses.append(float(loss.detach()))
        # With clipping off, an infinite limit still returns the norm and leaves the gradients alone.
        limit = t.max_grad_norm if t.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, limit))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(sum(losses) / len(losses), grad_norm, lr, sum(int(b.latents.shape[0]) for b in batches))

    def state_dict(self) -> dict:
        """Optimizer and scheduler state (the LoRA weights are saved as a LoRA file beside it)."""
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


def exclude_frozen_from_ddp(module) -> list[str]:
    """Leave every frozen parameter and every buffer out of DDP: its start-up broadcast (the whole 12B model from
    rank 0 at each start, restart and resize) and its gradient all-reduce. Every rank loaded the same weights from
    ``model.path``; only the LoRA trains, and it stays synchronised. Returns the names left out."""
    from torch.nn.parallel import DistributedDataParallel

    names = [n for n, p in module.named_parameters() if not p.requires_grad] + [n for n, _ in module.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, names)
    return names


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python and numpy global RNGs."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
