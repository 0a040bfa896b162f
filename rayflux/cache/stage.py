"""Build one cache generation with Ray Data: prepare on CPU, encode in actor pools, write validated shards.

A text pass (one encoder pass per unique caption) and an image pass run side by side (see :mod:`rayflux.cache.passes`;
:mod:`rayflux.cache.fit` decides whether their pools start together; where they would take the same resources in
turn, one process per encoder slot runs both, see :mod:`rayflux.cache.host`). With a previous committed generation of
the same cache key, unchanged samples and known captions are referenced where it holds them, and only new ones are
encoded and written (see :mod:`rayflux.cache.reuse`). The driver reads the write tasks' metadata as it streams in, so
a validation error or, with ``cache.strict``, the first bad input stops the build at once with a plain error, and the
generation is never committed. The index rows the writers return stream into the generation index
(:mod:`rayflux.cache.index`), written beside the manifest just before it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import threading
import uuid
from dataclasses import dataclass

import pyarrow as pa

from rayflux import allocator, preservation
from rayflux.cache import (
    fit,
    generations,
    host,
    index,
    passes,
    prepare,
    reuse,
    shards,
    sidecars,
    staging,
    stall,
    text_input,
    writer,
)
from rayflux.cache import manifest as manifest_mod
from rayflux.cache.encoders import TextEncoder, VaeEncoder
from rayflux.cache.keys import bucket_spec, bucket_specs, layout, store_dtype
from rayflux.config import JobConfig
from rayflux.discovery import discoveries
from rayflux.discovery.caption_hash import caption_id
from rayflux.discovery.discoveries import Discovery
from rayflux.models import ModelFacts

log = logging.getLogger(__name__)


class BadInputError(ValueError):
    """``cache.strict`` is on and an input could not be cached."""


def _fit_encoders(cfg: JobConfig, cluster_gpus: bool, planned: fit.Plan | None) -> tuple[JobConfig, fit.Plan]:
    """Pre-flight: size the encoder pools to the cluster and refuse, at once, a request that can never fit (unless
    the job ``planned`` them already, beside a worker group that started early). Returns the config with
    ``cache.vae_actors``/``text_actors`` resolved to pool sizes, and the plan."""
    from ray.data import DataContext

    plan = planned or fit.plan(cfg, cluster_gpus)
    DataContext.get_current().set_config(stall.STALL_CONFIG, cfg.cache.stall_seconds)
    cache = dataclasses.replace(cfg.cache, vae_actors=plan.vae, text_actors=plan.text)
    return dataclasses.replace(cfg, cache=cache), plan


@dataclass(frozen=True)
class _Build:
    """What every pipeline of one generation's build shares."""

    cfg: JobConfig
    facts: ModelFacts
    gen_dir: str
    generation: int
    seed: int
    encode_id: str
    """The build's id: stamped by the encoders on every row they produce in this build, and in the name of every
    file it writes (see :func:`rayflux.cache.generations.commit`)."""
    resources: dict
    """Ray resources of one encoder actor."""
    cluster_gpus: bool
    """Whether the cluster has GPUs (decides ``cache.dtype: auto``)."""
    previous: reuse.Previous
    """What an earlier generation of the same cache key can lend."""
    encoders: str
    """How the two pools share the cluster (:attr:`rayflux.cache.fit.Plan.encoders`)."""
    one_process: bool = False
    """Whether one process per encoder slot runs both passes (:func:`rayflux.cache.host.wanted`)."""
    hosts: host.Hosts | None = None
    """The encoder hosts that run both passes, while they run (:mod:`rayflux.cache.host`); None: two pools."""


# Images per preparation task: hundreds, so the tasks spread over every CPU of a large cluster and each one's
# per-task overhead is small; a million images are about 4,000 tasks.
_IMAGES_PER_TASK = 256


