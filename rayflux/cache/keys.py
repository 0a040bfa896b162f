"""What a cache is, from the job's config and the model's facts alone: each dataset's bucket spec, the dtype the
tensors are stored in, the shard layout, and the cache key that names all of it."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from rayflux import buckets, datasets, storage
from rayflux.cache import layout as sample_layout
from rayflux.cache import shards
from rayflux.config import ConfigError, DatasetConfig, JobConfig, identity
from rayflux.config.placement import Cluster, place
from rayflux.models import ModelFacts


def bucket_spec(source: JobConfig | DatasetConfig, facts: ModelFacts) -> buckets.BucketSpec:
    """One dataset's bucket knobs (a JobConfig means ``data.*``): its settings plus what the model dictates."""
    d = source.data if isinstance(source, JobConfig) else source
    spec = buckets.BucketSpec(
        resolution=d.resolution,
        resolution_type=d.resolution_type,
        alignment=d.alignment or buckets.effective_step(d.bucket_step, d.resolution, facts.alignment),
        crop=d.crop,
        max_aspect=d.max_aspect,
        min_image_size=d.min_image_size,
        vae_scale_factor=facts.vae_scale_factor,
        latent_channels=facts.latent_channels,
        pack=facts.pack,
    )
    try:
        buckets.check_spec(spec)
    except ValueError as exc:
        raise ConfigError(f"data.alignment: {exc}") from None
    return spec


def store_dtype(cfg: JobConfig, cluster_gpus: bool = False) -> str:
    """``cache.dtype`` with ``auto`` resolved: bfloat16 when the encoders run on GPUs (where FLUX trains in bf16
    anyway), float32 on CPU. ``cluster_gpus``: the cluster has GPUs right now."""
    if cfg.cache.dtype != "auto":
        return cfg.cache.dtype
    return "bfloat16" if place(cfg, Cluster(gpus=cluster_gpus)).encoders else "float32"


def layout(cfg: JobConfig, facts: ModelFacts, kind: str = "samples", cluster_gpus: bool = False) -> shards.ShardLayout:
    dtype = store_dtype(cfg, cluster_gpus)
    return shards.ShardLayout(kind, dtype, facts.latent_channels, facts.vae_scale_factor, facts.text)


def bucket_specs(cfg: JobConfig, facts: ModelFacts) -> dict[str, buckets.BucketSpec]:
    """Each dataset's bucket spec, keyed by its ``dataset`` column value (each has its own resolution and crop)."""
    return {datasets.key(cfg.data, ds): bucket_spec(ds, facts) for ds in datasets.datasets_of(cfg.data)}


def cache_key(cfg: JobConfig, facts: ModelFacts, cluster_gpus: bool = False) -> str:
    """A cache's identity: the encoders (the model's identity, from its files), the shard schema and its declared
    per-sample tensors, and every config field that declares itself part of it (``CACHED``,
    :mod:`rayflux.config.identity`): each dataset's, the data section's own, and the cache section's with
    ``cache.dtype`` resolved. Anything else never invalidates it."""
    identities = [
        datasets.cache_identity(ds, storage.canonical(ds.images_dir)) for ds in datasets.datasets_of(cfg.data)
    ]
    own = set(identity.names(DatasetConfig)) | {"datasets"}  # each dataset's are in its identity above
    data = {k: v for k, v in identity.values(cfg.data, "cache").items() if k not in own}
    cache = identity.values(dataclasses.replace(cfg.cache, dtype=store_dtype(cfg, cluster_gpus)), "cache")
    blob = json.dumps(
        {
            "schema": shards.SCHEMA_VERSION,
            "samples": [t.to_json() for t in sample_layout.SAMPLE_TENSORS],
            "model": facts.identity,
            "datasets": identities,
            "data": data,
            "cache": cache,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
