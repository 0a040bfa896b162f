"""The training data feed: a Ray Train ``DataConfig`` that shards by the batch plan instead of streaming order.

Ray Train calls :meth:`PlannedDataConfig.configure` whenever it (re)starts the worker group, with the real world
size (elastic runs included). It plans every epoch for that world size (see :mod:`rayflux.train.data.batching`) and gives
rank ``r`` the planned batches ``r, r + W, r + 2W, ...`` as an ordered Ray Data pipeline that reads and stacks the
rows of each batch. Workers still call ``ray.train.get_dataset_shard("train")``, once the committed generation has
been handed to them (:mod:`rayflux.train.handoff`): its samples and the feed plan reach ``configure`` through the
same handoff, since Ray Train's datasets are fixed when the group starts, which may be before the cache commits.

Why not Ray's default ``streaming_split``: it hands blocks to whichever worker asks first, so the batch a rank sees
at step ``s`` differs from run to run. With a plan, each epoch's optimizer step ``s`` (from 0) always trains its
planned batches ``sWA .. (s + 1)WA - 1`` (``A`` batches accumulated per rank), a resumed run replays exactly what an
uninterrupted one would, and per-epoch sample counts are exact.

A (re)started worker group resumes from the newest committed checkpoint in storage (:mod:`rayflux.train.resume.commits`).
``configure`` reads that checkpoint's small position record and cuts the plan there before anything is read
(:func:`rayflux.train.data.elastic.plan_rows`); every row names the checkpoint (``resume_from``), so the loop restores
the very checkpoint the plan was cut for.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator

from ray.train import DataConfig

from rayflux.train.data import batching, elastic
from rayflux.train.resume import commits
from rayflux.train.plan import FeedPlan

DATASET = "train"


class PlannedDataConfig(DataConfig):
    """Plan-based sharding for the ``train`` dataset, whose rows are :class:`batching.SampleRef` fields, by the
    trainer run's :class:`~rayflux.train.plan.FeedPlan` (its epochs, the whole run's epochs so every row knows the
    global optimizer step it trains at, and the run's storage, where the checkpoints to resume from are)."""

    def __init__(self, feed: FeedPlan | None = None, handoff=None):
        super().__init__(datasets_to_split=[])
        self.feed, self.handoff = feed, handoff

    def _planned(self, datasets) -> tuple[list, FeedPlan]:
        """The samples and the feed plan: from the run's handoff (:mod:`rayflux.train.handoff`, which the workers
        asking for their shards have already received), else from the ``train`` dataset and this config's plan."""
        import ray

        if self.handoff is None:
            return [batching.SampleRef(**row) for row in datasets[DATASET].take_all()], self.feed
        from rayflux.train import handoff

        gen = handoff.receive(self.handoff)
        if gen is None:  # a worker asks for its shard only once the generation was handed over
            raise RuntimeError("the training run was cancelled before its generation was committed")
        return list(ray.get(gen.refs)), gen.plan.feed

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        import ray.data
        from ray.data import TaskPoolStrategy

        refs, feed = self._planned(datasets)
        run_storage = feed.run_storage
        resume_from = commits.latest(run_storage) if run_storage else ""
        position = commits.read_json(resume_from) if resume_from else None
        per_rank = elastic.plan_rows(refs, feed, world_size, position)
        per_rank = [[{**row, "resume_from": resume_from} for row in mine] for mine in per_rank]
        output = []
        for mine in per_rank:
            # One read task per `batches_per_read` consecutive planned batches: fewer, larger tasks cost the
            # consuming worker less scheduling per step (its executor runs beside the training step).
            reads = max(1, min(-(-len(mine) // feed.batches_per_read), 1000))
            ds = ray.data.from_items(mine, override_num_blocks=reads)
            ds = ds.map_batches(
                _load_batches,
                batch_size=None,
                batch_format="pyarrow",
                num_cpus=feed.read_cpus,
                # Never more than the rank has reads: Ray Data warns on a cap its inputs cannot reach.
                compute=TaskPoolStrategy(size=min(feed.reads_in_flight, reads)),
            )
            options = copy.deepcopy(ds.context.execution_options)
            options.preserve_order = True  # a rank's batches arrive in plan order
            ds.context.execution_options = options
            ds.context.enable_progress_bars = False  # the training bar (rayflux.progress) is the stage's one line
            output.append({DATASET: ds.iterator()})
        return output


def _load_batches(block):
    """Ray Data ``map_batches`` over a block of planned batches: one stacked training row per planned batch."""
    import pyarrow as pa

    # Where the run resumed from rides along with every batch (see PlannedDataConfig.configure).
    resume = ("resume_step", "resume_from")
    items = block.to_pylist()
    rows = batching.load_batches(items)
    return pa.Table.from_pylist([{**row, **{k: item[k] for k in resume}} for row, item in zip(rows, items)])


def index_dataset(refs: list[batching.SampleRef]):
    """The small ``train`` dataset handed to ``TorchTrainer``: one row per cached sample, no tensors."""
    import dataclasses

    import ray.data

    return ray.data.from_items([dataclasses.asdict(r) for r in refs])


def handoff_dataset():
    """The ``train`` dataset handed to ``TorchTrainer`` when the samples come through the run's handoff: Ray Train
    gives a worker a shard only of a dataset it was given, and ``configure`` never reads this one's row."""
    import ray.data

    return ray.data.from_items([{"samples": "from the handoff"}])


def planned_rows(shard, prefetch_reads: int):
    """Iterate a rank's shard one planned batch (one row) at a time, keeping ``prefetch_reads`` reads ahead.

    ``iter_rows`` always reads one block ahead; ``iter_batches(batch_size=None)`` yields whole blocks (each the rows
    of one read task's planned batches, in plan order) and takes the read-ahead depth, so the Parquet reads of the
    next batches overlap the current step.
    """
    for block in shard.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=prefetch_reads):
        yield from block.to_pylist()


class FirstRow:
    """A rank's first planned batch, read by a thread of its own from the moment this is made.

    The feed's start is seconds of waiting on other processes: Ray Data's executor and its helper actors, a read
    worker, the first Parquet reads. Reading the first batch here lets the worker load the model meanwhile instead of
    one after the other (the model load needs only the run's planned step count from that batch, and only for the
    LR schedule). The caller's thread takes every later row from the same iterator, after :meth:`get`.
    """

    def __init__(self, rows: Iterator[dict], on_read: Callable[[], None] | None = None):
        self._rows, self._on_read = rows, on_read
        self._out: dict = {}
        self._thread = threading.Thread(target=self._read, name="rayflux-first-read", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            self._out["row"] = next(self._rows, None)
            if self._on_read:
                self._on_read()
        except BaseException as exc:  # raised in the caller's thread by get()
            self._out["error"] = exc

    def get(self) -> dict | None:
        """The first row (None when the rank's plan is empty), once read; the read's error, raised here."""
        self._thread.join()
        if "error" in self._out:
            raise self._out["error"]
        return self._out["row"]
