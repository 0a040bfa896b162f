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

import copy
import functools

import pyarrow as pa
import pyarrow.compute as pc

from rayflux import datasets, listing, sources
from rayflux.cache import fit, sidecars
from rayflux.cache.prepare import skip_reason
from rayflux.config import JobConfig
from rayflux.models import ModelFacts

# Images per settling task: as for preparation, hundreds, so the tasks spread over the cluster.
_IMAGES_PER_TASK = 256

_BLOCK = sources.SETTLED.append(pa.field("left_out", pa.int64()))
"""What a settling task returns: its settled rows (``left_out`` 0), and per capped dataset one row with only
``dataset`` and how many usable images its local draw left out."""


def _needs_task(ds, listed: pa.Table) -> pa.ChunkedArray:
    """Which listed rows read something to settle; the others settle on the driver without any read."""
    if ds.max_samples > 0:
        return pa.chunked_array([pa.repeat(True, listed.num_rows)], pa.bool_())
    return pc.and_(pc.not_equal(listed["sidecar"], ""), pc.is_null(listed["sidecar_lines"]))


def _settle_block(batch: pa.Table, by_key: dict, specs: dict, seed: int, max_pixels: int) -> pa.Table:
    """Ray Data batch function: settle one block of listed rows; per capped dataset, keep only its local draw.
    ``by_key``: each dataset's :class:`rayflux.listing.Listing`, without its rows."""
    parts = [_BLOCK.empty_table()]
    for key in sorted(set(batch["dataset"].to_pylist())):
        ls = by_key[key]
        ds = ls.ds
        group = batch.filter(pc.equal(batch["dataset"], key))
        usable = functools.partial(skip_reason, spec=specs[key], seed=seed, max_pixels=max_pixels)
        # A capped dataset's images are read here: their URIs are made for this block only.
        settled = sources.settle_table(ls.with_uris(group) if ds.max_samples else group, ds, seed,
                                       usable if ds.max_samples else None)  # fmt: skip
        left = 0
        if ds.max_samples:
            skipping = pc.not_equal(settled["skip_reason"], "")
            kept, left = sources.draw(settled.filter(pc.invert(skipping)), ds.max_samples)
            settled = pa.concat_tables([settled.filter(skipping), kept])
        parts.append(settled.append_column("left_out", pa.repeat(pa.scalar(0, pa.int64()), settled.num_rows)))
        if left:
            parts.append(pa.Table.from_pylist([{"dataset": key, "left_out": left}], schema=_BLOCK))
    return pa.concat_tables(parts)


def discover(cfg: JobConfig, facts: ModelFacts, seed: int, previous: dict | None = None) -> sources.Discovery:
    """Discover every dataset of the job, in config order: listings here, per-image reads in Ray tasks.

    ``previous``: the manifest of the newest committed generation of the cache key, whose caption files listed
    unchanged are not read again. The driver holds the images as Arrow throughout: listed tables, slices of them
    for the tasks, settled blocks concatenated."""
    import ray.data

    from rayflux.cache.stage import bucket_specs

    data = cfg.data
    prefix = datasets.prefixes_paths(data)
    listings = [listing.list_dataset(ds, datasets.key(data, ds), prefix) for ds in datasets.datasets_of(data)]
    if any(ls.ds.caption_strategy == "sidecar" for ls in listings):
        table = sidecars.known(previous)
        for ls in listings:
            ls.table = sidecars.attach(ls.table, table)
        del table
    # Rows that need no read settle here, a bounded chunk at a time; the others travel to the tasks as Arrow
    # slices, and the listing's own table is dropped before the settled ones come back.
    here, remote = {}, []
    for ls in listings:
        needs = _needs_task(ls.ds, ls.table)
        # No copy when every row goes one way (a first build: all to tasks; a rerun: all here).
        here[ls.key] = sources.settle_table(sources.where(ls.table, pc.invert(needs)), ls.ds, seed)
        remote.append(sources.where(ls.table, needs))
        ls.table = listing.LISTED.empty_table()
        del needs
    listing.trim()
    remote = pa.concat_tables(remote)
    settled: list[pa.Table] = [sources.SETTLED.empty_table()]
    left_out = dict.fromkeys(here, 0)
    if remote.num_rows:
        blocks = [remote.slice(i, _IMAGES_PER_TASK) for i in range(0, remote.num_rows, _IMAGES_PER_TASK)]
        ds = ray.data.from_arrow(blocks)
        del blocks, remote
        listing.trim()
        ds = ds.map_batches(
            _settle_block,
            fn_kwargs={"by_key": {ls.key: ls for ls in listings}, "specs": bucket_specs(cfg, facts), "seed": seed,
                       "max_pixels": data.max_image_pixels},
            batch_size=None, batch_format="pyarrow", num_cpus=fit.PREPARE_CPUS,
        )  # fmt: skip
        ds.set_name(f"discover-s{seed}")
        # Blocks come back in listing order, so gathering them needs no sorted copy of every image.
        options = copy.deepcopy(ds.context.execution_options)
        options.preserve_order = True
        ds.context.execution_options = options
        for block in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            counts = pc.is_null(block["rel_path"])
            for row in block.filter(counts).select(["dataset", "left_out"]).to_pylist():  # one per capped dataset
                left_out[row["dataset"]] += row["left_out"]
            settled.append(block.filter(pc.invert(counts)).drop_columns(["left_out"]))
    settled_all = pa.concat_tables(settled)
    del settled
    listing.trim()
    found = sources.Discovery()
    for ls in listings:
        mine = settled_all if len(listings) == 1 else settled_all.filter(pc.equal(settled_all["dataset"], ls.key))
        found.extend(sources.gather(ls, pa.concat_tables([mine, here.pop(ls.key)]), left_out[ls.key]))
    del settled_all, mine
    listing.trim()
    return found
