"""Build one cache generation with Ray Data: prepare on CPU, encode in actor pools, write validated shards."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging

import numpy as np
import pyarrow as pa

from rayflux import buckets, storage
from rayflux.cache import generations, shards
from rayflux.cache.encoders import TextEncoder, VaeEncoder
from rayflux.cache.prepare import prepare_row
from rayflux.config import ConfigError, JobConfig
from rayflux.models import ModelFacts
from rayflux.sources import Discovery, caption_id

log = logging.getLogger(__name__)


def bucket_spec(cfg: JobConfig, facts: ModelFacts) -> buckets.BucketSpec:
    """The bucket knobs: user settings plus what the model dictates (alignment, latent channels)."""
    d = cfg.data
    spec = buckets.BucketSpec(
        resolution=d.resolution,
        resolution_type=d.resolution_type,
        alignment=d.alignment or facts.alignment,
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


def cache_key(cfg: JobConfig, facts: ModelFacts) -> str:
    """A cache's identity: encoders, preprocessing and shard schema. Anything else never invalidates it."""
    import hashlib

    d = dataclasses.asdict(cfg.data)
    d.pop("images_dir")
    blob = json.dumps(
        {
            "schema": shards.SCHEMA_VERSION,
            "model": facts.identity,
            "data": d,
            "dtype": cfg.cache.dtype,
            "images": storage.canonical(cfg.data.images_dir),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _resources(cfg: JobConfig, use_gpu: bool) -> dict:
    if use_gpu:
        return {"num_gpus": 1, "num_cpus": 1}
    return {"num_cpus": cfg.cache.actor_cpus}


@functools.lru_cache(maxsize=4)
def _text_index(files: tuple[str, ...]) -> dict[str, tuple[str, int]]:
    index = {}
    for f in files:
        ids = shards.read_column(f, ["caption_id"])["caption_id"].to_pylist()
        for i, cid in enumerate(ids):
            index[cid] = (f, i)
    return index


def _write_text(batch: dict, out_dir: str) -> dict:
    table = pa.Table.from_pydict({k: list(batch[k]) for k in shards.TEXT_SCHEMA.names}, schema=shards.TEXT_SCHEMA)
    name = shards.new_shard_name("text")
    shards.write_table(table, storage.join(out_dir, "text", name))
    return {"path": [f"text/{name}"], "rows": [table.num_rows]}


def _write_samples(
    batch: dict,
    out_dir: str,
    text_files: tuple[str, ...],
    latent_channels: int,
    vae_scale_factor: int,
    dtype: str,
    generation: int,
    strict: bool,
) -> dict:
    """Validate each row against its bucket, attach its caption's text embedding, write one shard."""
    n = len(batch["sample_id"])
    index = _text_index(text_files)
    rows, skipped = [], []
    for i in range(n):
        if batch["skip_reason"][i]:
            if strict:
                raise ValueError(f"cache.strict: {batch['uri'][i]}: {batch['skip_reason'][i]}")
            skipped.append({"source_uri": str(batch["uri"][i]), "reason": str(batch["skip_reason"][i])})
            continue
        cid = str(batch["caption_id"][i])
        f, rg = index[cid]
        text = shards.read_rows(f, [rg]).to_pylist()[0]
        row = {name: (batch[name][i] if name in batch else None) for name in shards.SAMPLE_SCHEMA.names}
        row.update(source_uri=str(batch["uri"][i]), generation=generation)
        row.update({k: text[k] for k in ("t5", "t5_len", "t5_dim", "clip_pooled", "clip_dim", "text_dtype")})
        row = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in row.items()}
        shards.validate_row(row, latent_channels, vae_scale_factor, dtype)
        rows.append(row)
    out = {"path": [""], "rows": [0], "buckets": ["{}"], "skipped": [json.dumps(skipped)]}
    if rows:
        table = pa.Table.from_pylist(rows, schema=shards.SAMPLE_SCHEMA)
        name = shards.new_shard_name("samples")
        shards.write_table(table, storage.join(out_dir, "samples", name))
        out.update(path=[f"samples/{name}"], rows=[len(rows)], buckets=[json.dumps(shards.bucket_summary(table))])
    return out


def build_generation(
    cfg: JobConfig,
    facts: ModelFacts,
    discovery: Discovery,
    gen_dir: str,
    generation: int,
    seed: int,
    use_gpu: bool,
) -> dict:
    """Run the Ray Data pipelines for one generation and commit its manifest. Returns the manifest."""
    import ray.data
    from ray.data import ActorPoolStrategy

    c = cfg.cache
    if c.strict and discovery.skipped:
        first = discovery.skipped[0]
        raise ValueError(f"cache.strict: {first['source_uri']}: {first['reason']}")
    res = _resources(cfg, use_gpu)

    # Text first: one encoder pass per unique caption (plus the empty caption, for caption dropout).
    captions = sorted({s.caption for s in discovery.sources} | {""})
    text_ds = ray.data.from_items([{"caption_id": caption_id(t), "caption": t} for t in captions])
    text_ds = text_ds.map_batches(
        TextEncoder,
        fn_constructor_kwargs={"model": cfg.model, "store_dtype": c.dtype, "t5_max_length": facts.t5_max_length},
        batch_size=c.text_batch_size,
        compute=ActorPoolStrategy(min_size=1, max_size=c.text_actors),
        **res,
    )
    text_meta = text_ds.map_batches(
        _write_text, fn_kwargs={"out_dir": gen_dir}, batch_size=c.rows_per_shard, num_cpus=0.25
    ).take_all()
    text_files = tuple(storage.join(gen_dir, m["path"]) for m in text_meta)

    spec = bucket_spec(cfg, facts)
    items = [{**dataclasses.asdict(s), "caption_id": caption_id(s.caption)} for s in discovery.sources]
    sample_meta: list[dict] = []
    if items:
        ds = ray.data.from_items(items, override_num_blocks=max(1, min(len(items) // c.batch_size, 64)))
        ds = ds.map(
            prepare_row,
            fn_kwargs={"spec": spec, "seed": seed, "max_pixels": cfg.data.max_image_pixels},
            num_cpus=0.5,
        )
        ds = ds.map_batches(
            VaeEncoder,
            fn_constructor_kwargs={"model": cfg.model, "store_dtype": c.dtype},
            batch_size=c.batch_size,
            compute=ActorPoolStrategy(min_size=1, max_size=c.vae_actors),
            **res,
        )
        sample_meta = ds.map_batches(
            _write_samples,
            fn_kwargs={
                "out_dir": gen_dir,
                "text_files": text_files,
                "latent_channels": facts.latent_channels,
                "vae_scale_factor": facts.vae_scale_factor,
                "dtype": c.dtype,
                "generation": generation,
                "strict": c.strict,
            },
            batch_size=c.rows_per_shard,
            num_cpus=0.25,
        ).take_all()

    skipped = list(discovery.skipped)
    files = []
    for m in sample_meta:
        skipped.extend(json.loads(m["skipped"]))
        if m["rows"]:
            files.append({"path": m["path"], "rows": int(m["rows"]), "buckets": json.loads(m["buckets"])})
    files.sort(key=lambda f: f["path"])
    bucket_totals = shards.merge_summaries([f["buckets"] for f in files])
    cached = sum(f["rows"] for f in files)
    manifest = {
        "schema_version": shards.SCHEMA_VERSION,
        "generation": generation,
        "dir": gen_dir,
        "seed": seed,
        "config_hash": cfg.fingerprint("data", "model", "cache"),
        "model_identity": facts.identity,
        "latent_channels": facts.latent_channels,
        "vae_scale_factor": facts.vae_scale_factor,
        "dtype": c.dtype,
        "files": files,
        "text_files": [{"path": m["path"], "rows": int(m["rows"])} for m in text_meta],
        "unique_captions": len(captions),
        "buckets": bucket_totals,
        "discovered": discovery.discovered,
        "cached": cached,
        "skipped": len(skipped),
        "inputs": inputs_signature(discovery),
    }
    if cached + len(skipped) != discovery.discovered:
        raise RuntimeError(
            f"cache accounting broke: cached {cached} + skipped {len(skipped)} != discovered {discovery.discovered}"
        )
    return generations.commit(gen_dir, manifest, skipped)


def inputs_signature(discovery: Discovery) -> str:
    """Hash of what was discovered (paths, sizes, mtimes, chosen captions): equal means nothing to re-encode."""
    import hashlib

    h = hashlib.sha256()
    for s in discovery.sources:
        h.update(f"{s.rel_path}|{s.size}|{s.mtime_ns}|{s.caption}\n".encode())
    for s in discovery.skipped:
        h.update(f"skip|{s['source_uri']}|{s['reason']}\n".encode())
    return h.hexdigest()[:16]
