"""The caption stage's per-image bookkeeping, in two Ray tasks, so that the job's driver holds no list of images.

:func:`plan` lists the captioned datasets (as discovery does), keeps the images whose path and ``size:mtime`` the
captioner's newest committed table already holds, and writes the others, the images to read and caption, as
Parquet files the pipeline's read tasks take (:data:`TODO_DIR`). :func:`commit` streams the committed table from
the earlier table's kept rows and this run's part files. The driver gets counts and file paths only: a listing
of 100,000 images held on the driver, with its copy in the object store, was the stage's whole growth with the
dataset (BENCHMARKS.md, "The driver's memory per image").
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayflux import allocator, datasets, storage
from rayflux.caption import table, worker
from rayflux.config import JobConfig
from rayflux.discovery import listing

TODO_DIR = "todo"
"""Under the captioner's directory: this run's images to caption, as :data:`rayflux.caption.worker.TODO` files."""
CPUS = 0.5
"""CPUs of a plan or commit task: a listing, Arrow compute and storage I/O."""
TODO_ROWS = 1024
"""Rows per todo file: a read task each, so that the reads spread over the cluster."""


@dataclass(frozen=True)
class Plan:
    """What :func:`plan` found: counts and paths, nothing per image."""

    todo: list[str]
    """The todo files (:data:`TODO_DIR`), in listing order."""
    fresh: int
    """Images to read (new, changed, or not in the earlier table)."""
    kept: int
    """Rows of the earlier table kept as they are (same path, same ``size:mtime``)."""
    kept_skipped: int
    """Of those, rows with a skip reason (an image the captioner could not read)."""
    old_rows: int
    """Rows of the earlier table."""
    taken: int
    """Listed images that have a caption of their own (``missing_caption=vlm``)."""
    previous: str | None
    """The earlier committed generation's directory, None when there is none."""
    roots: dict[str, tuple[str, int]]
    """Per dataset key, its images' URI root (:meth:`rayflux.discovery.listing.Listing.root`)."""

    def unchanged(self) -> bool:
        """Nothing new, changed or gone: the committed table is this run's."""
        return self.previous is not None and not self.fresh and self.kept == self.old_rows


def plan(cfg: JobConfig, cdir: str, wanted: dict[str, str]) -> tuple[Plan, pa.Array]:
    """Ray task: the stage's :class:`Plan`, and which rows of the earlier table it keeps (a boolean per row, for
    :func:`commit`; it stays in the object store, never on the driver)."""
    with allocator.system_pool():
        drop_todo(cdir)
        todo, taken, roots = _listed(cfg, wanted)
        previous = table.latest(cdir)
        # The earlier table's paths and stamps only: its captions are streamed into the commit, never held here.
        columns = ["rel_path", "stamp", "skip_reason"]
        old = table.read_table(previous[0], columns) if previous else table.TABLE.empty_table().select(columns)
        kept, todo = _split(todo, old)
        paths = [
            _write_todo(cdir, i, todo.slice(at, TODO_ROWS)) for i, at in enumerate(range(0, todo.num_rows, TODO_ROWS))
        ]
        out = Plan(
            todo=paths,
            fresh=todo.num_rows,
            kept=pc.sum(kept).as_py() or 0,
            kept_skipped=pc.sum(pc.not_equal(pc.filter(old["skip_reason"], kept), "")).as_py() or 0,
            old_rows=old.num_rows,
            taken=taken,
            previous=previous[0] if previous else None,
            roots=roots,
        )
        del todo, old
    allocator.trim()
    return out, kept


def commit(cdir: str, found: Plan, kept: pa.Array, parts: list[str], counts: dict, captioner: dict) -> str:
    """Ray task: commit the earlier table's ``kept`` rows and this run's ``parts`` (only those its batches returned:
    a killed actor's part is known, not committed twice) as the captioner's next generation; its directory."""
    with allocator.system_pool():
        gdir = table.commit(cdir, _pieces(found.previous, kept, parts), counts, captioner)
        table.drop_parts(cdir)
        drop_todo(cdir)
    allocator.trim()
    return gdir


def drop_todo(cdir: str) -> None:
    """Remove the todo files (a killed run's too), under the captioner's lease."""
    table.drop_files(storage.join(cdir, TODO_DIR))


def _write_todo(cdir: str, i: int, rows: pa.Table) -> str:
    path = storage.join(cdir, TODO_DIR, f"{i:06d}-{os.urandom(4).hex()}.parquet")
    storage.write_bytes_atomic(path, table.parquet_bytes(rows.cast(worker.TODO)))
    return path


def _pieces(previous: str | None, kept: pa.Array, parts: list[str]):
    """The committed table's rows, a piece at a time: the earlier table's rows that ``kept`` marks, then the rows of
    this run's part files."""
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
            own = table.own_caption(rows)
            taken += pc.sum(own).as_py() or 0
            rows = rows.filter(pc.invert(own))
        parts.append(pa.table([rows["dataset"], rows["rel_path"], listing.stamps(rows)], schema=worker.TODO))
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