# Metadata rows between two trims of the driver's allocators while a pass streams in (see rayflux.allocator): each
# row's index part is decoded, cast and written here, and the freed buffers would otherwise stay resident.
_TRIM_EVERY = 32


def _collect(
    ds, name: str, strict: bool, sink: index.Sink, stop: threading.Event, flowing: threading.Event | None = None
) -> list[dict]:
    """Stream the write tasks' metadata rows, their index rows into ``sink``; raise on the first validation error
    (or bad input, when strict), and PipelineStopped once ``stop`` is set (the build's other pipeline failed). Sets
    ``flowing`` when the first row arrives."""
    out = []
    try:
        # closing(): a validation error raised below stops the pipeline at once (see stall.watch) instead of leaving
        # its actors running until the generator is garbage-collected.
        with contextlib.closing(stall.watch(ds.iter_rows(), name=name, stop=stop)) as rows:
            for meta in rows:
                if meta["error"]:
                    raise shards.CacheShapeError(meta["error"])
                skipped = json.loads(meta.get("skipped") or "[]")
                if strict and skipped:
                    raise BadInputError(f"cache.strict: {skipped[0]['source_uri']}: {skipped[0]['reason']}")
                sink.add(index.from_ipc(meta.pop("index")))
                out.append(meta)
                if len(out) % _TRIM_EVERY == 0:
                    allocator.trim()
                if flowing is not None:
                    flowing.set()
    except stall.Interrupted as exc:  # a stall or stop that landed here, between two rows
        raise exc.error from None
    return out


def _stage(b: _Build, table: pa.Table, name: str) -> staging.Staged | None:
    """The image pass's input: ``table``'s rows staged in the generation directory in blocks of
    :data:`_IMAGES_PER_TASK` rows, for the pass's own tasks to read (see :mod:`rayflux.cache.staging`); None when it
    has no rows. The driver builds no row objects and puts no block into the object store.

    Both passes' inputs are made before either pass starts (the text pass's by :func:`_text_input`), so neither
    pass's start waits for the other's tasks."""
    return staging.stage(table, b.gen_dir, name, _IMAGES_PER_TASK, b.encode_id)


def _text_input(b: _Build, images: staging.Staged | None, sink: index.Sink) -> text_input.TextInput:
    """The text pass's input, found by one task from the staged images (see :mod:`rayflux.cache.text_input`); the
    previous generation's index rows of the known captions go to ``sink`` as they are, a batch at a time. The empty
    caption is always among the captions: training uses it for caption dropout."""
    import ray

    find = ray.remote(num_cpus=fit.PREPARE_CPUS)(text_input.find)
    words = preservation.words(b.cfg)
    found = ray.get(find.remote(images, b.gen_dir, b.previous.manifest, _IMAGES_PER_TASK, b.encode_id, words))
    for i, rows in enumerate(text_input.known_rows(found)):
        sink.add(rows)
        if i % _TRIM_EVERY == _TRIM_EVERY - 1:
            allocator.trim()
    allocator.trim()
    return found


def _build_text(
    b: _Build, ds, sink: index.Sink, stop: threading.Event, flowing: threading.Event | None = None
) -> list[dict]:
    """Encode and write the captions of ``ds`` (staged by :func:`_text_input`). Returns the text shards' metadata
    rows."""
    c = b.cfg.cache
    if ds is None:
        return []
    ds = _encode(b, ds, text=True)
    out = {
        "out_dir": b.gen_dir,
        "layout": layout(b.cfg, b.facts, "text", b.cluster_gpus),
        "generation": b.generation,
        "build": b.encode_id,
    }
    ds = ds.map_batches(writer.write_text, fn_kwargs=out, batch_size=c.rows_per_shard, num_cpus=fit.WRITE_CPUS)
    name = f"cache-text-g{b.generation}"
    ds.set_name(name)
    return _collect(ds, name, strict=False, sink=sink, stop=stop, flowing=flowing)


