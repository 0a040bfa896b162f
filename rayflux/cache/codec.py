"""How a stored tensor's bytes are encoded: raw, or zstd over its byte-shuffled bytes.

A text tensor is compressed when that makes it smaller (:func:`encode`); latents are always stored raw. The stored
bytes stay one contiguous value of the shard, read by byte range like any other; the caption index records each text
tensor's codec (``<key>_codec``: ``""`` raw, :data:`SHUFFLE_ZSTD`), and the checksum covers the stored bytes, so a
read verifies a tensor before it decompresses it (:mod:`rayflux.cache.integrity`). An index written before codecs
has no such column: every tensor in it is raw.

Why byte shuffling: a float's bytes differ in how much they vary. Grouping each value's first bytes together, then
its second bytes, and so on, puts the sign and exponent bytes (few distinct values across a tensor) into long runs
zstd folds, while the low mantissa bytes stay as they are. On the tiny FLUX.1's float32 per-token text
embeddings it took zstd from 0.89 to 0.55 of the raw size; the latents gained under 10% and are read every step,
so they stay raw (BENCHMARKS.md, "Cache storage"). Why pyarrow's zstd: pyarrow is already a dependency, and any
plain pyarrow reader can undo it:

    raw = pyarrow.Codec("zstd").decompress(stored, nbytes, asbytes=True)
    values = np.frombuffer(raw, np.uint8).reshape(itemsize, -1).T.tobytes()   # then np.frombuffer(values, dtype)
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from rayflux.cache import tensors

COLUMN = "codec"
"""Suffix of the caption index's codec columns (``<key>_codec``). An index written before them lacks them: its
tensors are all raw."""
RAW = ""
"""The codec of bytes stored as they are."""
SHUFFLE_ZSTD = "shuffle-zstd"
"""Byte-shuffled by significance (``itemsize`` planes), then one zstd frame."""
CODECS = (RAW, SHUFFLE_ZSTD)
LEVEL = 3
"""zstd level: levels 1 to 9 stored the tiny FLUX.1's per-token text embeddings at 0.56 to 0.54 of their raw size
(19: 0.51, at many times the write time); 3 is zstd's own default (pyarrow's is 1)."""

_zstd = pa.Codec("zstd", LEVEL)


def shuffle(raw, itemsize: int) -> np.ndarray:
    """Each value's byte ``k`` for every value, then byte ``k + 1``: ``itemsize`` planes of ``len(raw) / itemsize``."""
    return np.frombuffer(raw, np.uint8).reshape(-1, itemsize).T.copy()


def unshuffle(planes, itemsize: int) -> bytes:
    """Undo :func:`shuffle`: the values' bytes back in their order."""
    src = np.frombuffer(planes, np.uint8).reshape(itemsize, -1)
    out = np.empty((src.shape[1], itemsize), np.uint8)
    for k in range(itemsize):  # one plane at a time: a strided write per plane beats a transposed copy
        out[:, k] = src[k]
    return out.tobytes()


def encode(raw: bytes, dtype: str) -> tuple[bytes, str]:
    """``(stored bytes, codec)`` of one text tensor's raw bytes: shuffled and compressed when that is smaller, else
    the raw bytes themselves (a 32-value pooled embedding does not shrink)."""
    itemsize = tensors.ITEMSIZE[dtype]
    if not raw or len(raw) % itemsize:
        return raw, RAW
    packed = _zstd.compress(shuffle(raw, itemsize), asbytes=True)
    return (packed, SHUFFLE_ZSTD) if len(packed) < len(raw) else (raw, RAW)


class CodecError(ValueError):
    """Stored bytes that do not decode to their tensor's raw size."""


def decode(stored, codec: str, dtype: str, shape) -> bytes:
    """The raw bytes of a tensor of ``shape`` and ``dtype`` stored as ``stored`` by ``codec``. Raw bytes come back
    unchanged (their length is the caller's to check); compressed ones must decode to exactly the raw size, or
    :class:`CodecError`. Call it after the checksum: a changed byte should read as a changed tensor, not as a
    codec failure."""
    if codec == RAW:
        return stored
    if codec != SHUFFLE_ZSTD:
        raise CodecError(f"unknown codec {codec!r} (this rayflux reads {', '.join(repr(c) for c in CODECS)})")
    nbytes = tensors.nbytes(shape, dtype)
    try:
        planes = _zstd.decompress(stored, nbytes, asbytes=True)
    except OSError as exc:
        raise CodecError(f"{codec} bytes do not decode to {nbytes} bytes: {exc}") from None
    if len(planes) != nbytes:
        raise CodecError(f"{codec} bytes decode to {len(planes)} bytes, expected {nbytes}")
    return unshuffle(planes, tensors.ITEMSIZE[dtype])
