"""The cached empty-caption embedding that caption dropout trains on.

The cache stage always encodes the empty caption ``""`` into the generation's text table, and its manifest says
where (``empty_caption``, from the generation index), so dropout uses exactly what the text encoders produce for no
prompt, and training never needs a text encoder. Reading it is one ranged GET, checked against the checksums the index
recorded, then decoded (:mod:`rayflux.cache.codec`).
"""

from __future__ import annotations

import torch

from rayflux.cache import codec, integrity, ranges, tensors
from rayflux.families.base import TextTensor
from rayflux.train.step import EmptyCaption


def load_empty(where: dict) -> EmptyCaption:
    """Rebuild the empty caption's named tensors (float32) from its index entry (see
    :func:`rayflux.cache.index.empty_caption`), with the layout's ``text_dtype`` and ``text`` tensors."""
    if not isinstance(where, dict) or "text" not in where:
        raise ValueError(f"no empty-caption entry in the cache's index (got {type(where).__name__})")
    specs = [t if isinstance(t, TextTensor) else TextTensor(**t) for t in where["text"]]
    raw = ranges.read_ranges(
        where["file"], where["file_bytes"], [(where[f"{t.key}_offset"], where[f"{t.key}_length"]) for t in specs]
    )
    dtype, out = where["text_dtype"], {}
    for t, data in zip(specs, raw):
        off, shape = where[f"{t.key}_offset"], tuple(where[d] for d in t.dims)
        integrity.check(data, where[f"{t.key}_crc32"], where["file"], off, f"{t.name} of the empty caption")
        # Checked as stored, then decoded; an index written before codecs has no codec columns (raw).
        data = codec.decode(data, where.get(f"{t.key}_{codec.COLUMN}") or codec.RAW, dtype, shape)
        out[t.name] = torch.from_numpy(tensors.from_bytes_numpy(data, dtype, shape).copy())
    return EmptyCaption(out)
