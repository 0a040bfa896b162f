"""Discovery at cluster scale: the driver lists, Ray tasks read caption files and draw ``max_samples``.

The driver only lists folders (and reads metadata tables). Every per-image read happens in preparation tasks of a
few hundred images each: a dataset with sidecar captions has its caption files read there, and a dataset with
``max_samples`` has each image read, decoded and planned there, exactly as the cache stage will, so that the draw
keeps only images that will really be cached. Each task keeps its own ``max_samples`` lowest-ranked usable images
(:func:`rayflux.discovery.subset.draw`) and counts the rest; the driver draws again among those few, which gives the same
subset as one draw over the whole dataset. Bad images found on the way are recorded skips, like any other.

A caption file the previous generation already read, listed unchanged, is not read again (see
:mod:`rayflux.cache.sidecars`): a dataset whose caption files are all known, and that has no ``max_samples``,
settles on the driver without a single read.

The driver holds each image about once. The listing is made a bounded part at a time (:mod:`rayflux.discovery.listing`);
each part is then settled here or sent to settling tasks (a window of them in flight at a time) and released. The
rows that come back keep only the columns the discovery needs, and their caption files' paths, stamps and lines go
to a local file (:class:`rayflux.discovery.sidecar_spool.Spool`) that the generation uploads at commit.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import pyarrow as pa
import pyarrow.compute as pc

from rayflux import allocator, datasets
from rayflux.cache import fit, masks, sidecars
from rayflux.cache.prepare import skip_reason
from rayflux.config import JobConfig
from rayflux.discovery import discoveries, listing, schemas, settling, sidecar_spool, subset
from rayflux.models import ModelFacts

# Images per settling task: as for preparation, hundreds, so the tasks spread over the cluster.
_IMAGES_PER_TASK = 256

_LEFT_OUT = b"rayflux.left_out"
"""Schema metadata of a settling task's table: per capped dataset, how many usable images its local draw left out
(JSON). In the metadata, so that no row carries a count."""


def _needs_task(ds, listed: pa.Table) -> pa.ChunkedArray:
    """Which listed rows read something to settle; the others settle on the driver without any read."""
    if ds.max_samples > 0:
        return pa.chunked_array([pa.repeat(True, listed.num_rows)], pa.bool_())
    return pc.and_(pc.not_equal(listed["sidecar"], ""), pc.is_null(listed["sidecar_lines"]))


def _settle_block(batch: pa.Table, shared: dict) -> pa.Table:
    """Ray task: settle one block of listed rows (:data:`rayflux.discovery.schemas.SETTLED` rows); per capped dataset, keep
    only its local draw and say how many it left out (:data:`_LEFT_OUT`). ``shared``: each dataset's
    :class:`rayflux.discovery.listing.Listing` without its rows (``by_key``), bucket specs, seed and pixel cap."""
    by_key, specs, seed, max_pixels = shared["by_key"], shared["specs"], shared["seed"], shared["max_pixels"]
    parts, left_out = [schemas.SETTLED.empty_table()], {}
    for key in sorted(set(batch["dataset"].to_pylist())):
        ls = by_key[key]
        ds = ls.ds
        group = batch.filter(pc.equal(batch["dataset"], key))
        usable = functools.partial(
            skip_reason, spec=specs[key], seed=seed, max_pixels=max_pixels, mask=masks.policy_of(ds)
        )
        # A capped dataset's images are read here: their URIs are made for this block only.
        settled = settling.settle_table(
            ls.with_uris(group) if ds.max_samples else group, ds, seed, usable if ds.max_samples else None
        )
        left = 0
        if ds.max_samples:
            skipping = pc.not_equal(settled["skip_reason"], "")
            kept, left = subset.draw(settled.filter(pc.invert(skipping)), ds.max_samples)
            settled = pa.concat_tables([settled.filter(skipping), kept])
        parts.append(settled)
        if left:
            left_out[key] = left
    return pa.concat_tables(parts).combine_chunks().replace_schema_metadata({_LEFT_OUT: json.dumps(left_out)})


def discover(
    cfg: JobConfig, facts: ModelFacts, seed: int, previous: dict | None = None, captions=None
) -> discoveries.Discovery:
    """Discover every dataset of the job, in config order: listings here, per-image reads in Ray tasks.

    ``previous``: the manifest of the newest committed generation of the cache key, whose caption files listed
    unchanged are not read again. ``captions``: the caption stage's committed table
    (:class:`rayflux.caption.table.Committed`), whose VLM captions become the listed images' caption options. The driver holds the images as Arrow throughout, and each at most once besides
    a bounded window: a listed part is settled here or handed to tasks and then released, and only the settled
    rows accumulate (see :func:`_settle_all`)."""
    with allocator.system_pool():
        return _discover(cfg, facts, seed, previous, captions)


def _discover(cfg: JobConfig, facts: ModelFacts, seed: int, previous: dict | None, captions) -> discoveries.Discovery:
    data = cfg.data
    prefix = datasets.prefixes_paths(data)
    listings = [listing.list_dataset(ds, datasets.key(data, ds), prefix) for ds in datasets.datasets_of(data)]
    for ls in listings if captions is not None else ():
        ls.table = captions.attach(ls.key, ls.table)
    # The caption files the previous generation read: attached to each part of the listing as it is settled.
    known = sidecars.Known(previous if any(ls.ds.caption_strategy == "sidecar" for ls in listings) else None)
    spool = sidecar_spool.Spool()
    try:
        settled, left_out = _settle_all(cfg, facts, seed, listings, spool, known)
    finally:
        known.close()
    allocator.trim()
    found = discoveries.Discovery(sidecars=spool)
    for ls in listings:
        found.extend(discoveries.gather(ls, pa.concat_tables(settled.pop(ls.key)), left_out[ls.key]))
        allocator.trim()
    return found


def _settle_all(
    cfg: JobConfig, facts: ModelFacts, seed: int, listings: list, spool: sidecar_spool.Spool, known: sidecars.Known
) -> tuple:
    """Settle every listed row, in listing order: those that need no read here, the others in Ray tasks of
    :data:`_IMAGES_PER_TASK` rows. Returns each dataset's settled parts (:data:`rayflux.discovery.schemas.GATHERED` columns)
    and how many usable images its local draws left out; the caption files go to ``spool`` as rows arrive.
    ``known``: the previous generation's sidecar table (empty when there is none).

    Plain tasks, not a Ray Data pipeline, because the driver decides when each input is released: a part's rows
    are sent to at most :func:`_window` tasks at a time and dropped here once sent, and a task's input is freed
    when it finishes. (A dataset made ``from_arrow`` keeps every input block in the driver's object store until
    the dataset is gone, so the listing was held twice at the end.)"""
    import ray

    from rayflux.cache.keys import bucket_specs

    rowless = {ls.key: dataclasses.replace(ls, table=listing.LISTED.empty_table()) for ls in listings}
    tasks = _Tasks(
        ray.put(
            {
                "by_key": rowless,
                "specs": bucket_specs(cfg, facts),
                "seed": seed,
                "max_pixels": cfg.data.max_image_pixels,
            }
        ),
        listings,
        spool,
    )
    try:
        for ls in listings:
            parts = ls.table.to_batches(max_chunksize=listing.PART)
            ls.table = listing.LISTED.empty_table()
            while parts:
                part = pa.Table.from_batches([parts.pop(0)])
                if known.rows and ls.ds.caption_strategy == "sidecar":
                    part = sidecars.attach(part, known.around(part))
                needs = _needs_task(ls.ds, part)
                tasks.keep(ls.key, settling.settle_table(discoveries.where(part, pc.invert(needs)), ls.ds, seed))
                remote = discoveries.where(part, needs)
                del part, needs
                for i in range(0, remote.num_rows, _IMAGES_PER_TASK):
                    tasks.send(ls.key, remote.slice(i, _IMAGES_PER_TASK))
                del remote
        tasks.collect(list(tasks.running))
    except BaseException:
        for ref in tasks.running:  # a failed read fails discovery: nothing more of it is needed
            ray.cancel(ref)
        raise
    return tasks.settled, tasks.left_out


class _Tasks:
    """Settling tasks in flight, and every dataset's settled parts in listing order (a task's place is kept for
    it until it returns)."""

    def __init__(self, shared, listings: list, spool: sidecar_spool.Spool):
        import ray

        self.spool = spool
        self.settle = ray.remote(num_cpus=fit.PREPARE_CPUS)(_settle_block)
        self.shared = shared
        self.window = _window()
        self.running: dict = {}
        """Task -> (dataset key, its place in that dataset's parts)."""
        self.settled: dict[str, list] = {
            ls.key: [schemas.SETTLED.empty_table().select(schemas.GATHERED)] for ls in listings
        }
        self.left_out = {ls.key: 0 for ls in listings}

    def send(self, key: str, rows: pa.Table) -> None:
        import ray

        if len(self.running) >= self.window:  # wait for a quarter of the window: one wait per few tasks
            self.collect(ray.wait(list(self.running), num_returns=max(1, self.window // 4))[0])
        # combine_chunks: the task gets its own rows only, not the whole buffers the slice was cut from. Put, not
        # passed inline: Ray's task events keep each task's specification, inlined arguments included; in a plain
        # loop of 800 tasks with 36 KB of rows each, the driver kept 48 KB a task inlined and 11 KB put.
        rows = ray.put(rows.combine_chunks())
        self.running[self.settle.remote(rows, self.shared)] = (key, len(self.settled[key]))
        self.settled[key].append(None)

    def keep(self, key: str, settled: pa.Table, at: int | None = None) -> None:
        """Spool settled rows' caption files and keep the rest of their columns: at place ``at`` of the dataset's
        parts (a task's rows), or after the others (rows settled here)."""
        self.spool.add(settled)
        slim = settled.select(schemas.GATHERED)
        if at is None:
            self.settled[key].append(slim)
            return
        # A task's rows are a view of their serialized message, which holds more than these columns: keep a copy.
        self.settled[key][at] = slim.take(pa.array(range(slim.num_rows), pa.int32()))

    def collect(self, refs: list) -> None:
        import ray

        for ref in refs:
            key, at = self.running.pop(ref)
            block = ray.get(ref)
            for dataset, n in json.loads(block.schema.metadata[_LEFT_OUT]).items():
                self.left_out[dataset] += n
            self.keep(key, block.replace_schema_metadata(None), at)
        if refs:
            allocator.trim()  # the blocks' serialized copies, freed between the rows kept


def _window() -> int:
    """Settling tasks in flight at a time: enough to keep every CPU of the cluster busy, and to show the
    autoscaler a backlog to grow on, while the driver holds only that many tasks' rows at once."""
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 1))
    return max(16, 4 * int(cpus / fit.PREPARE_CPUS))
