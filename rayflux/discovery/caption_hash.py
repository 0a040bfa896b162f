"""A caption's identity: the hash that names its row in the text shards, and a generation's unique captions."""

from __future__ import annotations

import hashlib

import pyarrow as pa
import pyarrow.compute as pc

_CHUNK = 4096  # listed rows settled through Python at a time in this process


def caption_id(caption: str) -> str:
    return hashlib.sha256(caption.encode("utf-8")).hexdigest()[:24]


def unique_captions(column: pa.ChunkedArray) -> pa.Array:
    """A generation's captions, each once and sorted, with the empty caption among them, as Arrow."""
    found = pa.concat_arrays([pc.unique(column), pa.array([""], pa.string())]).unique()
    return found.take(pc.sort_indices(found))


def caption_ids(captions: pa.Array) -> pa.Array:
    """:func:`caption_id` of each caption, through Python a bounded chunk at a time."""
    parts = [
        pa.array([caption_id(t) for t in captions.slice(i, _CHUNK).to_pylist()], pa.string())
        for i in range(0, len(captions), _CHUNK)
    ]
    return pa.concat_arrays(parts) if parts else pa.array([], pa.string())
