"""Where the GPUs go, and what the config asks of a cluster: the one placement decision, and the checks that need
the cluster beside the config.

``use_gpu=auto`` means "where the cluster has GPUs, or where a GPU type is named" for both the encoders
(``cache.*``) and the training workers (``train.*``): an accelerator type implies GPUs even before the autoscaler
has started any node of that type. Every stage asks :func:`place` rather than reading ``use_gpu`` itself, so the
cache's stored dtype, the encoder pools, the workers' ``ScalingConfig``, the render actor and the sweep's pre-flight
agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayflux.config.base_dtype import refusal as base_dtype_refusal
from rayflux.config.job import JobConfig
from rayflux.config.optimizer import refusal as optimizer_refusal


@dataclass(frozen=True)
class Cluster:
    """What the driver saw of the cluster when the job started (what placement depends on)."""

    gpus: bool
    """The cluster has GPUs right now."""


@dataclass(frozen=True)
class Placement:
    """Which parts of the job run on GPUs."""

    encoders: bool
    """The cache's encoder actors ask for GPUs (``cache.encoders_on_gpu``, ``cache.accelerator_type``)."""
    training: bool
    """The training workers ask for GPUs (``train.workers.on_gpu``, ``train.workers.accelerator_type``)."""
    captioner: bool = False
    """The caption stage's VLM actors ask for GPUs: where the cluster has them or ``caption.accelerator_type`` names
    one (the encoders' ``auto``)."""


def _choose(setting: str, cluster_gpus: bool, accelerator_type: str) -> bool:
    return {"auto": cluster_gpus or bool(accelerator_type), "true": True, "false": False}[setting]


def place(cfg: JobConfig, cluster: Cluster) -> Placement:
    """The job's placement on ``cluster``."""
    return Placement(
        encoders=_choose(cfg.cache.encoders_on_gpu, cluster.gpus, cfg.cache.accelerator_type),
        training=_choose(cfg.train.workers.on_gpu, cluster.gpus, cfg.train.workers.accelerator_type),
        captioner=_choose("auto", cluster.gpus, cfg.caption.accelerator_type),
    )


def validate_for_cluster(cfg: JobConfig, cluster: Cluster) -> None:
    """Refuse, on the driver before any cache or training work, what this cluster cannot train: a lower-precision
    ``train.base_dtype`` or a GPU-only ``train.optim.name`` when the workers would train on CPU. Each worker checks its
    own GPU (and the packages) again as it starts."""
    gpu = place(cfg, cluster).training
    for reason in (
        base_dtype_refusal(cfg.train.base_dtype, gpu=gpu, sharding=cfg.train.workers.base_fsdp),
        optimizer_refusal(cfg.train.optim.name, gpu=gpu),
    ):
        if reason:
            raise ValueError(reason)