def _build_samples(b: _Build, ds, roots: dict, sink: index.Sink, stop: threading.Event) -> list[dict]:
    """Prepare, encode (or reference) and write every discovered image (``ds``: the discovery's rows as
    :func:`_stage`; each task adds its rows' caption ids and previous index entries itself; ``roots``: the
    discovery's :attr:`~rayflux.discovery.discoveries.Discovery.roots`). Returns the sample shards' metadata rows."""
    c = b.cfg.cache
    if ds is None:
        return []
    ds = ds.map_batches(
        _with_previous,
        fn_kwargs={"samples": b.previous.samples, "roots": roots},
        batch_size=None,
        batch_format="pyarrow",
        num_cpus=fit.PREPARE_CPUS,
    )
    ds = ds.map(
        prepare.prepare_in_dataset,
        fn_kwargs={
            "specs": bucket_specs(b.cfg, b.facts),
            "policies": prepare.mask_policies(b.cfg),
            "seed": b.seed,
            "max_pixels": b.cfg.data.max_image_pixels,
        },
        num_cpus=fit.PREPARE_CPUS,
    )
    ds = _encode(b, ds, text=False)
    ds = ds.map_batches(
        writer.write_samples,
        fn_kwargs={
            "out_dir": b.gen_dir,
            "layout": layout(b.cfg, b.facts, cluster_gpus=b.cluster_gpus),
            "generation": b.generation,
            "build": b.encode_id,
        },
        batch_size=c.rows_per_shard,
        num_cpus=fit.WRITE_CPUS,
    )
    name = f"cache-images-g{b.generation}"
    ds.set_name(name)  # what the pipeline's progress bar is called
    return _collect(ds, name, strict=c.strict, sink=sink, stop=stop)


def _encode(b: _Build, ds, text: bool):
    """A pass's encode step: a pool of its encoder's actors, or tasks that hand each batch to the build's hosts."""
    c = b.cfg.cache
    batch = c.text_batch_size if text else c.batch_size
    if b.hosts is not None:
        step = b.hosts.step("encode_text", "caption_id") if text else b.hosts.step("encode_images", "sample_id")
        return ds.map_batches(**step, batch_size=batch)
    cls, size = (TextEncoder, c.text_actors) if text else (VaeEncoder, c.vae_actors)
    args = _encoder_args(b, text)
    return ds.map_batches(cls, fn_constructor_kwargs=args, batch_size=batch, compute=_pool(size), **b.resources)


def _encoder_args(b: _Build, text: bool) -> dict:
    """The text (or VAE) encoder's constructor arguments."""
    args = {"model": b.cfg.model, "store_dtype": store_dtype(b.cfg, b.cluster_gpus), "encode_id": b.encode_id}
    return {**args, "facts": b.facts} if text else args


def _pool(size: fit.PoolSize):
    """An encoder pool that starts ``size.initial`` actors at once and scales between ``size.min`` and ``size.max``.
    Ray Data's default start of one actor grows the pool only once a backlog builds, which on a short stage never
    happens, so a second actor would sit unused."""
    from ray.data import ActorPoolStrategy

    return ActorPoolStrategy(min_size=size.min, max_size=size.max, initial_size=size.initial)


def _with_previous(block, samples, roots) -> object:
    """Ray Data batch function: a block of discovered images with each one's ``uri``, ``caption_id`` and ``prev``
    (its previous index row as JSON, or "")."""
    prev = reuse.rows_for(samples, block["rel_path"])
    block = block.append_column("uri", discoveries.uris(block, roots))
    block = block.append_column("caption_id", pa.array([caption_id(t) for t in block["caption"].to_pylist()]))
    return block.append_column("prev", pa.array([prev.get(r, "") for r in block["rel_path"].to_pylist()], pa.string()))


