"""``train.optim.ema_decay``: an exponential moving average of the adapter's trainable parameters, through diffusers'
``training_utils.EMAModel``.

Settings: ``decay=train.optim.ema_decay`` with EMAModel's default warmup (``use_ema_warmup=False``): the decay of optimizer
step ``n`` is ``min(ema_decay, n / (n + 9))``, 0 at step 1. That is SimpleTuner's EMA, where ``use_ema`` and
``ema_decay`` come from, so the number means there what it means here. The average is kept in fp32 on the
parameters' device (``foreach`` updates: one kernel per step for all the adapter's tensors, not one per tensor).

**Every rank keeps its own copy**, not rank 0 alone: after DDP's all-reduce (or the sharded base's
``all_reduce_mean``) and the same optimizer step, every rank holds bitwise the same adapter, so every rank's average
is the same with no communication at all, and every rank needs it: each scores its share of the eval loss with the
averaged weights. The cost is 4 bytes a trainable parameter per worker.
Only rank 0 writes it into checkpoints; every rank restores it from ``train_state.pt`` on resume.
"""

from __future__ import annotations

import contextlib

import torch


class AdapterEma:
    """The moving average of ``params`` (the adapter's trainable parameters, in a fixed order)."""

    def __init__(self, params: list, decay: float):
        from diffusers.training_utils import EMAModel

        self.decay = decay
        self.model = EMAModel(params, decay=decay, foreach=True)

    def step(self, params: list) -> None:
        """Fold the parameters after an optimizer step into the average."""
        self.model.step(params)

    @property
    def steps(self) -> int:
        """Optimizer steps folded in so far."""
        return self.model.optimization_step

    @contextlib.contextmanager
    def swapped_in(self, params: list):
        """The averaged weights in ``params`` for the length of the block; the exact training weights after it
        (EMAModel's ``store``/``restore`` keep a copy in host memory, so the swap costs no device memory)."""
        self.model.store(params)
        self.model.copy_to(params)
        try:
            yield
        finally:
            self.model.restore(params)

    def state_dict(self) -> dict:
        """EMAModel's state: the averaged tensors (``shadow_params``), its step count and settings."""
        return self.model.state_dict()

    def load_state_dict(self, state: dict, params: list) -> None:
        """Restore a saved average (on the parameters' device: a restart may place ranks elsewhere)."""
        shadow = state.get("shadow_params") or []
        if len(shadow) != len(params) or any(s.shape != p.shape for s, p in zip(shadow, params)):
            raise ValueError("the checkpoint's EMA does not match this adapter's parameters")
        self.model.load_state_dict(state)
        self.model.decay = self.decay  # this run's setting, should a resume change it
        self.model.shadow_params = [s.to(p.device, torch.float32) for s, p in zip(self.model.shadow_params, params)]
