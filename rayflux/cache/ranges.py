"""Byte-range reads of the tensors the generation index locates: no footer, one GET per span.

Ranges of one file that lie close together are merged into one request (a hole of up to ``HOLE`` bytes is read and
thrown away): a shard's neighbouring rows cost one GET, and the bytes read stay within a few percent of the
tensors' own bytes, since a hole is a row's page headers and small columns.

On S3 with boto3 (:mod:`rayflux.s3_objects`) each span is one ranged GET and nothing else: the index already knows
every offset, so no size is asked. Through pyarrow's S3 filesystem, opening a file costs one HEAD (it asks every
object's size when it opens it and cannot be told), so each process keeps up to ``OPEN_FILES`` opened files, by
path and size, and reads every later range of a file through the same handle: one HEAD per shard and process, not
one per read task. A shard's name is never reused for other bytes, and a deleted one fails its next read as it would
fail an open. Local files are opened per call (an open costs no request, and a kept descriptor would keep reading a
deleted file).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import pyarrow.fs as pafs

from rayflux import s3_objects, storage

HOLE = 16 << 10
OPEN_FILES = 512
_opened: OrderedDict[tuple[str, int], object] = OrderedDict()
_lock = threading.Lock()


def _open(path: str, file_bytes: int, fs: pafs.FileSystem, inner: str):
    """(random-access file, whether the caller closes it)."""
    if isinstance(fs, pafs.LocalFileSystem):
        return fs.open_input_file(inner), True
    key = (path, file_bytes)
    with _lock:
        f = _opened.get(key)
        if f is not None:
            _opened.move_to_end(key)
            return f, False
    f = fs.open_input_file(inner)
    with _lock:
        _opened[key] = f
        while len(_opened) > OPEN_FILES:
            _opened.popitem(last=False)  # not closed here: another thread may still be reading through it
    return f, False


def read_ranges(path: str, file_bytes: int, ranges: list[tuple[int, int]], hole: int = HOLE) -> list[bytes]:
    """The bytes of each ``(offset, length)`` of one file, in the order asked; ``file_bytes`` is its size."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    spans: list[list] = []  # [start, end, [indices]]
    for i in order:
        off, n = ranges[i]
        if spans and off - spans[-1][1] <= hole:
            spans[-1][1] = max(spans[-1][1], off + n)
            spans[-1][2].append(i)
        else:
            spans.append([off, off + n, [i]])
    out: list[bytes] = [b""] * len(ranges)
    fs, inner = storage.resolve(path)
    direct = s3_objects.direct(fs)
    f, close = (None, False) if direct else _open(path, file_bytes, fs, inner)
    try:
        for start, end, members in spans:
            data = s3_objects.get(fs, inner, start, end - start) if direct else f.read_at(end - start, start)
            for i in members:
                off, n = ranges[i]
                out[i] = data[off - start : off - start + n]
    except Exception:
        with _lock:
            _opened.pop((path, file_bytes), None)  # a failed file is opened afresh next time
        raise
    finally:
        if close:
            f.close()
    return out
