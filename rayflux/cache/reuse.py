"""Incremental builds: what a new generation can take from the previous committed generation of its cache key.

Every generation of one cache key was made by the same encoders and the same bucket knobs (the key says so), so a
sample whose relative path, content and crop are unchanged has the same latent, and a caption the same text
embedding. A new generation does not copy those: its index points at the rows where an earlier generation wrote
them, and only new or changed inputs reach an encoder and a writer. Retiring a generation therefore deletes only
the files no live generation's index points into (see :func:`rayflux.cache.generations.retire`).

Everything here comes from the previous generation's index (two Parquet files), never from its shards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from rayflux.cache import index


@dataclass
class Previous:
    """One committed generation's index, as a new build needs it."""

    dir: str = ""
    """The previous generation's directory; empty when there is none."""
    samples: pa.Table | None = None
    """The previous sample index (None when there is none): a preparation task looks up its own rows' entries in it
    (see :func:`rows_for`), so the driver holds it as Arrow bytes, never as an object per sample."""
    captions: pa.Table = field(default_factory=lambda: pa.table({"caption_id": pa.array([], pa.string())}))
    """The previous caption index: known captions are referenced, not encoded again."""

    def known_captions(self, ids: list[str]) -> pa.Table:
        """The index rows of those of ``ids`` the previous generation holds."""
        return self.captions.filter(pc.is_in(self.captions["caption_id"], pa.array(ids, pa.string())))


def load(manifest: dict | None) -> Previous:
    """Read a committed generation's index; an empty :class:`Previous` for None."""
    if manifest is None:
        return Previous()
    return Previous(dir=manifest["dir"], samples=index.read(manifest, "samples"), captions=index.read(manifest, "captions"))


def rows_for(samples: pa.Table | None, rel_paths: pa.Array) -> dict[str, str]:
    """rel_path -> the previous index row as JSON, for those of ``rel_paths`` it holds: what ``prepare_row`` needs to
    reuse a sample. Runs in the preparation tasks, one block of rows at a time."""
    if samples is None:
        return {}
    found = samples.filter(pc.is_in(samples["rel_path"], rel_paths)).to_pylist()
    return {r["rel_path"]: json.dumps(r) for r in found}
