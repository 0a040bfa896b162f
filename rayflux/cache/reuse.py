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
    samples: dict[str, str] = field(default_factory=dict)
    """rel_path -> that sample's index row as JSON: what a preparation task needs to reuse it (see ``prepare_row``)."""
    captions: pa.Table = field(default_factory=lambda: pa.table({"caption_id": pa.array([], pa.string())}))
    """The previous caption index: known captions are referenced, not encoded again."""

    def known_captions(self, ids: list[str]) -> pa.Table:
        """The index rows of those of ``ids`` the previous generation holds."""
        return self.captions.filter(pc.is_in(self.captions["caption_id"], pa.array(ids, pa.string())))


def load(manifest: dict | None) -> Previous:
    """Read a committed generation's index; an empty :class:`Previous` for None."""
    if manifest is None:
        return Previous()
    samples = index.read(manifest, "samples").to_pylist()
    return Previous(
        dir=manifest["dir"],
        samples={r["rel_path"]: json.dumps(r) for r in samples},
        captions=index.read(manifest, "captions"),
    )
