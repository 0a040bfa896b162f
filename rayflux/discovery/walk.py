"""Every file under a folder as one Arrow table (path, size, mtime_ns), without an object per file.

pyarrow's ``FileSystem.get_file_info(FileSelector(recursive=True))`` returns a whole folder as C++ ``FileInfo``
values, each wrapped in a Python object (about 340 bytes per file), and the memory they took stays resident after
they are freed: at a million images that is the driver's largest cost. So the two filesystems a dataset usually
lives on are listed directly, a bounded chunk of entries at a time straight into Arrow:

- local folders with ``os.scandir``, one folder at a time (symbolic links followed, as pyarrow does);
- S3, when boto3 is installed (see :mod:`rayflux.s3_objects`), one ``ListObjectsV2`` page of up to 1,000 keys at a
  time: the same requests pyarrow sends, one per 1,000 keys.

Any other filesystem, or S3 without boto3 (or with ``RAYFLUX_S3_READS=pyarrow``), is listed by pyarrow, its
``FileInfo`` list converted and released a chunk at a time. Each way gives the same rows: regular files only, named
as pyarrow names them, with pyarrow's sizes and nanosecond mtimes (the sidecar table's ``size:mtime`` stamps depend
on it).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from rayflux import s3_objects

_READERS = 32  # concurrent listings of an object store: hides its latency, not the request count
_LOCAL_READERS = 4  # a local disk answers at once: more threads only hold more entries at a time
_CHUNK = 4096  # entries held as Python objects at a time before they become Arrow

FILES = pa.schema([("path", pa.string()), ("size", pa.int64()), ("mtime_ns", pa.int64())])
"""A listed file: its path as the filesystem names it, its size in bytes and its mtime in nanoseconds (0 when the
filesystem gives none)."""

Rows = tuple[list, list, list]
"""Paths, sizes and mtimes of some files, as three Python lists of equal length."""


def _table(chunks: Iterator[Rows]) -> pa.Table:
    """Chunks of rows as one table, each chunk made Arrow as soon as it arrives, so that only one chunk is ever held
    as Python objects.

    Allocated from the system allocator, not pyarrow's default pool: jemalloc and mimalloc give each listing thread
    an arena of its own whose freed pages stay resident: three times the peak RSS of this way for a listing in 32
    threads (measured: docs/observability.md, "Probes behind the defaults")."""
    pool = pa.system_memory_pool()
    batches = [
        pa.record_batch([pa.array(c, f.type, memory_pool=pool) for c, f in zip(rows, FILES)], schema=FILES)
        for rows in chunks
        if rows[0]
    ]
    return pa.Table.from_batches(batches, schema=FILES)


def _scan(folder: str, subfolders: list[str]) -> Iterator[Rows]:
    """One local folder's files, a chunk of rows at a time as its entries come, its subfolders appended to
    ``subfolders``. An entry that cannot be stat'ed (a broken link, one that vanished) is left out, as pyarrow
    leaves it out."""
    rows: Rows = ([], [], [])
    with os.scandir(folder) as entries:
        for entry in entries:
            try:
                if entry.is_dir():
                    subfolders.append(entry.path)
                    continue
                if not entry.is_file():
                    continue
                st = entry.stat()
            except OSError:
                continue
            rows[0].append(entry.path)
            rows[1].append(st.st_size)
            rows[2].append(st.st_mtime_ns)
            if len(rows[0]) == _CHUNK:
                yield rows
                rows = ([], [], [])
    yield rows


def _local_below(folder: str) -> Iterator[Rows]:
    """Every file at any depth under a local folder, one folder at a time."""
    todo = [folder]
    while todo:
        subfolders: list[str] = []
        try:
            yield from _scan(todo.pop(), subfolders)
        except OSError:  # unreadable, or a link loop too deep to resolve: pyarrow leaves it out too
            pass
        todo += subfolders


def _s3(fs: pafs.S3FileSystem, folder: str, below: bool, subfolders: list[str]) -> Iterator[Rows]:
    """A folder of a bucket, a LIST page of rows at a time (see :func:`rayflux.s3_objects.list_pages`), its
    subfolders appended to ``subfolders``."""
    for paths, sizes, mtimes, folders in s3_objects.list_pages(fs, folder, below=below):
        subfolders += folders
        yield paths, sizes, mtimes


def _infos(infos: list[pafs.FileInfo]) -> Iterator[Rows]:
    """pyarrow's listing, converted a chunk at a time from the list's end, each chunk's ``FileInfo`` objects
    released as soon as they are converted (the rows are sorted later anyway)."""
    while infos:
        chunk = [e for e in infos[-_CHUNK:] if e.type == pafs.FileType.File]
        del infos[-_CHUNK:]
        yield [e.path for e in chunk], [e.size or 0 for e in chunk], [e.mtime_ns or 0 for e in chunk]


def _top(fs: pafs.FileSystem, root: str) -> tuple[pa.Table, list[str]]:
    """The files directly in ``root`` and its subfolders."""
    if isinstance(fs, pafs.LocalFileSystem):
        subfolders: list[str] = []
        return _table(_scan(root, subfolders)), subfolders
    if s3_objects.direct(fs):
        subfolders = []
        return _table(_s3(fs, root, False, subfolders)), subfolders
    top = fs.get_file_info(pafs.FileSelector(root))
    return _table(_infos(list(top))), [e.path for e in top if e.type == pafs.FileType.Directory]


def _below(fs: pafs.FileSystem, folder: str) -> pa.Table:
    """Every file at any depth under ``folder``, in no particular order."""
    if isinstance(fs, pafs.LocalFileSystem):
        chunks = _local_below(folder)
    elif s3_objects.direct(fs):
        chunks = _s3(fs, folder, True, [])
    else:
        chunks = _infos(fs.get_file_info(pafs.FileSelector(folder, recursive=True)))
    return _table(chunks)


def files(fs: pafs.FileSystem, root: str) -> pa.Table:
    """Every file under ``root`` (:data:`FILES` rows), sorted by path: the top level, then each subfolder listed
    recursively, concurrently (an object store lists a page of keys per request, so one folder per thread spreads
    the pages), each turned into Arrow by the thread that listed it.

    A subfolder's paths share its prefix, so they are one contiguous run of the sorted whole: the sorted parts are
    put in order between the top-level files instead of being sorted again together (no second copy of the
    listing)."""
    flat, subfolders = _top(fs, root)
    flat = flat.sort_by("path")
    subfolders.sort(key=lambda p: p + "/")
    readers = _LOCAL_READERS if isinstance(fs, pafs.LocalFileSystem) else _READERS
    with concurrent.futures.ThreadPoolExecutor(max_workers=readers) as pool:
        below_parts = list(pool.map(lambda folder: _below(fs, folder), subfolders))
    parts, done = [], 0
    for i, path in enumerate(subfolders):
        before = pc.sum(pc.less(flat["path"], path + "/")).as_py() or 0  # top-level files sorting before it
        # Sorted here, one part at a time: its unsorted copy is released before the next part's sort.
        part, below_parts[i] = below_parts[i].sort_by("path"), None
        parts += [flat.slice(done, before - done), part]
        done = max(done, before)
    parts.append(flat.slice(done))
    return pa.concat_tables(parts)
