"""The job's σ schedule: ``train.flow.sigma_sampling`` (``auto``: the model family's own) and ``train.flow.timestep_bias``,
as the keyword arguments of :func:`rayflux.train.flow.sample_sigmas` and :func:`~rayflux.train.flow.eval_sigmas`.

Training and the eval loss both take their σ from here, so the eval grid always spreads as the training draws do.
"""

from __future__ import annotations

from rayflux.config import TrainConfig
from rayflux.families.base import Family
from rayflux.train import flow


def method(sampling: str, family: Family) -> str:
    """``train.sigma_sampling`` with ``auto`` resolved to the family's own pipeline's schedule
    (:attr:`Family.sigma_sampling`)."""
    return family.sigma_sampling if sampling == "auto" else sampling


def options(t: TrainConfig, family: Family, height: int, width: int, shift_config: dict | None) -> dict:
    """The σ draw's settings for a ``height`` x ``width`` stored latent (its token count drives the shifts)."""
    f = t.flow
    return {
        "method": method(f.sigma_sampling, family),
        "logit_mean": f.logit_mean,
        "logit_std": f.logit_std,
        "shift": f.shift,
        "seq_len": family.seq_len(height, width),
        "shift_config": shift_config,
        "bias": flow.TIMESTEP_BIAS[f.timestep_bias],
    }
