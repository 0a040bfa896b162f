"""Byte-range reads of the tensors the generation index locates: no footer, one GET per span.

Ranges of one file that lie close together are merged into one request (a hole of up to ``HOLE`` bytes is read and
thrown away): a shard's neighbouring rows cost one GET, and the bytes read stay within a few percent of the
tensors' own bytes, since a hole is a row's page headers and small columns. Opening a file on S3 costs one HEAD
(pyarrow's S3 filesystem asks every object's size when it opens it, and its Python API takes no known size), so
all the ranges of one file are read through one open.
"""

from __future__ import annotations

from rayflux import storage

HOLE = 16 << 10


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
    with fs.open_input_file(inner) as f:
        for start, end, members in spans:
            data = f.read_at(end - start, start)
            for i in members:
                off, n = ranges[i]
                out[i] = data[off - start : off - start + n]
    return out
