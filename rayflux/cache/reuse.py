"""Incremental builds: what a new generation can copy from the previous committed generation of its cache key.

Every generation of one cache key was made by the same encoders and the same bucket knobs (the key says so), so a
sample whose relative path, content hash and crop are unchanged has the same latent, and a caption the same text
embedding. Those are copied into the new generation instead of being encoded again; only new or changed inputs
reach an encoder. The new generation owns its copies, so retiring the old one afterwards never breaks it; while the
build runs it reads the old generation's shards, so that generation must stay until the new one is committed.

Only the small id and size columns of the previous shards are read here; tensors are copied later by the writer
tasks, row by row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayflux.cache import generations, shards
from rayflux.cache.prepare import reuse_key


@dataclass
class Previous:
    """Indexes of one committed generation, as a new build needs them."""

    dir: str = ""
    """The previous generation's directory; empty when there is none."""
    known: dict[str, tuple[int, int, str]] = field(default_factory=dict)
    """:func:`~rayflux.cache.prepare.reuse_key` -> (upright width, height, sample_id) of each cached sample."""
    rows: dict[str, tuple[str, int]] = field(default_factory=dict)
    """sample_id -> (shard path, row) holding that sample's tensors."""
    text: dict[str, tuple[str, int]] = field(default_factory=dict)
    """caption_id -> (text shard path, row) holding that caption's embeddings."""


def load(manifest: dict | None) -> Previous:
    """Index a committed generation's manifest; an empty :class:`Previous` for None."""
    if manifest is None:
        return Previous()
    prev = Previous(dir=manifest["dir"])
    columns = ["sample_id", "rel_path", "source_sha256", "orig_w", "orig_h"]
    for path in generations.sample_files(manifest):
        t = shards.read_column(path, columns).to_pydict()
        for i, (sid, rel, sha, w, h) in enumerate(zip(*(t[c] for c in columns))):
            prev.known[reuse_key(rel, sha)] = (w, h, sid)
            prev.rows[sid] = (path, i)
    for path in generations.text_files(manifest):
        for i, cid in enumerate(shards.read_column(path, ["caption_id"])["caption_id"].to_pylist()):
            prev.text[cid] = (path, i)
    return prev
