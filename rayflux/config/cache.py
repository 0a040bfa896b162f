"""The ``cache`` section: how VAE latents and text embeddings are built, stored and refreshed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayflux.config.identity import CACHED, TRAINED, UNTRACKED, moved
from rayflux.config.values import ConfigError


@dataclass
class CacheConfig:
    """The cache stage: VAE latents and text embeddings written as Parquet shards."""

    dir: str = field(default="", metadata=UNTRACKED)
    """Where cache generations are written. Empty: ``<run.output_dir>/cache``."""
    batch_size: int = field(default=8, metadata=UNTRACKED)
    """Images per VAE call in an encoder actor."""
    text_batch_size: int = field(default=16, metadata=UNTRACKED)
    """Unique captions per text-encoder call."""
    vae_actors: Any = field(default="auto", metadata=UNTRACKED)
    """VAE encoder actors: a number, all started at once, or ``auto``: one per ``cache.gpus_per_actor`` share of the
    cluster's GPUs (scaling up to the autoscaler's maximum), or on a CPU-only cluster the CPUs that preparation and
    writing leave, in actors of up to 8 CPUs. A request that cannot fit fails before the stage starts."""
    text_actors: Any = field(default="auto", metadata=UNTRACKED)
    """Text encoder actors: a number or ``auto`` (as ``vae_actors`` on GPUs; one actor on CPU, as T5-XXL takes about
    19 GB per copy there). Text work scales with unique captions, not images."""
    actor_cpus: Any = field(default="auto", metadata=UNTRACKED)
    """CPUs reserved by each encoder actor: a number, or ``auto``: 1 with GPUs (or a named node type), else the
    pool's share of the CPUs preparation and writing leave. Torch in the actor runs that many threads (rounded up)."""
    gpus_per_actor: float = field(default=1.0, metadata=UNTRACKED)
    """GPU share of each GPU encoder actor, e.g. 0.25 to run four VAE actors on one card; above 1, a whole number."""
    stall_seconds: float = field(default=600.0, metadata=UNTRACKED)
    """Fail a cache pipeline that makes no progress (no task output, no finished task) for this long, naming what
    Ray Data reports as pending. Loading or downloading an encoder counts as no progress: raise it for slow hubs."""
    rows_per_shard: int = field(default=256, metadata=UNTRACKED)
    """Rows per Parquet shard file (a shard never mixes more than one writer's batch)."""
    dtype: str = field(default="auto", metadata=CACHED)
    """Stored tensor dtype: ``auto`` (``bfloat16`` when the encoders run on GPUs, else ``float32``), ``float32``,
    ``float16`` or ``bfloat16``."""
    refresh: str = field(default="never", metadata=TRAINED)
    """Build a new cache generation ``never``, ``every_epoch``, or every N epochs (an integer)."""
    strict: bool = field(default=False, metadata=UNTRACKED)
    """Fail the job on the first bad input instead of skipping it with a recorded reason."""
    seed: int = field(default=0, metadata=TRAINED)
    """Seed for random crops and caption choice; each generation derives its own from it."""
    encoders_on_gpu: str = field(default="auto", metadata=moved(UNTRACKED, "use_gpu"))
    """Encoder actors on GPUs: ``auto`` (when the cluster has GPUs or ``cache.accelerator_type`` is set), ``true`` or
    ``false``. Set ``true`` on an autoscaling cluster whose GPU nodes are not up yet when the job starts. (Was
    ``cache.use_gpu``.)"""
    accelerator_type: str = field(default="", metadata=UNTRACKED)
    """GPU type each encoder actor needs (e.g. ``L4``, ``A10G``), so encoding runs on cheaper GPU nodes than training.
    Empty: any GPU. Implies GPU encoders."""
    actor_resources: dict = field(default_factory=dict, metadata=UNTRACKED)
    """Extra Ray resources each encoder actor reserves, e.g. ``{encode_node: 1}`` for a node type that declares that
    custom resource in ``cluster.yaml``."""


def refresh_interval(refresh: str) -> int:
    """``never`` -> 0, ``every_epoch`` -> 1, ``"3"`` -> 3."""
    if refresh == "never":
        return 0
    if refresh == "every_epoch":
        return 1
    try:
        n = int(refresh)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"cache.refresh must be never, every_epoch or a positive integer; got {refresh!r}")
    return n


def actor_count(key: str, value) -> int | None:
    """``auto`` -> None; otherwise a positive integer (from YAML or the text of ``--set``)."""
    if value == "auto":
        return None
    try:
        n = int(value)
        if isinstance(value, bool) or float(value) != n:
            raise ValueError(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be auto or a positive integer, got {value!r}") from None
    if n < 1:
        raise ConfigError(f"{key} must be auto or a positive integer, got {value!r}")
    return n


def actor_cpus(value) -> float | None:
    """``cache.actor_cpus``: ``auto`` -> None, otherwise a positive number."""
    if value == "auto":
        return None
    try:
        cpus = float(value)
        if isinstance(value, bool) or not cpus > 0:
            raise ValueError(value)
    except (TypeError, ValueError):
        raise ConfigError(f"cache.actor_cpus must be auto or a positive number, got {value!r}") from None
    return cpus


def check_pools(cache: CacheConfig) -> None:
    """The cache pool keys' own values, before any cluster is known."""
    actor_count("cache.vae_actors", cache.vae_actors)
    actor_count("cache.text_actors", cache.text_actors)
    actor_cpus(cache.actor_cpus)
    if not cache.gpus_per_actor > 0:
        raise ConfigError(f"cache.gpus_per_actor must be positive, got {cache.gpus_per_actor}")
    if cache.gpus_per_actor > 1 and not float(cache.gpus_per_actor).is_integer():
        raise ConfigError(f"cache.gpus_per_actor above 1 must be a whole number, got {cache.gpus_per_actor}")
    if not cache.stall_seconds > 0:
        raise ConfigError(f"cache.stall_seconds must be positive, got {cache.stall_seconds}")
