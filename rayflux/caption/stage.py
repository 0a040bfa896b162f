"""The caption stage: before the cache stage, a Ray Data actor pool captions the images that need a VLM caption.

The driver lists the datasets (Arrow, as discovery does), keeps the images whose path and ``size:mtime`` the
captioner's newest committed table already holds, and hands the rest to the pipeline: CPU tasks read and hash each
image, and the captioner actors caption the content hashes they do not know yet (each batch's captions written as a
part file before it returns). The stage then commits the table and prints one line, ``captions: captioned N, reused
M`` (M: captions reused from earlier runs, plus, with ``missing_caption=vlm``, images taken from their own caption).
Nothing is done per image on the driver but Arrow compute over whole columns.

The pool runs to its end before the cache stage starts, so the captioner's GPUs are free before any encoder loads;
and it runs only here, from the job's driver, never in a training worker.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayflux import allocator, datasets, lease
from rayflux.caption import fit, table, worker
from rayflux.caption.identity import Captioner, captioner
from rayflux.config import JobConfig
from rayflux.config.placement import Cluster, place
from rayflux.discovery import listing

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
    todo, taken, roots = _listed(cfg, wanted)
    previous = table.latest(cdir)
    # The earlier table's paths and stamps only: its captions are streamed into the commit, never held here.
    columns = ["rel_path", "stamp", "skip_reason"]
    old = table.read_table(previous[0], columns) if previous else table.TABLE.empty_table().select(columns)
    kept, todo = _split(todo, old)
    fresh = todo.num_rows
    batches = _pipeline(cfg, cap, cdir, (todo, roots), gpu) if fresh else worker.DONE.empty_table()
    del todo
    n_kept = pc.sum(kept).as_py() or 0
    captioned = pc.sum(batches["captioned"]).as_py() or 0
    skipped = pc.sum(pc.not_equal(pc.filter(old["skip_reason"], kept), "")).as_py() or 0
    skipped += pc.sum(batches["skipped"]).as_py() or 0
    rows = n_kept + (pc.sum(batches["rows"]).as_py() or 0)
    counts = {"captioned": captioned, "reused": rows - captioned - skipped + taken, "skipped": skipped}
    if previous and not fresh and n_kept == old.num_rows:
        gdir = previous[0]  # nothing new or changed: the committed table is this run's
    else:
        pieces = _pieces(previous[0] if previous else None, kept, batches["part"].to_pylist())
        gdir = table.commit(cdir, pieces, counts, {"id": cap.id, "model": cap.model, "prompt": cap.prompt})
        table.drop_parts(cdir)
    return Outcome(**counts, dir=gdir, captions=table.Committed(gdir, wanted, cfg.caption.prefix))


def _pieces(previous: str | None, kept: pa.Array, parts: list[str]):
    """The committed table's rows, a piece at a time: the earlier table's rows that ``kept`` marks, then the rows of
    this run's part files (only those its batches returned: a killed actor's part is known, not committed twice)."""
    if previous is not None and len(kept):
        yield from table.read_kept(previous, kept)
    for path in parts:
        yield table.read_part(path)


def _listed(cfg: JobConfig, wanted: dict[str, str]) -> tuple[pa.Table, int, dict[str, tuple[str, int]]]:
    """The images to caption (:data:`rayflux.caption.worker.TODO` rows) of every captioned dataset, how many of
    their listed images have a caption of their own (``missing_caption=vlm``), and each dataset's root
    (:func:`rayflux.caption.worker.read_images`)."""
    prefix = datasets.prefixes_paths(cfg.data)
    parts, taken, roots = [worker.TODO.empty_table()], 0, {}
    for ds in datasets.datasets_of(cfg.data):
        key = datasets.key(cfg.data, ds)
        if key not in wanted:
            continue
        ls = listing.list_dataset(ds, key, prefix)
        roots[key] = ls.root()
        rows = ls.table
        if wanted[key] == "missing":
            own = pc.or_(pc.not_equal(rows["sidecar"], ""), pc.greater(pc.list_value_length(rows["options"]), 0))
            taken += pc.sum(own).as_py() or 0
            rows = rows.filter(pc.invert(own))
        parts.append(
            pa.table(
                [rows["dataset"], rows["rel_path"], listing.stamps(rows)],
                schema=worker.TODO,
            )
        )
    return pa.concat_tables(parts).combine_chunks(), taken, roots


def _split(todo: pa.Table, old: pa.Table) -> tuple[pa.Array, pa.Table]:
    """(which rows of the earlier table are of images listed again with the same path and known ``size:mtime``, the
    images still to read): an unchanged file is not read again. ``old``: the earlier table's paths and stamps."""
    if not old.num_rows or not todo.num_rows:
        return pa.array(np.zeros(old.num_rows, dtype=bool)), todo
    at = pc.index_in(todo["rel_path"], value_set=old["rel_path"].combine_chunks())
    stamp = pc.take(old["stamp"], pc.fill_null(at, 0))
    same = pc.and_(pc.is_valid(at), pc.equal(stamp, todo["stamp"]))
    same = pc.fill_null(pc.and_(same, pc.invert(pc.ends_with(todo["stamp"], ":0"))), False)
    kept = np.zeros(old.num_rows, dtype=bool)
    kept[pc.filter(at, same).to_numpy()] = True
    return pa.array(kept), todo.filter(pc.invert(same))


def _pipeline(cfg: JobConfig, cap: Captioner, cdir: str, todo: tuple[pa.Table, dict], gpu: bool) -> pa.Table:
    """Read, hash and caption ``todo`` (its rows and its datasets' roots) in a Ray Data pipeline: a
    :data:`rayflux.caption.worker.DONE` row per batch."""
    import ray
    from ray.data import ActorPoolStrategy

    from rayflux.cache.fit import PREPARE_CPUS, Capacity

    c = cfg.caption
    memory = fit.Memory.of_cluster(gpu, c)
    pool = fit.size(c, gpu, fit.needed_bytes(cap.model, cap.dtype), Capacity.of_cluster(), memory, cap.dtype)
    log.info("captioner: %s per actor, %d actors (%s)", pool.resources, pool.actors, cap.model)
    rows, roots = todo
    ds = ray.data.from_arrow(rows)
    ds = ds.map_batches(
        worker.read_images,
        fn_kwargs={"roots": roots},
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