def build_generation(
    cfg: JobConfig,
    facts: ModelFacts,
    discovery: Discovery,
    gen_dir: str,
    generation: int,
    seed: int,
    *,
    cluster_gpus: bool,
    previous: dict | None = None,
    encoders: fit.Plan | None = None,
) -> dict:
    """Run the Ray Data pipelines for one generation and commit its manifest. Returns the manifest.

    ``previous`` is the committed manifest of an earlier generation of the same cache key: whatever it already
    holds is referenced instead of encoded and written again. ``encoders``: the encoder pools the job planned
    already (beside a training worker group that started early); by default they are sized to the whole cluster.

    Consumes ``discovery``: what the manifest needs of it is taken first, and its tables are emptied once the
    pipelines have their own copies of the rows, so that the driver holds every image once, not twice, while they
    run. The driver's Arrow work allocates from the system allocator and is trimmed after each step (see
    :mod:`rayflux.allocator`).
    """
    with allocator.system_pool():
        return _build_generation(
            cfg,
            facts,
            discovery,
            gen_dir,
            generation,
            seed,
            cluster_gpus=cluster_gpus,
            previous=previous,
            encoders=encoders,
        )


def _build_generation(cfg, facts, discovery, gen_dir, generation, seed, *, cluster_gpus, previous, encoders) -> dict:
    if cfg.cache.strict and discovery.skips.num_rows:
        first = discovery.skips.slice(0, 1).to_pylist()[0]
        raise BadInputError(f"cache.strict: {first['source_uri']}: {first['reason']}")
    spec = bucket_spec(cfg, facts)  # a bad knob fails here, before any Ray work
    specs = bucket_specs(cfg, facts)
    prev = reuse.load(previous)
    encode_id = uuid.uuid4().hex[:16]
    run_cfg, plan = _fit_encoders(
        cfg, cluster_gpus, encoders
    )  # fails here, before any Ray Data work, when it cannot fit
    b = _Build(run_cfg, facts, gen_dir, generation, seed, encode_id, plan.resources, cluster_gpus, prev, plan.encoders)
    b = dataclasses.replace(b, one_process=host.wanted(plan))

    samples = layout(cfg, facts, cluster_gpus=cluster_gpus).samples
    sample_index, caption_index = index.Sink("samples", samples=samples), index.Sink("captions", facts.text)
    found = manifest_mod.Found(
        discovery.discovered,
        discovery.skipped,
        inputs_signature(discovery, preservation.rule(cfg)),
        discovery.sidecars.rows,
    )
    try:
        staged, text, text_meta, sample_meta, times = _passes(b, discovery, sample_index, caption_index)
        build = manifest_mod.Build(
            b.generation,
            gen_dir,
            seed,
            encode_id,
            b.cfg.fingerprint("data", "model", "cache"),
            facts,
            layout(b.cfg, facts, cluster_gpus=cluster_gpus),
            b.previous.dir,
        )
        manifest = manifest_mod.compose(
            build, found, spec, specs, text_meta, sample_meta, samples=sample_index, captions=caption_index
        )
        files = {
            kind: sink.commit(gen_dir, encode_id)
            for kind, sink in (("samples", sample_index), ("captions", caption_index))
        }
        if found.sidecars:  # the caption files read, for the next discovery (see cache.sidecars)
            files["sidecars"] = sidecars.write(gen_dir, discovery.sidecars, encode_id)
        staged_bytes = sum(s.file_bytes for s in staged.values() if s is not None) + text.known_bytes
        # "one_process": both passes ran in the same encoder processes (rayflux.cache.host), not in two pools.
        encoders = {"encoders": b.encoders, "one_process": b.one_process}
        manifest.finish(files, {**times, **encoders}, text.unique, staged_bytes)
    finally:
        sample_index.discard()
        caption_index.discard()
    _log_built(gen_dir, manifest)
    return generations.commit(gen_dir, manifest, manifest.skipped_inputs, encode_id)


