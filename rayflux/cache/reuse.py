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
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from rayflux.cache import index, integrity
from rayflux.cache.manifest import Manifest


@dataclass
class Previous:
    """One committed generation's index, as a new build needs it."""

    dir: str = ""
    """The previous generation's directory; empty when there is none."""
    samples: object = None
    """The previous sample index in Ray's object store (an ObjectRef; None when there is none), read there by a
    task: a preparation task looks up its own rows' entries in it (see :func:`rows_for`), and the driver never
    holds it (at real sizes about 0.4 KB an image)."""
    manifest: Manifest | None = None
    """The previous generation's manifest (None when there is none): its caption index is read when the text pass's
    input is found (:mod:`rayflux.cache.text_input`, see :meth:`known_captions`)."""

    def known_captions(self, ids: pa.Array, add: Callable[[pa.Table], None]) -> pa.Array:
        """Pass the index rows of those of ``ids`` the previous generation holds to ``add`` (a batch of the caption
        index at a time, never the whole index), and return their ids. Captions that ``cache verify`` recorded as
        damaged in it are not offered (see :mod:`rayflux.cache.integrity`)."""
        known = [pa.array([], pa.string())]
        if self.manifest is None:
            return known[0]
        damage = integrity.load(self.manifest.dir)
        if damage is not None and damage.captions:  # recorded by cache verify: encoded again, not offered
            ids = pc.filter(ids, pc.invert(pc.is_in(ids, value_set=pa.array(damage.captions, pa.string()))))
        for batch in index.batches(self.manifest, "captions"):
            rows = pa.Table.from_batches([batch]).filter(pc.is_in(batch["caption_id"], value_set=ids))
            if rows.num_rows:
                add(rows)
                known.append(rows["caption_id"].combine_chunks())
        return pa.concat_arrays(known)


def load(manifest: dict | None) -> Previous:
    """A committed generation's index: its sample index read into Ray's object store by a task (Ray must be up).
    An empty :class:`Previous` for None. Raises what the read raised. Samples and captions that ``cache verify``
    recorded as damaged in it are left out: the new build encodes them again, exactly those."""
    if manifest is None:
        return Previous()
    import ray

    manifest = Manifest.of(manifest)
    damage = integrity.load(manifest.dir) or integrity.Damage()
    samples, rows = ray.remote(num_returns=2)(_read_samples).remote(manifest, damage.samples)
    ray.get(rows)  # the read's error, if any, here and now rather than in a preparation task
    return Previous(dir=manifest.dir, samples=samples, manifest=manifest)


def _read_samples(manifest: dict, damaged: list[str]) -> tuple[pa.Table, int]:
    table = index.read(manifest, "samples")
    if damaged:
        table = table.filter(pc.invert(pc.is_in(table["sample_id"], value_set=pa.array(damaged, pa.string()))))
    return table, table.num_rows


def rows_for(samples, rel_paths: pa.Array) -> dict[str, str]:
    """rel_path -> the previous index row as JSON, for those of ``rel_paths`` it holds: what ``prepare_row`` needs to
    reuse a sample. Runs in the preparation tasks, one block of rows at a time. ``samples``: :attr:`Previous.samples`."""
    if samples is None:
        return {}
    import ray

    samples = ray.get(samples)
    found = samples.filter(pc.is_in(samples["rel_path"], rel_paths)).to_pylist()
    return {r["rel_path"]: json.dumps(r) for r in found}
