"""Whether the training worker group may start while the cache stage runs, and with what the encoders keep.

Nothing the worker group does before its first read depends on the cache's bytes: its processes start, import torch,
load the base and attach the LoRA, and only the plan (the step count) and the reads need the committed generation
(:mod:`rayflux.train.handoff`). So the group starts first wherever it fits beside the encoders: the workers'
reservation (their CPUs, GPUs and extra resources, and the render actor's) is taken out of the cluster, and the
encoder pools are sized to what is left, by the cache's own pre-flight (:func:`rayflux.cache.fit.plan`). Where they
do not fit (no CPU left for the preparation and writer tasks, or no GPU left beside the workers' for the encoders),
the old order stays: the cache stage, then the group, so nothing waits on resources held by a stage that waits on it.

A training worker reserves its GPU whole (the render actor's share included), and the encoders take GPUs the workers
do not use. Where no GPU is left for them (every GPU trains), a worker and an encoder actor share each GPU, but only
where the memory planner says both fit in it (:mod:`rayflux.train.gpu_sharing`); otherwise the old order stays. On a
CPU-only cluster the workers' fractional CPUs (``train.workers.cpus_per_worker``) leave the encoders the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayflux.config import JobConfig, resource_map, worker_range
from rayflux.config.placement import Cluster, place


@dataclass(frozen=True)
class Choice:
    """Where the trainer run starts."""

    encoders: object
    """The encoder pools' :class:`rayflux.cache.fit.Plan` beside the started group; None: the old order."""
    reason: str
    """Why (one line for the log)."""
    encoder_share: float = 0.0
    """The share of each training GPU left to one encoder actor (:mod:`rayflux.train.gpu_sharing`); 0: none."""

    @property
    def early(self) -> bool:
        return self.encoders is not None


def reservation(cfg: JobConfig, cluster_gpus: bool, cluster: dict) -> dict[str, float]:
    """What the trainer run holds while it waits: every worker at the elastic maximum, and the render actor."""
    from rayflux.train.observe import renderer

    w = cfg.train.workers
    _, hi = worker_range(w.num_workers)
    need: dict[str, float] = {"CPU": hi * w.cpus_per_worker}
    for name, amount in resource_map("train.workers.worker_resources", w.worker_resources).items():
        need[name] = need.get(name, 0.0) + hi * float(amount)
    use_gpu = place(cfg, Cluster(gpus=cluster_gpus)).training
    if use_gpu:
        need["GPU"] = float(hi)  # the render actor's share of a worker's GPU included
    if cfg.train.validation.prompts:
        resources, _ = renderer.choose_resources(cfg, use_gpu, cluster)
        share = renderer.gpu_share(resources) if use_gpu else 0.0
        for name, amount in resources.items():
            if not (name == "GPU" and share):
                need[name] = need.get(name, 0.0) + float(amount)
    return need


def choose(cfg: JobConfig, cluster_gpus: bool, cap=None, gpu_bytes: int | None = None) -> Choice:
    """Start the group during the cache stage, or after it (see the module). ``cap``: the cluster's
    :class:`~rayflux.cache.fit.Capacity` (None: as it is now); ``gpu_bytes``: one GPU's memory (None: asked of a GPU,
    only where sharing one is considered)."""
    if not cfg.train.workers.start_during_cache:
        return Choice(None, "train.workers.start_during_cache is off")
    from rayflux.cache import fit

    cap = cap or fit.Capacity.of_cluster()
    held = reservation(cfg, cluster_gpus, cap.now)
    short = [k for k, v in held.items() if cap.now.get(k, 0.0) + 1e-9 < v]
    if short:  # the group itself waits for resources (an autoscaler to add them): no room to plan beside it
        return Choice(None, f"the workers need {', '.join(short)} the cluster does not have yet")
    try:
        encoders = fit.plan(cfg, cluster_gpus, cap.less(held))
    except fit.FitError as exc:
        return _sharing_gpus(
            cfg, cluster_gpus, cap, held, f"the encoders do not fit beside the workers' {_fmt(held)}: {exc}", gpu_bytes
        )
    return Choice(encoders, f"the workers hold {_fmt(held)}; the encoders the rest")


def _sharing_gpus(cfg: JobConfig, cluster_gpus: bool, cap, held: dict, why: str, gpu_bytes: int | None) -> Choice:
    """Where no GPU is left for the encoders: each training GPU split between its worker and one encoder actor, if
    both fit in its memory (:mod:`rayflux.train.gpu_sharing`); else the old order, with ``why``."""
    from rayflux.cache import fit
    from rayflux.caption.fit import probe_gpu
    from rayflux.train import gpu_sharing

    placed = place(cfg, Cluster(gpus=cluster_gpus))
    # Encoders on a GPU type of their own (cache.accelerator_type) never come to the training GPUs.
    if not (placed.training and placed.encoders and held.get("GPU")) or cfg.cache.accelerator_type:
        return Choice(None, why)
    if gpu_bytes is None:
        gpu_bytes = probe_gpu(0.01, cfg.train.workers.accelerator_type)
    split, no = gpu_sharing.judge(cfg, gpu_bytes, cap.now)
    if split is None:
        return Choice(None, f"{why}; and they may not share its GPUs: {no}")
    _, hi = worker_range(cfg.train.workers.num_workers)
    shared = {**held, "GPU": held["GPU"] - hi * split.share}
    try:
        encoders = fit.plan(gpu_sharing.with_share(cfg, split.share), cluster_gpus, cap.less(shared))
    except fit.FitError as exc:
        return Choice(None, f"{why}; and not beside them on their GPUs either: {exc}")
    reason = (
        f"each worker's GPU is shared: the worker {1 - split.share:g}, one encoder {split.share:g} ({split.describe()})"
    )
    return Choice(encoders, reason, split.share)


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in resources.items())