def _passes(b: _Build, discovery: Discovery, sample_index: index.Sink, caption_index: index.Sink):
    """The build's input staged, then its text and image passes run: ``(staged inputs, the text input, the text
    and sample shards' metadata, the passes' times)``."""
    staged = {"images": _stage(b, discovery.table, "images")}
    discovery.table = discovery.table.schema.empty_table()  # the staged file holds the rows now
    allocator.trim()
    text = _text_input(b, staged["images"], caption_index)
    staged["captions"] = text.staged
    images, texts = (staging.dataset(staged[k], fit.PREPARE_CPUS) for k in ("images", "captions"))
    if b.one_process:  # one process per encoder slot runs both passes: its text, then its VAE
        encoders = (_encoder_args(b, True), _encoder_args(b, False))
        hosts = host.Hosts.start(b.cfg.cache.vae_actors.initial, b.resources, *encoders, build=b.encode_id)
        b = dataclasses.replace(b, hosts=hosts)
    try:
        text_meta, sample_meta, times = _run_passes(b, texts, images, discovery.roots, sample_index, caption_index)
    finally:
        host.kill(b.hosts)  # no encoder outlives the stage, whether it failed or not
    allocator.trim()  # what the passes' threads kept for themselves until they ended
    return staged, text, text_meta, sample_meta, times


def _run_passes(b: _Build, texts, images, roots: dict, sample_index: index.Sink, caption_index: index.Sink):
    """The text and image passes, at once or in turn as :attr:`_Build.encoders` says (with encoder hosts, at once:
    the image batches wait in the hosts for the text pass's end)."""
    # Where the pools exclude each other, the text pool starts first and the VAE pool waits for it.
    flowing = threading.Event() if b.encoders == fit.VAE_AFTER_TEXT or b.hosts is not None else None
    return passes.run(
        lambda stop: host.run_pass(b.hosts, lambda: _build_text(b, texts, caption_index, stop, flowing), text=True),
        lambda stop: host.run_pass(b.hosts, lambda: _build_samples(b, images, roots, sample_index, stop), text=False),
        together=b.encoders != fit.SEQUENTIAL or b.hosts is not None,
        text_flowing=flowing,
    )


def _log_built(gen_dir: str, manifest) -> None:
    """One line: what the generation holds, and what it encoded and reused."""
    counts, n = manifest.skip_counts(), manifest.counts()
    log.info(
        "cache %s: %d discovered = %d cached + %d skipped; encoded %d samples and %d captions, reused %d and %d",
        gen_dir,
        counts.discovered,
        counts.cached,
        counts.skipped,
        n["encoded"]["samples"],
        n["encoded"]["captions"],
        n["reused"]["samples"],
        n["reused"]["captions"],
    )


def inputs_signature(discovery: Discovery, captions_rule: str = "") -> str:
    """Hash of what was discovered (paths, sizes, mtimes, chosen captions) and of ``captions_rule``, what decides the
    captions a generation holds besides the chosen ones (:func:`rayflux.preservation.rule`; "" adds nothing): equal
    means nothing to re-encode."""
    h = hashlib.sha256()
    if captions_rule:  # a generation built without output preservation's class prompts is not one that has them
        h.update(f"preservation|{captions_rule}\n".encode())
    for batch in discovery.table.to_batches(max_chunksize=4096):  # a few thousand rows as Python at a time
        for s in batch.to_pylist():
            refs = f"|{','.join(s['references'])}|{s['references_stamp']}" if s["references"] else ""
            # A mask file's path and stamp only when there is one: a discovery without masks keeps its signature.
            refs += f"|mask:{s['mask_uri']}|{s['mask_stamp']}" if s.get("mask_uri") else ""
            h.update(f"{s['rel_path']}|{s['size']}|{s['mtime_ns']}|{s['caption']}{refs}\n".encode())
    for batch in discovery.skips.to_batches(max_chunksize=4096):
        for s in batch.to_pylist():
            h.update(f"skip|{s['source_uri']}|{s['reason']}\n".encode())
    return h.hexdigest()[:16]
