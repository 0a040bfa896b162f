"""The sidecar table: each generation records the caption files its discovery knew, so the next one reads only
the files that changed.

A generation's ``index/sidecars.parquet`` (:data:`rayflux.sources.SIDECARS` rows, named by the manifest like the
other index files) holds every caption file's path, its ``size:mtime`` as listed, and its lines. Discovery lists
every folder anyway; a caption file listed with the same path, size and mtime as in the newest committed generation
of the cache key has the same lines, so it is not read again. A rerun with nothing changed therefore reads no
caption file at all, and a refresh generation reads only new or changed ones. The lines are stored before any
caption policy (``missing_caption``, ``prepend_instance_prompt``, the per-seed choice among several), so one table
serves every seed and caption setting of the key.

As for images (see :mod:`rayflux.cache.prepare`), size and mtime are the change detector: a file rewritten with
the same size within the store's mtime resolution (one second on S3) is not noticed. A file listed without an mtime
is always read.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from rayflux import sources
from rayflux.cache import index

PATH = "index/sidecars.parquet"


def known(manifest: dict | None) -> pa.Table:
    """A committed generation's table (:data:`rayflux.sources.SIDECARS` rows), sorted by path (see :func:`around`);
    empty when it has none."""
    if not (manifest or {}).get("index", {}).get("sidecars"):
        return sources.SIDECARS.empty_table()
    table = index.read(manifest, "sidecars", columns=sources.SIDECARS.names).cast(sources.SIDECARS)
    return table.take(pc.sort_indices(table["path"]))


def around(table: pa.Table, listed: pa.Table) -> pa.Table:
    """The rows of a sorted sidecar table (:func:`known`) whose paths lie between the least and the greatest caption
    file of some listed rows: all :func:`attach` needs for them. Found by bisection, so each part of a listing is
    matched against its own few rows, not the whole table."""
    paths = listed["sidecar"].filter(pc.not_equal(listed["sidecar"], ""))
    if not table.num_rows or not len(paths):
        return table.slice(0, 0)
    least, most = pc.min_max(paths).values()
    column = table["path"]

    def first_at_or_after(value: str) -> int:
        lo, hi = 0, len(column)
        while lo < hi:
            mid = (lo + hi) // 2
            if column[mid].as_py() < value:
                lo = mid + 1
            else:
                hi = mid
        return lo

    start = first_at_or_after(least.as_py())
    end = first_at_or_after(most.as_py() + "\0")
    return table.slice(start, end - start)


def attach(listed: pa.Table, table: pa.Table) -> pa.Table:
    """The listed rows (:data:`rayflux.listing.LISTED`) with ``sidecar_lines`` set where the caption file is listed
    unchanged in ``table`` (same path and ``size:mtime``, the mtime known), so settling does not read it."""
    if not table.num_rows or not listed.num_rows:
        return listed
    at = pc.index_in(listed["sidecar"], value_set=table["path"].combine_chunks())
    stamp = pc.take(table["stamp"], at)
    same = pc.and_(pc.equal(stamp, listed["sidecar_stamp"]), pc.invert(pc.ends_with(stamp, ":0")))
    same = pc.and_(pc.fill_null(same, False), pc.not_equal(listed["sidecar"], ""))
    lines = pc.if_else(same, pc.take(table["lines"], at), listed["sidecar_lines"])
    return listed.set_column(listed.schema.get_field_index("sidecar_lines"), "sidecar_lines", lines)


def write(gen_dir: str, spool: sources.Spool) -> dict:
    """Upload a discovery's sidecar table (its :class:`~rayflux.sources.Spool`) into ``gen_dir``; the manifest's
    ``index.sidecars`` entry."""
    return index.upload(spool.close(), gen_dir, PATH, spool.rows)
