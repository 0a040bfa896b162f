"""Discovery at cluster scale: the driver lists, Ray tasks read caption files and draw ``max_samples``.

The driver only lists folders (and reads metadata tables). Every per-image read happens in preparation tasks of a
few hundred images each: a dataset with sidecar captions has its caption files read there, and a dataset with
``max_samples`` has each image read, decoded and planned there, exactly as the cache stage will, so that the draw
keeps only images that will really be cached. Each task keeps its own ``max_samples`` lowest-ranked usable images
(:func:`rayflux.sources.draw`) and counts the rest; the driver draws again among those few, which gives the same
subset as one draw over the whole dataset. Bad images found on the way are recorded skips, like any other.

A caption file the previous generation already read, listed unchanged, is not read again (see
:mod:`rayflux.cache.sidecars`): a dataset whose caption files are all known, and that has no ``max_samples``,
settles on the driver without a single read.
"""

from __future__ import annotations

import functools
import json

import pyarrow as pa

from rayflux import datasets, sources
from rayflux.cache import fit, sidecars
from rayflux.cache.prepare import skip_reason
from rayflux.config import JobConfig
from rayflux.models import ModelFacts

# Images per settling task: as for preparation, hundreds, so the tasks spread over the cluster.
_IMAGES_PER_TASK = 256

_SETTLED = pa.schema(
    [("kind", pa.string()), ("uri", pa.string()), ("rel_path", pa.string()), ("size", pa.int64()),
     ("mtime_ns", pa.int64()), ("dataset", pa.string()), ("caption", pa.string()), ("skip_reason", pa.string()),
     ("uncaptioned", pa.bool_()), ("left_out", pa.int64()), ("references", pa.string()),
     ("references_stamp", pa.string()), ("sidecar", pa.string()), ("sidecar_stamp", pa.string()),
     ("sidecar_lines", pa.string())]
)  # fmt: skip


def _needs_task(ds, row: dict) -> bool:
    """Does settling this row read anything? A row that does not settles on the driver without any read."""
    return ds.max_samples > 0 or (bool(row.get("sidecar")) and row.get("sidecar_lines") is None)


def _settle_block(batch: pa.Table, by_key: dict, specs: dict, seed: int, max_pixels: int) -> pa.Table:
    """Ray Data batch function: settle one block of listed rows; per capped dataset, keep only its local draw."""
    rows = batch.to_pylist()
    out: list[dict] = []
    for key in sorted({r["dataset"] for r in rows}):
        ds = by_key[key]
        group = [{**r, "options": json.loads(r["options"])} for r in rows if r["dataset"] == key]
        usable = functools.partial(skip_reason, spec=specs[key], seed=seed, max_pixels=max_pixels)
        settled = sources.settle(group, ds, seed, usable if ds.max_samples else None)
        if ds.max_samples:
            kept, more = sources.draw([r for r in settled if not r["skip_reason"]], ds.max_samples)
            settled = [r for r in settled if r["skip_reason"]] + kept
            if more:
                out.append({"kind": "left", "dataset": key, "left_out": more})
        out += [{**r, "kind": "row", "left_out": 0} for r in settled]
    return pa.Table.from_pylist([{f: r.get(f) for f in _SETTLED.names} for r in out], schema=_SETTLED)


def discover(cfg: JobConfig, facts: ModelFacts, seed: int, previous: dict | None = None) -> sources.Discovery:
    """Discover every dataset of the job, in config order: listings here, per-image reads in Ray tasks.

    ``previous``: the manifest of the newest committed generation of the cache key, whose caption files listed
    unchanged are not read again."""
    import ray.data

    from rayflux.cache.stage import bucket_specs

    data = cfg.data
    prefix = datasets.prefixes_paths(data)
    listings = [sources.list_dataset(ds, datasets.key(data, ds), prefix) for ds in datasets.datasets_of(data)]
    if any(ls.ds.caption_strategy == "sidecar" for ls in listings):
        table = sidecars.known(previous)
        for ls in listings:
            sidecars.attach(ls.rows, table)
        del table
    # Rows that need no read settle here; the others travel to the tasks as Arrow blocks, and the listing's own
    # rows are dropped before the settled ones come back (the driver never holds both).
    here = {ls.key: sources.settle([r for r in ls.rows if not _needs_task(ls.ds, r)], ls.ds, seed) for ls in listings}
    blocks = _blocks([row for ls in listings for row in ls.rows if _needs_task(ls.ds, row)])
    for ls in listings:
        ls.rows = []
    settled: dict[str, list[dict]] = {ls.key: [] for ls in listings}
    left_out = dict.fromkeys(settled, 0)
    if blocks:
        ds = ray.data.from_arrow(blocks)
        del blocks
        ds = ds.map_batches(
            _settle_block,
            fn_kwargs={"by_key": {ls.key: ls.ds for ls in listings}, "specs": bucket_specs(cfg, facts), "seed": seed,
                       "max_pixels": data.max_image_pixels},
            batch_size=None, batch_format="pyarrow", num_cpus=fit.PREPARE_CPUS,
        )  # fmt: skip
        ds.set_name(f"discover-s{seed}")
        for block in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for r in block.to_pylist():
                if r["kind"] == "left":
                    left_out[r["dataset"]] += r["left_out"]
                else:
                    settled[r["dataset"]].append(r)
    found = sources.Discovery()
    for ls in listings:
        found.extend(sources.gather(ls, settled.pop(ls.key) + here.pop(ls.key), left_out[ls.key]))
    return found


_LISTED = [("uri", pa.string()), ("rel_path", pa.string()), ("size", pa.int64()), ("mtime_ns", pa.int64()),
           ("dataset", pa.string()), ("file_name", pa.string()), ("sidecar", pa.string()),
           ("sidecar_stamp", pa.string()), ("sidecar_lines", pa.string()), ("references", pa.string()),
           ("references_stamp", pa.string()), ("missing_reference", pa.string())]  # fmt: skip


def _blocks(rows: list[dict]) -> list[pa.Table]:
    """Listed rows as Arrow blocks of ``_IMAGES_PER_TASK`` rows (``options`` as JSON): one settling task each."""
    out = []
    for i in range(0, len(rows), _IMAGES_PER_TASK):
        part = rows[i : i + _IMAGES_PER_TASK]
        cols = {name: pa.array([r.get(name) for r in part], t) for name, t in _LISTED}
        cols["options"] = pa.array([json.dumps(r.get("options", [])) for r in part], pa.string())
        out.append(pa.table(cols))
    return out
