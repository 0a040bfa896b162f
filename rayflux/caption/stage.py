"""The caption stage: before the cache stage, a Ray Data actor pool captions the images that need a VLM caption.

A task lists the datasets (as discovery does), keeps the images whose path and ``size:mtime`` the captioner's
newest committed table already holds, and writes the rest as todo files (:func:`rayflux.caption.plan.plan`). The
pipeline reads them: CPU tasks read and hash each image, and the captioner actors caption the content hashes they do
not know yet (each batch's captions written as a part file before it returns). A second task commits the table
(:func:`rayflux.caption.plan.commit`), and the stage prints one line, ``captions: captioned N, reused M`` (M:
captions reused from earlier runs, plus, with ``missing_caption=vlm``, images taken from their own caption). The
driver holds counts, the todo files' paths and a row per captioner batch: nothing per image.

The pool runs to its end before the cache stage starts, so the captioner's GPUs are free before any encoder loads;
and it runs only here, from the job's driver, never in a training worker.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from rayflux import allocator, datasets, lease, storage
from rayflux.caption import fit, plan, table, worker
from rayflux.caption.identity import Captioner, captioner
from rayflux.config import JobConfig
from rayflux.config.placement import Cluster, place

log = logging.getLogger("rayflux")
STAGE = "caption"
"""The stage's name in the ledger and the summary's times."""


@dataclass(frozen=True)
class Outcome:
    """What the caption stage did."""

    captioned: int
    """Images whose caption this run generated."""
    reused: int
    """Images whose caption was reused (an earlier run's, by path and stamp or by content) or taken from their own
    caption file (``missing_caption=vlm``)."""
    skipped: int
    """Images the captioner could not read or decode (the cache stage records them as skips too)."""
    dir: str
    """The committed captions table's generation directory."""
    captions: table.Committed
    """The table as the cache's discovery reads it."""

    def line(self) -> str:
        bad = f", {self.skipped} unreadable" if self.skipped else ""
        return f"captions: captioned {self.captioned}, reused {self.reused}{bad} ({self.dir})"


def modes(cfg: JobConfig) -> dict[str, str]:
    """Dataset key -> ``all`` (``caption_strategy=vlm``) or ``missing`` (``missing_caption=vlm``), for the datasets
    the stage captions."""
    out = {}
    for ds in datasets.datasets_of(cfg.data):
        if ds.caption_strategy == "vlm":
            out[datasets.key(cfg.data, ds)] = "all"
        elif ds.missing_caption == "vlm":
            out[datasets.key(cfg.data, ds)] = "missing"
    return out


def resolved_dtype(cfg: JobConfig, gpu: bool) -> str:
    return cfg.caption.dtype if cfg.caption.dtype != "auto" else ("bfloat16" if gpu else "float32")


def run(cfg: JobConfig, cache_root: str, cluster_gpus: bool, ledger=None, summary=None) -> Outcome | None:
    """Caption what the job's datasets need; None when no dataset asks for VLM captions. Recorded in ``ledger`` as
    the ``caption`` stage and in ``summary`` (its ``captions`` line and time)."""
    wanted = modes(cfg)
    if not wanted:
        return None
    t0 = time.perf_counter()
    gpu = place(cfg, Cluster(gpus=cluster_gpus)).captioner
    cap = captioner(cfg.caption, resolved_dtype(cfg, gpu))
    cdir = table.captioner_dir(cache_root, cap.id)
    entry = ledger.start(STAGE, cdir, captioner=cap.id, model=cap.model) if ledger is not None else None
    with lease.Lease(cdir, f"captioner {cap.id}", cfg.run.lease_seconds).acquire(wait=True):
        with allocator.system_pool():  # the stage's columns are short-lived, as discovery's (rayflux.allocator)
            outcome = _caption(cfg, cap, cdir, wanted, gpu)
        allocator.trim()
    log.info("%s", outcome.line())
    print(outcome.line(), flush=True)
    if ledger is not None:
        ledger.finish(
            entry, captioned=outcome.captioned, reused=outcome.reused, skipped=outcome.skipped, dir=outcome.dir
        )
    if summary is not None:
        summary.captions = outcome.line().split(": ", 1)[1]
        summary.stage_seconds[STAGE] = time.perf_counter() - t0
    return outcome


def _caption(cfg: JobConfig, cap: Captioner, cdir: str, wanted: dict[str, str], gpu: bool) -> Outcome:
    ref, kept = _task(plan.plan, 2).remote(cfg, cdir, wanted)
    found: plan.Plan = _get(ref)
    batches = _pipeline(cfg, cap, cdir, found, gpu) if found.fresh else worker.DONE.empty_table()
    captioned = pc.sum(batches["captioned"]).as_py() or 0
    skipped = found.kept_skipped + (pc.sum(batches["skipped"]).as_py() or 0)
    rows = found.kept + (pc.sum(batches["rows"]).as_py() or 0)
    counts = {"captioned": captioned, "reused": rows - captioned - skipped + found.taken, "skipped": skipped}
    if found.unchanged():
        gdir = found.previous  # nothing new or changed: the committed table is this run's
    else:
        who = {"id": cap.id, "model": cap.model, "prompt": cap.prompt}
        gdir = _get(_task(plan.commit).remote(cdir, found, kept, batches["part"].to_pylist(), counts, who))
    return Outcome(**counts, dir=gdir, captions=table.Committed(gdir, wanted, cfg.caption.prefix))


def _task(fn, num_returns: int = 1):
    """``fn`` as a Ray task on the driver's node where it has room (the listing reads what the driver would)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    return ray.remote(fn).options(num_cpus=plan.CPUS, num_returns=num_returns, scheduling_strategy=here)


def _get(ref):
    """A task's result; a failure of its own (a dataset that cannot be listed) raised as itself."""
    import ray

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        if isinstance(exc.cause, Exception):
            raise exc.cause from None
        raise


def _pipeline(cfg: JobConfig, cap: Captioner, cdir: str, found: plan.Plan, gpu: bool) -> pa.Table:
    """Read, hash and caption the plan's todo files in a Ray Data pipeline: a :data:`rayflux.caption.worker.DONE`
    row per batch."""
    import ray
    from ray.data import ActorPoolStrategy

    from rayflux.cache.fit import PREPARE_CPUS, Capacity

    c = cfg.caption
    memory = fit.Memory.of_cluster(gpu, c)
    pool = fit.size(c, gpu, fit.needed_bytes(cap.model, cap.dtype), Capacity.of_cluster(), memory, cap.dtype)
    log.info("captioner: %s per actor, %d actors (%s)", pool.resources, pool.actors, cap.model)
    fs, _ = storage.resolve(found.todo[0])
    paths = [storage.resolve(p)[1] for p in found.todo]
    ds = ray.data.read_parquet(paths, filesystem=fs, partitioning=None, num_cpus=PREPARE_CPUS)
    ds = ds.map_batches(
        worker.read_images,
        fn_kwargs={"roots": found.roots},
        batch_size=c.batch_size,
        batch_format="pyarrow",
        num_cpus=PREPARE_CPUS,
    )
    ds = ds.map_batches(
        worker.CaptionActor,
        fn_constructor_kwargs={
            "model": cap.model,
            "prompt": cap.prompt,
            "max_new_tokens": cap.max_new_tokens,
            "dtype": cap.dtype,
            "cdir": cdir,
            "max_pixels": cfg.data.max_image_pixels,
        },
        batch_size=c.batch_size,
        batch_format="pyarrow",
        compute=ActorPoolStrategy(min_size=1, max_size=pool.actors, initial_size=pool.actors),
        **pool.resources,
    )
    ds.set_name("captions")
    # One row per batch (its part file and counts): the captions stay in the part files, never on the driver.
    out = [worker.DONE.empty_table(), *ds.iter_batches(batch_size=None, batch_format="pyarrow")]
    return pa.concat_tables([t.select(worker.DONE.names).cast(worker.DONE) for t in out]).combine_chunks()
