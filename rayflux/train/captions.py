"""The cached empty-caption embedding that caption dropout trains on.

The cache stage always encodes the empty caption ``""`` into the generation's text table, so dropout uses exactly
what the text encoders produce for no prompt, and training never needs a text encoder.
"""

from __future__ import annotations

import torch

from rayflux.cache import shards, tensors
from rayflux.sources import caption_id
from rayflux.train.step import EmptyCaption


def load_empty(text_files: list[str]) -> EmptyCaption:
    """Find the ``""`` caption's row among a generation's text shards and rebuild its tensors (float32)."""
    wanted = caption_id("")
    for f in text_files:
        ids = shards.read_column(f, ["caption_id"])["caption_id"].to_pylist()
        if wanted in ids:
            row = shards.read_rows(f, [ids.index(wanted)]).to_pylist()[0]
            t5 = tensors.from_bytes_numpy(row["t5"], row["text_dtype"], (row["t5_len"], row["t5_dim"]))
            clip = tensors.from_bytes_numpy(row["clip_pooled"], row["text_dtype"], (row["clip_dim"],))
            return EmptyCaption(torch.from_numpy(t5.copy()), torch.from_numpy(clip.copy()))
    raise ValueError(f"the cache's text table has no empty-caption row (searched {len(text_files)} files)")
