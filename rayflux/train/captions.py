"""The cached empty-caption embedding that caption dropout trains on.

The cache stage always encodes the empty caption ``""`` into the generation's text table, and its manifest says
where (``empty_caption``, from the generation index), so dropout uses exactly what the text encoders produce for no
prompt, and training never needs a text encoder. Reading it is one ranged GET.
"""

from __future__ import annotations

import torch

from rayflux.cache import ranges, tensors
from rayflux.train.step import EmptyCaption


def load_empty(where: dict) -> EmptyCaption:
    """Rebuild the empty caption's tensors (float32) from its index entry (see
    :func:`rayflux.cache.index.empty_caption`), plus the layout's ``text_dtype``."""
    if not isinstance(where, dict) or "t5_offset" not in where:
        raise ValueError(f"no empty-caption entry in the cache's index (got {type(where).__name__})")
    t5_raw, clip_raw = ranges.read_ranges(
        where["file"], where["file_bytes"],
        [(where["t5_offset"], where["t5_length"]), (where["clip_offset"], where["clip_length"])],
    )  # fmt: skip
    dtype = where["text_dtype"]
    t5 = tensors.from_bytes_numpy(t5_raw, dtype, (where["t5_len"], where["t5_dim"]))
    clip = tensors.from_bytes_numpy(clip_raw, dtype, (where["clip_dim"],))
    return EmptyCaption(torch.from_numpy(t5.copy()), torch.from_numpy(clip.copy()))
