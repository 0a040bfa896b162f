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
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from rayflux import datasets, families, gpu_memory, models, phases
from rayflux.gpu_memory import GIB
from rayflux.config import JobConfig
from rayflux.config import base_dtype as base_dtype_rules
from rayflux.config.token_routing import parse as parse_routing
from rayflux.train import attention, optim, shard_load, sharding, step, token_routing
from rayflux.train.adapter import lora_plus
from rayflux.train.adapter import base_weights, ema, kohya, lora
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
    """The transformer with its LoRA adapter, ``train.optim.name`` and the LR schedule over ``total_steps`` optimizer
    steps.

    ``wrap`` turns the transformer into the module the forward pass goes through (Ray Train's ``prepare_model``,
    i.e. DDP with several workers); in-process it is the transformer itself. ``transformer``, when given, is used
    instead of loading ``model.path`` (already on ``device`` in the weight dtype). ``topology`` (Ray Train's view of
    the workers) lets ``train.workers.base_fsdp`` shard the frozen base; without it every process holds all of it.
    ``text_length``: the model's text tokens per sample (the driver's ``ModelFacts``); read from ``model.path``'s
    configs when not given. ``total_steps`` may be a callable, called once the base is loaded (the training loop
    reads its first batch, which knows the planned step count, while the model loads).
    """

    def __init__(
        self,
        cfg: JobConfig,
        device,
        total_steps: int | Callable[[], int],
        *,
        rank: int = 0,
        empty: EmptyCaption | None = None,
        wrap=None,
        transformer=None,
        topology: sharding.Topology | None = None,
        text_length: int | None = None,
    ):
        t = cfg.train
        self.cfg, self.device, self.empty = cfg, torch.device(device), empty
        self.memory: gpu_memory.Estimate | None = None  # this process's estimate as the run uses it (see _plan_memory)
        self.dtype = models.torch_dtype(cfg.model.dtype, self.device.type)
        self.autocast = optim.autocast_dtype(t.mixed_precision, self.device.type)
        # The same seed on every rank gives every rank the same fresh adapter (DDP also broadcasts rank 0's).
        torch.manual_seed(t.seed)
        base_weights.check_worker(t.base_dtype, self.device)  # before any load: CUDA, compute capability, package
        optim.check_worker(t.optim.name, self.device)  # likewise: CUDA for 8-bit AdamW, the optimizer's package
        attention.exclude_faulting_kernels(self.device)
        self.text_length = text_length or models.model_facts(cfg.model).text_length
        # A transformer built elsewhere (benchmarks at real widths with random weights) skips model.path.
        self.layout: sharding.Layout | None = None
        if transformer is None:
            phases.mark("model_load_start")
            transformer = self._load_base(rank, topology)
            phases.mark("model_load_end")
        self.transformer = transformer
        self.family = families.of_transformer(transformer)
        self.params = lora.add_lora(
            self.transformer,
            t.adapter.rank,
            t.adapter.alpha,
            t.adapter.targets,
            t.adapter.lora_dropout,
            t.adapter.kind,
            **lora.patterns_of(t),
        )
        base_weights.convert(self.transformer, t.base_dtype)  # fp8: after the LoRA, so its filter can skip it
        if t.checkpoint.output_format == "kohya":
            kohya.check_adapter(self.transformer)  # before training, not at export
        if t.adapter.init_lora:
            lora.init_from_file(self.transformer, t.adapter.init_lora)
        self.checkpointing = self._plan_memory(rank)
        if self.checkpointing:
            self.transformer.enable_gradient_checkpointing()
        if t.compile:  # after the adapter and checkpointing: the compiled blocks trace what the step will run
            self.family.compile_blocks(self.transformer)
        # TREAD: hooks on the bare transformer's blocks, which DDP's wrap below still runs.
        self.router = token_routing.attach(self.transformer, parse_routing(t.token_routing), self.family)
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)
        self.shift_config = models.shift_config(cfg.model)
        # Resolved only now when a callable: the training loop reads the feed's first batch meanwhile.
        self.total_steps = total_steps() if callable(total_steps) else total_steps
        groups = lora_plus.param_groups(self.transformer, self.params, t.optim.lora_plus_ratio, t.optim.learning_rate)
        self.optimizer, self.scheduler = optim.build(groups, t, self.total_steps, self.device)
        if self.layout:
            sharding.broadcast_from_first(self.params)  # as DDP's wrap would: rank 0's adapter everywhere
            wrap = None  # the LoRA's gradients are averaged in train_step instead of by DDP
        if wrap:
            exclude_frozen_from_ddp(self.transformer)
        self.model = wrap(self.transformer) if wrap else self.transformer
        self.model.train()
        # After the wrap, which broadcasts rank 0's adapter: every rank's average starts from the same weights.
        self.ema = ema.AdapterEma(self.params, t.optim.ema_decay) if t.optim.ema_decay else None
        seed_everything(worker_seed(t.seed, rank))

    def _load_base(self, rank: int, topology: sharding.Topology | None):
        """The frozen transformer, whole or sharded as ``train.workers.base_fsdp`` decides; logs the choice (rank 0)."""
        t, m = self.cfg.train, self.cfg.model
        mode = t.workers.base_fsdp if topology and topology.world > 1 else "none"  # one worker: nothing to shard
        if mode == "auto" and (not base_dtype_rules.shardable(t.base_dtype) or t.adapter.kind != "lora"):
            # An fp8 or nf4 base is not FSDP2's to shard (see rayflux.config.base_dtype), nor a DoRA's or LoKr's.
            mode = "none"
        meta = None
        if mode == "auto":
            # Built once: counted here, and sharded and filled in place below when the choice is node.
            meta = shard_load.meta_transformer(m, self.dtype)
            whole = self._weight_bytes(base_weights.counts(meta), None)
            trainable = lora.trainable_count(
                meta, t.adapter.rank, t.adapter.targets, t.adapter.kind, t.adapter.rank_pattern
            )
            without, with_, on, device_bytes = self._estimates(dict(meta.config), whole, trainable)
            mode = sharding.choose(
                mode, self.device.type == "cuda", topology.local_world, (with_ if on else without).total, device_bytes
            )
            # Uneven nodes may see different worker counts: shard if any rank must, so every rank agrees.
            mode = "node" if sharding.any_rank(mode == "node", self.device) else "none"
        if mode == "none":
            transformer = models.load_transformer(
                m, str(self.device), self.dtype, base_weights.load_kwargs(t.base_dtype)
            )
            if rank == 0:
                log.info(
                    "base sharding: none (train.workers.base_fsdp=%s); the whole base, %.2f GiB, on every worker",
                    t.workers.base_fsdp,
                    sharding.whole_bytes(transformer) / GIB,
                )
            return transformer
        self.layout = sharding.gather_layout(topology, self.device)
        mesh = sharding.build_mesh(self.layout, self.device.type)
        transformer = shard_load.load(m, self.device, self.dtype, mesh, meta)
        if rank == 0:
            whole, mine = sharding.whole_bytes(transformer) / GIB, sharding.local_bytes(transformer) / GIB
            log.info(
                "base sharding: node (train.workers.base_fsdp=%s), mesh %s (%s); base %.2f GiB, %.2f GiB a worker",
                t.workers.base_fsdp,
                "x".join(map(str, self.layout.shape)),
                self.layout.reason,
                whole,
                mine,
            )
        torch.manual_seed(t.seed)  # the adapter's init draws as after a whole load
        return transformer

    def _weight_bytes(self, counts, layout: sharding.Layout | None) -> int:
        """Bytes of the frozen base on this worker's device: whole, or its share of a ``layout`` plus the blocks FSDP2
        gathers (:func:`rayflux.gpu_memory.per_gpu_weight_bytes`, the figure ``python -m rayflux plan`` prints)."""
        mode, shards = ("node", layout.shards) if layout else ("none", 1)
        return int(
            gpu_memory.per_gpu_weight_bytes(counts, self.cfg.train.base_dtype, mode, shards, self.dtype.itemsize)
        )

    def _estimates(self, tc: dict, weight_bytes: int, trainable: int):
        """This run's memory estimates per process (``weight_bytes`` of frozen base, ``trainable`` LoRA parameters)
        without and with gradient checkpointing, whether ``train.gradient_checkpointing`` turns it on (see
        :func:`rayflux.gpu_memory.gradient_checkpointing`), and the device's bytes (0 on CPU)."""
        on_gpu = self.device.type == "cuda"
        device_bytes = torch.cuda.get_device_properties(self.device).total_memory if on_gpu else 0
        act_bytes = torch.finfo(self.autocast or torch.float32).bits // 8
        without, with_, on = gpu_memory.run_estimates(
            self.cfg,
            tc,
            weight_bytes,
            trainable,
            text=self.text_length,
            activation_bytes=act_bytes,
            device_bytes=device_bytes,
        )
        return without, with_, on, device_bytes

    def _plan_memory(self, rank: int) -> bool:
        """Decide ``train.gradient_checkpointing`` from this run's memory estimate (a sharded base counts this
        worker's share and the blocks it gathers), and log the estimate once (rank 0)."""
        t = self.cfg.train
        trainable = sum(p.numel() for p in self.params)
        counts = base_weights.counts(self.transformer)
        whole, mine = self._weight_bytes(counts, None), self._weight_bytes(counts, self.layout)
        without, with_, on, device_bytes = self._estimates(dict(self.transformer.config), mine, trainable)
        self.memory = with_ if on else without
        pixels = max(ds.resolution for ds in datasets.datasets_of(self.cfg.data))
        if rank == 0:
            used = self.memory
            log.info(
                "memory estimate per process at %d px, batch %d: weights %.1f GiB, LoRA + %s %.2f GiB, activations "
                "%.1f GiB (%.1f without checkpointing, %.1f with); gradient checkpointing %s (%s)%s",
                pixels,
                t.batch_size,
                used.weights / GIB,
                t.optim.name + (" + EMA" if t.optim.ema_decay else ""),
                used.lora_optimizer / GIB,
                used.activations / GIB,
                without.activations / GIB,
                with_.activations / GIB,
                "on" if on else "off",
                t.gradient_checkpointing,
                f"; device {device_bytes / GIB:.0f} GiB" if device_bytes else "",
            )
            share = (
                f"{self.layout.shards} shards + {gpu_memory.GATHERED_BLOCKS} gathered blocks: "
                f"{mine / GIB:.2f} GiB a worker"
                if self.layout
                else "whole on every worker"
            )
            log.info(
                "frozen base: train.base_dtype=%s (%.2f bytes a parameter, %.1f GiB), train.workers.base_fsdp=%s (%s)",
                t.base_dtype,
                whole / counts.total,
                whole / GIB,
                t.workers.base_fsdp,
                share,
            )
        return on

    def train_step(self, batches: list[step.Batch]) -> StepStats:
        """Forward and backward every batch (gradients averaged over them), clip, then one optimizer step."""
        phases.mark("step_start")
        t = self.cfg.train
        lr = optim.step_lr(self.optimizer, t)
        step_args = (t, self.guidance_embeds, self.empty, step.Runtime(self.device, self.dtype, self.family))
        losses = []
        for i, batch in enumerate(batches):
            # DDP all-reduces gradients only on the last batch of the group; earlier ones just accumulate.
            last = i == len(batches) - 1
            sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
            autocast = torch.autocast(self.device.type, self.autocast or torch.float32, enabled=bool(self.autocast))
            if self.router:
                self.router.seed(batch.seed)
            with sync:
                with autocast:  # the forward only; backward runs in the dtypes the forward chose
                    loss = step.flow_loss(self.model, batch, *step_args, shift_config=self.shift_config)
                (loss / len(batches)).backward()
            losses.append(float(loss.detach()))
        if self.layout:
            sharding.all_reduce_mean(self.params)  # what DDP's reducer does after the last batch
        # With clipping off, an infinite limit still returns the norm and leaves the gradients alone.
        limit = t.optim.max_grad_norm if t.optim.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, limit))
        self.optimizer.step()
        self.scheduler.step()
        if self.ema:
            self.ema.step(self.params)
        self.optimizer.zero_grad(set_to_none=True)
        phases.mark("step_end")
        return StepStats(sum(losses) / len(losses), grad_norm, lr, sum(int(b.latents.shape[0]) for b in batches))

    @contextlib.contextmanager
    def optimizer_eval(self):
        """The LoRA as it should be used, for the length of the block: validation renders, eval loss, export and
        checkpoint LoRA files. A schedule-free optimizer trains at an interpolation and is used at its average, so
        its ``eval()`` swaps the average in; on leaving, ``train()`` swaps back and the exact training weights are
        put back (the swap's floating-point round trip must not move training, so a run that checkpoints or renders
        trains exactly as one that does not). Other optimizers: nothing changes. Local to this process."""
        if not optim.has_modes(self.optimizer):
            yield
            return
        kept = [p.detach().clone() for p in self.params]
        self.optimizer.eval()
        try:
            yield
        finally:
            self.optimizer.train()
            with torch.no_grad():
                for p, k in zip(self.params, kept):
                    p.copy_(k)

    @contextlib.contextmanager
    def eval_weights(self):
        """The LoRA that eval loss, the best-LoRA file and validation renders use, for the length of the block: the
        EMA (``train.optim.ema_decay``) when there is one, else :meth:`optimizer_eval`'s. The exact training weights are
        back after it."""
        if self.ema is None:
            with self.optimizer_eval():
                yield
            return
        with self.ema.swapped_in(self.params):
            yield

    def state_dict(self) -> dict:
        """Optimizer and scheduler state (the LoRA weights are saved as a LoRA file beside it, in the
        :meth:`optimizer_eval` form); a schedule-free optimizer's training weights too, in parameter order; the
        EMA's state (``train.optim.ema_decay``)."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if optim.has_modes(self.optimizer):
            state["train_weights"] = [p.detach().clone() for p in self.params]
        if self.ema:
            state["ema"] = self.ema.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if "train_weights" in state:
            if len(state["train_weights"]) != len(self.params):
                raise ValueError("the checkpoint's training weights do not match this adapter's parameters")
            with torch.no_grad():
                for p, w in zip(self.params, state["train_weights"]):
                    p.copy_(w.to(p.device))
        if self.ema and "ema" in state:
            self.ema.load_state_dict(state["ema"], self.params)
        elif self.ema:  # ema_decay set on the resume of a run without one: the average starts here
            log.warning("train.optim.ema_decay: the checkpoint holds no EMA; the average starts from its weights")
            self.ema = ema.AdapterEma(self.params, self.cfg.train.optim.ema_decay)


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
