"""The sidecar table: each generation records the caption files its discovery knew, so the next one reads only
the files that changed.

A generation's ``index/sidecars.parquet`` (:data:`rayflux.discovery.schemas.SIDECARS` rows, named by the manifest like the
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

import os
import shutil
import tempfile
import weakref

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rayflux import storage
from rayflux.cache import index
from rayflux.cache.manifest import Manifest
from rayflux.discovery import schemas, sidecar_spool

PATH = "index/sidecars.parquet"

_COPY_BYTES = 8 << 20
"""Bytes per read when a table on an object store is copied to a local file: one request each."""


class Known:
    """A committed generation's sidecar table, read a few row groups at a time (:meth:`around`), never whole.

    The driver holds the listing while it settles it, and the table is about as large again (a caption file's path,
    stamp and lines: 117 bytes per image at 20,000 images, against 138 for the listed row); held whole beside the
    listing, it set the peak of a rerun's discovery. Its row groups carry the minimum and maximum path (see
    :class:`rayflux.discovery.sidecar_spool.Spool`), and the table is written in about the order discovery lists, so the rows a part
    of the listing needs lie in a few row groups. A table on an object store is first copied to a local file, a few
    large reads, so that each part's look-up costs no request."""

    def __init__(self, manifest: dict | None):
        self._file: pq.ParquetFile | None = None
        self._copy: weakref.finalize | None = None
        self._least = self._most = pa.array([], pa.string())
        path = Manifest.of(manifest).index_path("sidecars") if manifest else None
        if not path:
            return
        fs, inner = storage.resolve(path)
        if isinstance(fs, pafs.LocalFileSystem):
            local = inner
        else:
            fd, local = tempfile.mkstemp(prefix="rayflux-known-sidecars-", suffix=".parquet")
            self._copy = weakref.finalize(self, _remove, local)
            with os.fdopen(fd, "wb") as out, fs.open_input_stream(inner) as src:
                shutil.copyfileobj(src, out, _COPY_BYTES)
        self._file = pq.ParquetFile(local)
        column = self._file.schema_arrow.get_field_index("path")
        least, most = [], []
        for i in range(self._file.metadata.num_row_groups):
            stats = self._file.metadata.row_group(i).column(column).statistics
            # A row group without statistics (an older writer's) has null bounds: read for every part, never missed.
            has = stats is not None and stats.has_min_max
            least.append(stats.min if has else None)
            most.append(stats.max if has else None)
        # As Arrow, so that each part's overlap test is one vectorised comparison over every row group (a 10M-image
        # table written by settling tasks has about 39,000), not a Python loop per part.
        self._least, self._most = pa.array(least, pa.string()), pa.array(most, pa.string())

    @property
    def rows(self) -> int:
        return self._file.metadata.num_rows if self._file is not None else 0

    def around(self, listed: pa.Table) -> pa.Table:
        """The table's rows whose paths lie between the least and the greatest caption file of some listed rows
        (:data:`rayflux.discovery.listing.LISTED`): all :func:`attach` needs for them, from the row groups whose paths
        overlap that span."""
        empty = schemas.SIDECARS.empty_table()
        paths = listed["sidecar"].filter(pc.not_equal(listed["sidecar"], ""))
        if self._file is None or not len(paths):
            return empty
        least, most = (v.as_py() for v in pc.min_max(paths).values())
        overlap = pc.and_kleene(pc.less_equal(self._least, most), pc.greater_equal(self._most, least))
        groups = pc.indices_nonzero(pc.fill_null(overlap, True)).to_pylist()
        if not groups:
            return empty
        rows = self._file.read_row_groups(groups, columns=schemas.SIDECARS.names, use_threads=False)
        rows = rows.cast(schemas.SIDECARS)
        inside = pc.and_(pc.greater_equal(rows["path"], least), pc.less_equal(rows["path"], most))
        return rows.filter(inside)

    def close(self) -> None:
        """Release the file (and remove a local copy); :meth:`around` finds nothing after."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._copy is not None:
            self._copy()


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


def attach(listed: pa.Table, table: pa.Table) -> pa.Table:
    """The listed rows (:data:`rayflux.discovery.listing.LISTED`) with ``sidecar_lines`` set where the caption file is listed
    unchanged in ``table`` (:data:`rayflux.discovery.schemas.SIDECARS` rows, such as :meth:`Known.around` gives: same path
    and ``size:mtime``, the mtime known), so settling does not read it."""
    if not table.num_rows or not listed.num_rows:
        return listed
    at = pc.index_in(listed["sidecar"], value_set=table["path"].combine_chunks())
    stamp = pc.take(table["stamp"], at)
    same = pc.and_(pc.equal(stamp, listed["sidecar_stamp"]), pc.invert(pc.ends_with(stamp, ":0")))
    same = pc.and_(pc.fill_null(same, False), pc.not_equal(listed["sidecar"], ""))
    lines = pc.if_else(same, pc.take(table["lines"], at), listed["sidecar_lines"])
    return listed.set_column(listed.schema.get_field_index("sidecar_lines"), "sidecar_lines", lines)


def write(gen_dir: str, spool: sidecar_spool.Spool, build: str = "") -> dict:
    """Upload a discovery's sidecar table (its :class:`~rayflux.discovery.sidecar_spool.Spool`) into ``gen_dir``; the manifest's
    ``index.sidecars`` entry."""
    return index.upload(spool.close(), gen_dir, index.own_name(PATH, build), spool.rows)
