"""Build one cache generation with Ray Data: prepare on CPU, encode in actor pools, write validated shards.

Text first, one encoder pass per unique caption; then samples. With a previous committed generation of the same
cache key, unchanged samples and known captions are copied from it and only new ones are encoded (see
:mod:`rayflux.cache.reuse`). The driver reads the write tasks' metadata as it streams in, so a validation error or,
with ``cache.strict``, the first bad input stops the build at once with a plain error, and the generation is never
committed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import uuid
from dataclasses import dataclass

from rayflux import buckets, datasets, storage
from rayflux.cache import fit, generations, reuse, shards, stall, writer
from rayflux.cache.encoders import TextEncoder, VaeEncoder
from rayflux.cache.prepare import prepare_row
from rayflux.config import ConfigError, DatasetConfig, JobConfig
from rayflux.models import ModelFacts
from rayflux.sources import Discovery, caption_id

log = logging.getLogger(__name__)

# Data settings that decide which captions a generation holds, not how anything is encoded: a change re-encodes
# only the captions that changed (incrementally), never the latents, so they stay out of the cache key.
_CAPTION_SETTINGS = (
    "caption_strategy", "caption_ext", "metadata_file", "caption_column", "missing_caption", "instance_prompt",
    "prepend_instance_prompt",
)  # fmt: skip


class BadInputError(ValueError):
    """``cache.strict`` is on and an input could not be cached."""


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
    )
    try:
        buckets.check_spec(spec)
    except ValueError as exc:
        raise ConfigError(f"data.alignment: {exc}") from None
    return spec


def layout(cfg: JobConfig, facts: ModelFacts, kind: str = "samples") -> shards.ShardLayout:
    return shards.ShardLayout(kind, cfg.cache.dtype, facts.latent_channels, facts.vae_scale_factor, facts.t5_max_length)


def bucket_specs(cfg: JobConfig, facts: ModelFacts) -> dict[str, buckets.BucketSpec]:
    """Each dataset's bucket spec, keyed by its ``dataset`` column value (each has its own resolution and crop)."""
    return {datasets.key(cfg.data, ds): bucket_spec(ds, facts) for ds in datasets.datasets_of(cfg.data)}


