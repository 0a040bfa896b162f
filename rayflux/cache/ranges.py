"""Byte-range reads of the tensors the generation index locates: no footer, one GET per span.

Ranges of one file that lie close together are merged into one request: the hole between them is read and thrown
away. Which holes to merge is decided over all the ranges one read asks for (:func:`plan_spans`): the smallest holes
first, each at most ``HOLE`` bytes, while the bytes thrown away stay within ``WASTE`` of the bytes asked for. So a
read never fetches more than ``1 + WASTE`` times what it uses, whatever the tensors' sizes: a run of neighbouring
rows of one bucket (holes of a row's page headers and small columns) is one GET, while a hole holding another
bucket's latents is read only when it is small against what the read uses.

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
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from rayflux import s3_objects, storage

HOLE = 16 << 10
"""The largest hole between two ranges that one GET reads through."""
WASTE = 0.05
"""The bytes a read may fetch and throw away (its merged holes), as a fraction of the bytes it asks for."""
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


@dataclass
class Span:
    """One request: bytes ``start .. end`` of a file, holding the asked ranges ``members`` (their indices)."""

    start: int
    end: int
    members: list[int] = field(default_factory=list)


def plan_spans(asks: dict[str, list[tuple[int, int]]], waste: float = WASTE, hole: int = HOLE) -> dict[str, list[Span]]:
    """The requests for ``{file: [(offset, length), ...]}``: per file, spans in offset order. A hole between
    neighbouring ranges is merged (read through) when it is at most ``hole`` bytes, smallest holes first, while the
    merged holes add up to at most ``waste`` times the bytes asked. Empty ranges need no request."""
    asked = sum(n for ranges in asks.values() for _, n in ranges)
    order = {
        path: sorted((i for i, (_, n) in enumerate(ranges) if n > 0), key=lambda i: ranges[i])
        for path, ranges in asks.items()
    }
    gaps = []  # (hole bytes, file, position in its order): the hole before that range
    for path, idx in order.items():
        end = None
        for pos, i in enumerate(idx):
            off, n = asks[path][i]
            if end is not None:
                gaps.append((max(off - end, 0), path, pos))
            end = off + n if end is None else max(end, off + n)
    merged, budget = set(), waste * asked
    for size, path, pos in sorted(gaps):
        if size > 0 and (size > hole or size > budget):
            break  # the gaps are in size order: no later one fits either
        budget -= size
        merged.add((path, pos))
    out: dict[str, list[Span]] = {}
    for path, idx in order.items():
        spans = out.setdefault(path, [])
        for pos, i in enumerate(idx):
            off, n = asks[path][i]
            if spans and (path, pos) in merged:
                spans[-1].end = max(spans[-1].end, off + n)
                spans[-1].members.append(i)
            else:
                spans.append(Span(off, off + n, [i]))
    return out


def read_spans(path: str, file_bytes: int, ranges: list[tuple[int, int]], spans: list[Span]) -> list[bytes]:
    """The bytes of each ``(offset, length)`` of one file, in the order asked, fetched one request per span of
    :func:`plan_spans`; ``file_bytes`` is the file's size."""
    out: list[bytes] = [b""] * len(ranges)
    if not spans:
        return out
    fs, inner = storage.resolve(path)
    direct = s3_objects.direct(fs)
    f, close = (None, False) if direct else _open(path, file_bytes, fs, inner)
    try:
        for span in spans:
            size = span.end - span.start
            data = s3_objects.get(fs, inner, span.start, size) if direct else f.read_at(size, span.start)
            for i in span.members:
                off, n = ranges[i]
                out[i] = data[off - span.start : off - span.start + n]
    except Exception:
        with _lock:
            _opened.pop((path, file_bytes), None)  # a failed file is opened afresh next time
        raise
    finally:
        if close:
            f.close()
    return out


def read_ranges(path: str, file_bytes: int, ranges: list[tuple[int, int]], waste: float = WASTE) -> list[bytes]:
    """The bytes of each ``(offset, length)`` of one file, in the order asked; ``file_bytes`` is its size."""
    return read_spans(path, file_bytes, ranges, plan_spans({path: ranges}, waste)[path])
