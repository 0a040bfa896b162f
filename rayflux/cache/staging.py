"""A pass's input rows, staged in storage for its tasks to read, so the driver puts nothing into the object store.

``ray.data.from_arrow`` puts every block from the driver. The driver's process writes those object-store pages, so
they are counted in its RSS from then on, freed or not, and Ray Data keeps a record per block, computed by one task
per block (more of the driver's own memory, and tasks that wait for a CPU behind a running pass; measured:
docs/observability.md, "Probes behind the defaults").

Instead the driver writes the rows once, into one file of the generation directory: one compressed Arrow IPC
stream per block of rows (:func:`rayflux.cache.index.to_ipc`, as the write tasks' index rows travel), end to end,
remembering where each one starts and how long it is. The pass starts from a datasource with one read task per
block, and each task reads its own block with one ranged read (:func:`rayflux.cache.ranges.read_ranges`). The
file is the build's scratch: the manifest does not list it, so the commit removes it with every other unlisted
file (:func:`rayflux.cache.generations.commit`).
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from rayflux import allocator, storage
from rayflux.cache import index, ranges

DIR = "staging"
"""Where a generation's staged inputs live, relative to its directory."""


def scratch(gen_dir: str, build: str) -> str:
    """Where build ``build`` stages its inputs: its own folder, which no concurrent build of the generation shares."""
    return storage.join(gen_dir, DIR, build) if build else storage.join(gen_dir, DIR)


@dataclass(frozen=True)
class Staged:
    """One staged input: a file of IPC streams and where each block's stream is."""

    path: str
    file_bytes: int
    offsets: np.ndarray
    lengths: np.ndarray
    rows: int
    rows_per_block: int

    @property
    def blocks(self) -> int:
        return len(self.offsets)


def stage(table: pa.Table, gen_dir: str, name: str, rows_per_block: int, build: str = "") -> Staged | None:
    """Write ``table`` to ``<gen_dir>/staging/<build>/<name>.arrows``, ``rows_per_block`` rows per block; None when
    it has no rows. The driver holds one block's encoded bytes at a time besides ``table``."""
    if not table.num_rows:
        return None
    fd, local = tempfile.mkstemp(prefix=f"rayflux-{name}-", suffix=".arrows")
    offsets, lengths, at = [], [], 0
    try:
        with os.fdopen(fd, "wb") as f:
            for start in range(0, table.num_rows, rows_per_block):
                data = index.to_ipc(table.slice(start, rows_per_block))
                f.write(data)
                offsets.append(at)
                lengths.append(len(data))
                at += len(data)
        allocator.trim()
        path = storage.join(scratch(gen_dir, build), f"{name}.arrows")
        storage.upload_atomic(local, path)
    finally:
        os.unlink(local)
    return Staged(path, at, np.array(offsets, np.int64), np.array(lengths, np.int64), table.num_rows, rows_per_block)


def dataset(staged: Staged | None, num_cpus: float):
    """A Ray Data dataset of ``staged``'s rows, one block per staged block, each read by a task of ``num_cpus``
    CPUs; None for None."""
    import ray.data

    if staged is None:
        return None
    source = _source_class()(staged)
    return ray.data.read_datasource(source, override_num_blocks=staged.blocks, num_cpus=num_cpus)


def read_block(path: str, file_bytes: int, offset: int, length: int) -> pa.Table:
    """One staged block, with one ranged read."""
    (data,) = ranges.read_ranges(path, file_bytes, [(offset, length)])
    return index.from_ipc(data)


@functools.cache
def _source_class():
    """The datasource class (made on first use: Ray Data is imported only where a pass runs)."""
    from ray.data.block import BlockMetadata
    from ray.data.datasource import Datasource, ReadTask

    class Source(Datasource):
        """One read task per staged block. A datasource rather than ``ray.data.range`` and a map: a range's read
        tasks ask a whole CPU each, which an encoder pool holding part of a small node can leave unscheduled."""

        def __init__(self, staged: Staged):
            super().__init__()
            self.staged = staged

        def estimate_inmemory_data_size(self) -> int:
            return int(self.staged.lengths.sum())

        def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list:
            st = self.staged
            tasks = []
            for i in range(st.blocks):
                rows = min(st.rows - i * st.rows_per_block, st.rows_per_block)
                meta = BlockMetadata(num_rows=rows, size_bytes=int(st.lengths[i]), exec_stats=None, input_files=None)
                args = (st.path, st.file_bytes, int(st.offsets[i]), int(st.lengths[i]))
                tasks.append(ReadTask(lambda a=args: [read_block(*a)], meta, per_task_row_limit=per_task_row_limit))
            return tasks

    return Source
