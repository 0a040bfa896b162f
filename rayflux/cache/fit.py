"""Size the encoder actor pools to the cluster, and refuse a request that can never be scheduled.

Ray Data waits forever for an actor whose reservation no node can satisfy, and a pool that holds every CPU leaves
the preparation tasks that feed it nothing to run on. So before a cache build starts, the requested actors, their
reservations and one preparation plus one writer task are added up against what the cluster has (or what its
autoscaler may add), and a request that cannot fit fails at once with the numbers.

``cache.vae_actors`` / ``cache.text_actors`` ``auto`` size the pools to the cluster: one actor per
``cache.gpus_per_actor`` share of the GPUs when encoders run on GPUs (growing up to the autoscaler's maximum), and on a
CPU-only cluster the CPUs that preparation and writing leave, in actors of up to ``CPU_THREADS_PER_ACTOR`` CPUs.

The text and image passes run at the same time where that is safe (see :mod:`rayflux.cache.passes`). Each pool is
sized as if it ran alone, so either pass can use the whole cluster once the other is done; then one of three joint
rules decides how they share it, recorded in the manifest's ``passes.encoders``:

- **side by side**: both pools' initial actors, one preparation task and two writer tasks (one per pass) fit the
  cluster as it is now. Both passes start at once, both pools at full size.
- **VAE after text**: not even one VAE actor fits beside the text pool's largest size, whatever the tasks hold (two
  CPUs, where each pool takes what the tasks leave; one GPU per actor on as many GPUs as the text pool has). The
  image pass starts as soon as the text pass has written its first shard (so the text actors hold their resources
  and the VAE pool is the one that waits, not the other way round): its preparation (decode, crop, resize) runs
  beside the text encoders, and the VAE actors wait in Ray's queue, holding nothing, until the text actors leave. Ray Data provisions a pool's
  actors asynchronously (``DataContext.wait_for_min_actors_s`` is off), so a waiting pool never blocks the operators
  in front of it, and the stall watch counts both pipelines' progress, so that wait is not taken for a stall.
- **sequential**: anything in between (some VAE actors fit beside the text pool, but not all of them with the
  tasks). A VAE actor started in CPUs freed by a finished task could then leave the text pass's writer none, while
  the text actors wait for that writer: the text pass runs to its end first, then the image pass.

The cluster-wide sums here do not see how resources split across nodes; where that packs worse than the sums, the
stall watch (``cache.stall_seconds``) still turns a wait that never ends into an error.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from rayflux.config import ConfigError, JobConfig, resource_map
from rayflux.config.cache import actor_count, actor_cpus
from rayflux.config.placement import Cluster, place

log = logging.getLogger(__name__)

PREPARE_CPUS = 0.5
"""CPUs of one preparation (decode, crop, resize) task."""
WRITE_CPUS = 0.25
"""CPUs of one shard-writer task."""
CPU_THREADS_PER_ACTOR = 8
"""Most CPUs an ``auto`` CPU encoder actor takes: a conv net's intra-op speed-up flattens out around 8 threads, so a
big node runs several such actors rather than one on every core."""
_EPS = 1e-9
SIDE_BY_SIDE, VAE_AFTER_TEXT, SEQUENTIAL = "side by side", "VAE after text", "sequential"


class FitError(ConfigError):
    """The encoder request can never be scheduled on this cluster (or its autoscaler's largest size)."""


@dataclass(frozen=True)
class PoolSize:
    """An encoder pool's size: Ray Data starts ``initial`` actors and may scale between ``min`` and ``max``."""

    min: int
    initial: int
    max: int


@dataclass(frozen=True)
class Plan:
    """How a cache build runs its encoders on this cluster."""

    resources: dict
    """Ray options of one encoder actor (the same for both pools)."""
    vae: PoolSize
    """The VAE pool, sized as if it ran alone."""
    text: PoolSize
    """The text-encoder pool, sized as if it ran alone."""
    encoders: str
    """The joint rule: :data:`SIDE_BY_SIDE`, :data:`VAE_AFTER_TEXT` or :data:`SEQUENTIAL` (see the module)."""


@dataclass(frozen=True)
class Capacity:
    """What the cluster has now, and the most its autoscaler may grow it to (``None``: no autoscaler config)."""

    now: dict
    most: dict | None
    largest_node_cpus: float

    @staticmethod
    def of_cluster() -> "Capacity":
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        largest = max((n["Resources"].get("CPU", 0.0) for n in nodes), default=0.0)
        return Capacity(dict(ray.cluster_resources()), _autoscaler_max(), largest)

    def less(self, reserved: dict) -> "Capacity":
        """This capacity without ``reserved``: resources another stage holds while the cache builds (a training worker
        group started beside it, :mod:`rayflux.train.early`)."""

        def minus(budget: dict) -> dict:
            return {k: v - float(reserved.get(k, 0.0)) for k, v in budget.items()}

        return Capacity(minus(self.now), None if self.most is None else minus(self.most), self.largest_node_cpus)

    def budget(self, now: bool = True) -> dict:
        """Each resource's total now (or at the autoscaler's maximum, never below now)."""
        if now or self.most is None:
            return dict(self.now)
        return {k: max(self.now.get(k, 0.0), float(self.most.get(k, 0.0))) for k in {*self.now, *self.most}}


def _autoscaler_max() -> dict | None:
    """The autoscaler's largest cluster per resource, as Ray Data's own autoscaling reads it; None when unknown."""
    try:
        from ray._private.state import state

        return state.get_max_resources_from_cluster_config() or None
    except Exception as exc:  # a private API: without it the check uses the cluster as it is now
        log.debug("autoscaler maximum unavailable: %s", exc)
        return None


def _targets_other_nodes(cfg: JobConfig) -> bool:
    return bool(cfg.cache.accelerator_type or cfg.cache.actor_resources)


def _spare_cpus(cap: Capacity) -> float:
    return cap.now.get("CPU", 0.0) - PREPARE_CPUS - WRITE_CPUS


def resources(cfg: JobConfig, gpu: bool, cap: Capacity) -> dict:
    """Ray options of one encoder actor, the same for both pools: each pool is sized as if it ran alone, and
    :func:`plan` decides whether they fit side by side."""
    c = cfg.cache
    cpus = actor_cpus(c.actor_cpus)
    if cpus is None:
        if gpu or _targets_other_nodes(cfg):
            cpus = 1.0  # the actor runs on a node type of its own, whose CPUs this cluster may not show yet
        else:
            spare = _spare_cpus(cap)
            if spare <= _EPS:
                raise FitError(
                    f"cache: the cluster's {cap.now.get('CPU', 0.0):g} CPUs leave none for encoders after "
                    f"{PREPARE_CPUS} CPU for preparation + {WRITE_CPUS} for writing"
                )
            n = actor_count("cache.vae_actors", c.vae_actors)
            share = spare / n if n else min(CPU_THREADS_PER_ACTOR, spare)
            cpus = round(min(share, cap.largest_node_cpus or share), 4)
    res: dict = {"num_cpus": cpus}
    if gpu:
        res["num_gpus"] = c.gpus_per_actor
    if c.accelerator_type:
        res["accelerator_type"] = c.accelerator_type
    extra = resource_map("cache.actor_resources", c.actor_resources)
    if extra:
        res["resources"] = extra
    return res


def _needs(res: dict) -> dict[str, float]:
    """One actor's reservation as Ray resource names."""
    need = {"CPU": float(res.get("num_cpus", 0.0))}
    if res.get("num_gpus"):
        need["GPU"] = float(res["num_gpus"])
    if res.get("accelerator_type"):
        need[f"accelerator_type:{res['accelerator_type']}"] = 0.001  # what Ray adds for an accelerator type
    need.update(res.get("resources", {}))
    return {k: v for k, v in need.items() if v > 0}


def _fitting(need: dict[str, float], budget: dict, complete: bool) -> int | None:
    """How many actors fit beside one preparation and one writer task. A resource missing from the budget counts as
    none when the budget is ``complete`` (the autoscaler's maximum), else as unknown (None)."""
    counts = []
    for name, amount in need.items():
        if name not in budget:
            if complete:
                return 0
            return None
        have = budget[name] - (PREPARE_CPUS + WRITE_CPUS if name == "CPU" else 0.0)
        counts.append(math.floor(have / amount + _EPS))
    return max(0, min(counts, default=0))


def pool_size(key: str, value, res: dict, cap: Capacity) -> PoolSize:
    """The pool for ``key`` (``cache.vae_actors`` or ``cache.text_actors``); raise FitError when it cannot fit."""
    need = _needs(res)
    now = _fitting(need, cap.budget(now=True), complete=True)
    if cap.most is not None:
        most = _fitting(need, cap.budget(now=False), complete=True)
    else:
        most = _fitting(need, cap.budget(now=True), complete=False)
    requested = actor_count(key, value)
    if requested is None:
        if most == 0:
            raise FitError(_overflow(key, 1, res, need, cap))
        start = max(1, now)
        return PoolSize(1, start, max(start, most or 0))
    if most is None:
        # A resource the cluster does not have yet and no readable autoscaler maximum: an autoscaler may still
        # add it, so the request is accepted and cache.stall_seconds bounds the wait.
        log.info(
            "%s=%d: %s not in the cluster yet; waiting for the autoscaler to add it",
            key,
            requested,
            ", ".join(sorted(n for n in need if n not in cap.budget(now=False))),
        )
        return PoolSize(1, requested, requested)
    if requested > most:
        raise FitError(_overflow(key, requested, res, need, cap))
    if need["CPU"] > max(cap.largest_node_cpus, 0.0) + _EPS and cap.most is None:
        raise FitError(f"cache.actor_cpus={need['CPU']:g} > the largest node's {cap.largest_node_cpus:g} CPUs")
    return PoolSize(1, requested, requested)


def _overflow(key: str, n: int, res: dict, need: dict, cap: Capacity) -> str:
    """One line naming the keys and numbers of the first resource that does not fit."""
    budget = cap.budget(now=False)
    where = "at the autoscaler's maximum" if cap.most is not None else "in the cluster"
    if res.get("accelerator_type") and f"accelerator_type:{res['accelerator_type']}" not in budget:
        return f"cache.accelerator_type={res['accelerator_type']}: no such GPU {where}"
    for name, amount in need.items():
        have = budget.get(name, 0.0)
        if name == "CPU":
            if n * amount + PREPARE_CPUS + WRITE_CPUS > have + _EPS:
                return (
                    f"{key}={n} x cache.actor_cpus={amount:g} + {PREPARE_CPUS} CPU for preparation + "
                    f"{WRITE_CPUS} for writing > {have:g} CPUs {where}"
                )
        elif n * amount > have + _EPS:
            label = {"GPU": "cache.gpus_per_actor"}.get(name, f"cache.actor_resources.{name}")
            return f"{key}={n} x {label}={amount:g} > {have:g} {name} {where}"
    return f"{key}={n} does not fit {where}: {need} per actor, {budget} in all"


def _fits(need: dict[str, float], actors: int, budget: dict, cpus: float) -> bool:
    """Do ``actors`` actors and ``cpus`` CPUs of tasks fit ``budget``?"""
    return all(
        name in budget and actors * amount + (cpus if name == "CPU" else 0.0) <= budget[name] + _EPS
        for name, amount in need.items()
    )


def joint(res: dict, vae: PoolSize, text: PoolSize, cap: Capacity) -> str:
    """How the two pools share the cluster (the module's three rules)."""
    need = _needs(res)
    if _fits(need, vae.initial + text.initial, cap.budget(now=True), PREPARE_CPUS + 2 * WRITE_CPUS):
        return SIDE_BY_SIDE
    if not _fits(need, text.max + 1, cap.budget(now=False), 0.0):
        return VAE_AFTER_TEXT
    return SEQUENTIAL


def plan(cfg: JobConfig, cluster_has_gpus: bool, cap: Capacity | None = None) -> Plan:
    """Per-actor Ray options, the VAE and text pool sizes, and how they share this cluster; FitError when a pool
    cannot fit even alone."""
    cap = cap or Capacity.of_cluster()
    res = resources(cfg, place(cfg, Cluster(gpus=cluster_has_gpus)).encoders, cap)
    vae = pool_size("cache.vae_actors", cfg.cache.vae_actors, res, cap)
    text = pool_size("cache.text_actors", cfg.cache.text_actors, res, cap)
    if actor_count("cache.text_actors", cfg.cache.text_actors) is None and "num_gpus" not in res:
        # On CPU, T5-XXL alone holds about 19 GB in fp32: more than one copy per node would not fit in memory.
        text = PoolSize(1, 1, 1)
    out = Plan(res, vae, text, joint(res, vae, text, cap))
    log.info("cache encoders: %s per actor; VAE pool %s, text pool %s; %s", res, vae, text, out.encoders)
    return out
