"""The caption files a discovery knows, spooled to a local Parquet file as they are settled."""

from __future__ import annotations

import contextlib
import os
import tempfile
import weakref

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rayflux.discovery.schemas import SIDECARS


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Spool:
    """The caption files a discovery knows, as :data:`SIDECARS` rows written to a local Parquet file as they are
    settled: the driver does not hold their paths, stamps and lines (a third of a settled row's bytes) while the
    rest of the discovery is gathered and the generation builds; the build uploads the file at commit. The file is
    made on the first row and removed with the spool."""

    def __init__(self) -> None:
        self.path = ""
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._closed = False

    def add(self, settled: pa.Table) -> None:
        """Write the caption files of settled rows (:data:`SETTLED`) whose lines are known."""
        known = settled.filter(pc.and_(pc.not_equal(settled["sidecar"], ""), pc.is_valid(settled["sidecar_lines"])))
        self.write(pa.table([known["sidecar"], known["sidecar_stamp"], known["sidecar_lines"]], schema=SIDECARS))

    def write(self, rows: pa.Table) -> None:
        """Write :data:`SIDECARS` rows."""
        if not rows.num_rows:
            return
        if self._closed:
            raise RuntimeError("rows added to a closed sidecar spool")
        if self._writer is None:
            fd, self.path = tempfile.mkstemp(prefix="rayflux-sidecars-", suffix=".parquet")
            os.close(fd)
            weakref.finalize(self, _remove, self.path)
            # Statistics on the path only: the next generation's discovery finds a listed part's rows by the paths'
            # span in each row group (rayflux.cache.sidecars.Known); the writer keeps every row group's statistics
            # until it closes, so none for the stamps and lines. No dictionaries: paths and lines rarely repeat.
            self._writer = pq.ParquetWriter(
                self.path, SIDECARS, compression="zstd", use_dictionary=False, write_statistics=["path"]
            )
        self._writer.write_table(rows)
        self.rows += rows.num_rows

    def close(self) -> str:
        """Finish the file and return its path ("" when no row was written); nothing can be added after."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._closed = True
        return self.path

    def table(self) -> pa.Table:
        """Every row written, read back, the spool closed: for small uses (a test, merging another discovery)."""
        path = self.close()
        return pq.read_table(path) if self.rows else SIDECARS.empty_table()