def cache_key(cfg: JobConfig, facts: ModelFacts) -> str:
    """A cache's identity: encoders, preprocessing and shard schema. Anything else never invalidates it."""
    identities = []
    for ds in datasets.datasets_of(cfg.data):
        ident = datasets.cache_identity(ds, storage.canonical(ds.images_dir))
        identities.append({k: v for k, v in ident.items() if k not in _CAPTION_SETTINGS})
    blob = json.dumps(
        {
            "schema": shards.SCHEMA_VERSION,
            "model": facts.identity,
            "datasets": identities,
            "max_image_pixels": cfg.data.max_image_pixels,
            "dtype": cfg.cache.dtype,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _fit_encoders(cfg: JobConfig, use_gpu: bool) -> tuple[JobConfig, dict]:
    """Pre-flight: size the encoder pools to the cluster and refuse, at once, a request that can never fit. Returns
    the config with ``cache.vae_actors``/``text_actors`` resolved to pool sizes, and each actor's Ray options."""
    from ray.data import DataContext

    res, vae, text = fit.plan(cfg, use_gpu)
    DataContext.get_current().set_config(stall.STALL_CONFIG, cfg.cache.stall_seconds)
    cache = dataclasses.replace(cfg.cache, vae_actors=vae, text_actors=text)
    return dataclasses.replace(cfg, cache=cache), res


@dataclass(frozen=True)
class _Build:
    """What every pipeline of one generation's build shares."""

    cfg: JobConfig
    facts: ModelFacts
    gen_dir: str
    generation: int
    seed: int
    encode_id: str
    """Stamped by the encoders on every row they produce in this build."""
    resources: dict
    """Ray resources of one encoder actor."""
    previous: reuse.Previous
    """What an earlier generation of the same cache key can lend."""


def _collect(ds, strict: bool) -> list[dict]:
    """Stream the write tasks' metadata rows; raise on the first validation error (or bad input, when strict)."""
    out = []
    for meta in stall.watch(ds.iter_rows()):
        if meta["error"]:
            raise shards.CacheShapeError(meta["error"])
        skipped = json.loads(meta.get("skipped") or "[]")
        if strict and skipped:
            raise BadInputError(f"cache.strict: {skipped[0]['source_uri']}: {skipped[0]['reason']}")
        out.append(meta)
    return out


def _build_text(b: _Build, captions: list[str]) -> list[dict]:
    """Encode captions no earlier generation holds; copy the rest. Returns the text shards' metadata rows."""
    import ray.data

    c = b.cfg.cache
    out = {"out_dir": b.gen_dir, "layout": layout(b.cfg, b.facts, "text")}
    known = b.previous.text
    ids = [caption_id(t) for t in captions]
    fresh = [{"caption_id": i, "caption": t} for i, t in zip(ids, captions) if i not in known]
    copied = [{"caption_id": i, "file": known[i][0], "row": known[i][1]} for i in ids if i in known]
    metas: list[dict] = []
    if fresh:
        ds = ray.data.from_items(fresh).map_batches(
            TextEncoder,
            fn_constructor_kwargs={
                "model": b.cfg.model,
                "store_dtype": c.dtype,
                "t5_max_length": b.facts.t5_max_length,
                "encode_id": b.encode_id,
            },
            batch_size=c.text_batch_size,
            compute=_pool(c.text_actors),
            **b.resources,
        )
        ds = ds.map_batches(writer.write_text, fn_kwargs=out, batch_size=c.rows_per_shard, num_cpus=0.25)
        ds.set_name(f"cache-text-g{b.generation}")
        metas += _collect(ds, strict=False)
    if copied:
        ds = ray.data.from_items(copied)
        ds = ds.map_batches(writer.copy_text, fn_kwargs=out, batch_size=c.rows_per_shard, num_cpus=0.25)
        metas += _collect(ds, strict=False)
    return metas


def _build_samples(b: _Build, discovery: Discovery, text_files: tuple[str, ...]) -> list[dict]:
    """Prepare, encode (or copy) and write every discovered image. Returns the sample shards' metadata rows."""
    import ray.data

    c = b.cfg.cache
    items = [{**dataclasses.asdict(s), "caption_id": caption_id(s.caption)} for s in discovery.sources]
    if not items:
        return []
    ds = ray.data.from_items(items, override_num_blocks=max(1, min(len(items) // c.batch_size, 64)))
    ds = ds.map(
        _prepare_in_dataset,
        fn_kwargs={
            "specs": bucket_specs(b.cfg, b.facts),
            "seed": b.seed,
            "max_pixels": b.cfg.data.max_image_pixels,
            "known": b.previous.known,
        },
        num_cpus=0.5,
    )
    ds = ds.map_batches(
        VaeEncoder,
        fn_constructor_kwargs={"model": b.cfg.model, "store_dtype": c.dtype, "encode_id": b.encode_id},
        batch_size=c.batch_size,
        compute=_pool(c.vae_actors),
        **b.resources,
    )
    ds = ds.map_batches(
        writer.write_samples,
        fn_kwargs={
            "out_dir": b.gen_dir,
            "layout": layout(b.cfg, b.facts),
            "text_files": text_files,
            "previous_rows": b.previous.rows,
            "generation": b.generation,
        },
        batch_size=c.rows_per_shard,
        num_cpus=0.25,
    )
    ds.set_name(f"cache-images-g{b.generation}")  # what the stage's progress bar is called
    return _collect(ds, strict=c.strict)


def _pool(size: fit.PoolSize):
    """An encoder pool that starts ``size.initial`` actors at once and scales between ``size.min`` and ``size.max``.
    Ray Data's default start of one actor grows the pool only once a backlog builds, which on a short stage never
    happens, so a second actor would sit unused."""
    from ray.data import ActorPoolStrategy

    return ActorPoolStrategy(min_size=size.min, max_size=size.max, initial_size=size.initial)


def _prepare_in_dataset(row: dict, specs: dict, **kwargs) -> dict:
    """``prepare_row`` with the bucket spec of the row's own dataset (each dataset has its resolution and crop)."""
    return prepare_row(row, specs[row["dataset"]], **kwargs)


def build_generation(
    cfg: JobConfig,
    facts: ModelFacts,
    discovery: Discovery,
    gen_dir: str,
    generation: int,
    seed: int,
    use_gpu: bool,
    previous: dict | None = None,
) -> dict:
    """Run the Ray Data pipelines for one generation and commit its manifest. Returns the manifest.

    ``previous`` is the committed manifest of an earlier generation of the same cache key: whatever it already
    holds is copied instead of encoded.
    """
    if cfg.cache.strict and discovery.skipped:
        first = discovery.skipped[0]
        raise BadInputError(f"cache.strict: {first['source_uri']}: {first['reason']}")
    spec = bucket_spec(cfg, facts)  # a bad knob fails here, before any Ray work
    specs = bucket_specs(cfg, facts)
    prev = reuse.load(previous)
    encode_id = uuid.uuid4().hex[:16]
    run_cfg, resources = _fit_encoders(cfg, use_gpu)  # fails here, before any Ray Data work, when it cannot fit
    b = _Build(run_cfg, facts, gen_dir, generation, seed, encode_id, resources, prev)

    # The empty caption is always encoded: training uses it for caption dropout.
    captions = sorted({s.caption for s in discovery.sources} | {""})
    text_meta = _build_text(b, captions)
    text_files = tuple(storage.join(gen_dir, m["path"]) for m in text_meta)
    sample_meta = _build_samples(b, discovery, text_files)

    skipped = sorted(
        [*discovery.skipped, *(x for m in sample_meta for x in json.loads(m["skipped"]))], key=lambda x: x["source_uri"]
    )
    files = sorted((_file_entry(m) for m in sample_meta if m["rows"]), key=lambda f: f["path"])
    cached = sum(f["rows"] for f in files)
    if cached + len(skipped) != discovery.discovered:
        raise RuntimeError(
            f"cache accounting broke: cached {cached} + skipped {len(skipped)} != discovered {discovery.discovered}"
        )
    text_encoded = sum(int(m["encoded"]) for m in text_meta)
    manifest = {
        "schema_version": shards.SCHEMA_VERSION,
        "generation": generation,
        "dir": gen_dir,
        "seed": seed,
        "encode_id": encode_id,
        "config_hash": cfg.fingerprint("data", "model", "cache"),
        "model_identity": facts.identity,
        "layout": dataclasses.asdict(layout(cfg, facts)),
        "bucket_spec": dataclasses.asdict(spec),
        "bucket_specs": {k: dataclasses.asdict(v) for k, v in specs.items()},
        "latent_channels": facts.latent_channels,
        "vae_scale_factor": facts.vae_scale_factor,
        "dtype": cfg.cache.dtype,
        "files": files,
        "text_files": sorted((_file_entry(m, with_buckets=False) for m in text_meta), key=lambda f: f["path"]),
        "unique_captions": len(captions),
        "buckets": shards.merge_summaries([f["buckets"] for f in files]),
        "discovered": discovery.discovered,
        "cached": cached,
        "skipped": len(skipped),
        "skipped_inputs": skipped,
        "encoded": {"samples": sum(int(m["encoded"]) for m in sample_meta), "captions": text_encoded},
        "reused": {
            "samples": sum(int(m["reused"]) for m in sample_meta),
            "captions": len(captions) - text_encoded,
            "from": prev.dir,
        },
        "inputs": inputs_signature(discovery),
    }
    log.info(
        "cache %s: %d discovered = %d cached + %d skipped; encoded %d samples and %d captions, reused %d and %d",
        gen_dir, discovery.discovered, cached, len(skipped), manifest["encoded"]["samples"], text_encoded,
        manifest["reused"]["samples"], manifest["reused"]["captions"],
    )  # fmt: skip
    return generations.commit(gen_dir, manifest, skipped)


def _file_entry(meta: dict, with_buckets: bool = True) -> dict:
    entry = {"path": meta["path"], "rows": int(meta["rows"]), "bytes": int(meta["bytes"])}
    if with_buckets:
        entry["buckets"] = json.loads(meta["buckets"])
    return entry


def inputs_signature(discovery: Discovery) -> str:
    """Hash of what was discovered (paths, sizes, mtimes, chosen captions): equal means nothing to re-encode."""
    h = hashlib.sha256()
    for s in discovery.sources:
        h.update(f"{s.rel_path}|{s.size}|{s.mtime_ns}|{s.caption}\n".encode())
    for s in discovery.skipped:
        h.update(f"skip|{s['source_uri']}|{s['reason']}\n".encode())
    return h.hexdigest()[:16]
