"""The training plan: everything the driver decides before it launches a trainer run, built once (:func:`build`)
and handed whole to the launch (:mod:`rayflux.train.stage`) and to the workers (their :class:`LoopConfig`).

What it holds, in the order it is made: the cached samples mixed by the datasets' weights (``refs``); the held-out
split and its eval plan; the per-epoch counts and optimizer steps for the largest world size; the feed's planning
parameters (:class:`FeedPlan`) with the run's checkpoint storage.

The feed still cuts each epoch's batches for the world size in force whenever Ray Train (re)starts the worker group
(:func:`rayflux.train.data.elastic.plan_rows`): an elastic run's world size is known only then. That cut is a pure function
of this plan, the world size and the checkpoint's position, so every restart cuts the same plan.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from dataclasses import dataclass, field

from rayflux import datasets, models, preservation, storage
from rayflux.cache.manifest import Manifest
from rayflux.config import JobConfig, worker_range
from rayflux.train.data import batching
from rayflux.train.resume import commits

log = logging.getLogger(__name__)

EVAL_FILE = "eval_samples.txt"
"""In the output directory: the source path of every held-out sample, one a line."""


@dataclass(frozen=True)
class FeedPlan:
    """What the data feed plans a trainer run's epochs from (:class:`rayflux.train.data.feed.PlannedDataConfig`)."""

    batch_size: int
    """``train.batch_size``: samples per planned batch."""
    seed: int
    """``train.seed``: each epoch's shuffle and every batch's noise seed."""
    epochs: tuple[int, int]
    """The half-open range of epochs this trainer run covers (one refresh segment)."""
    total_epochs: int
    """``train.epochs``: the whole run, so every row knows its global optimizer step and the run's total."""
    accumulation: int = 1
    """``train.gradient_accumulation``: planned batches per optimizer step on each rank."""
    shuffle_block: int = 4
    """``train.feed.shuffle_block``: storage neighbours read together (:mod:`rayflux.train.data.runs`)."""
    batches_per_read: int = 8
    """``train.feed.batches_per_read``: consecutive planned batches per read task."""
    read_cpus: float = 0.25
    """CPUs each read task reserves."""
    reads_in_flight: int = 3
    """Read tasks a rank's feed runs at once: ``train.feed.prefetch_reads`` plus the one its step is taking rows
    from. More would only hold more batches in the object store than the prefetch asks for, and start a process of
    their own each (Ray Data's task runner imports for a second or more of CPU in each) where none is idle yet, as
    on a run's first read."""
    run_storage: str = ""
    """Ray Train's storage of this run (:func:`rayflux.train.resume.commits.run_storage`): the checkpoints a (re)started
    worker group resumes from, and the commits."""


@dataclass(frozen=True)
class TrainPlan:
    """One trainer run's plan (see the module's docstring)."""

    feed: FeedPlan
    refs: tuple = ()
    """The training samples (:class:`rayflux.train.data.batching.SampleRef`), mixed by dataset weight, held-out samples
    removed. Empty in the workers' copy (:meth:`for_workers`): they reach the feed as its index dataset."""
    eval_plan: tuple = ()
    """The held-out samples' planned batches (small: ``data.eval_samples`` samples)."""
    eval_file: str = ""
    """Where the held-out samples' source paths are listed ("" without eval)."""
    world_size: int = 1
    """The largest world size (``train.workers.num_workers``'s maximum): what the counts and the bar plan for."""
    counts: dict = field(default_factory=dict)
    """Epoch -> samples, dropped samples and batches of that epoch's plan for ``world_size``."""
    max_steps: int = 0
    """``train.max_steps``: the run's cap on optimizer steps (0: none)."""

    @property
    def steps_per_epoch(self) -> list[int]:
        """Optimizer steps per worker in each epoch of the run: each trains ``accumulation`` batches on every worker,
        and the remainder rule makes an epoch's batches a multiple of ``world_size * accumulation``."""
        per_step = self.world_size * self.feed.accumulation
        return [self.counts[e]["batches"] // per_step for e in sorted(self.counts)]

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole run, every segment: the planned epochs' steps, capped by ``max_steps``, as the
        loop counts them (:func:`rayflux.train.optim.total_steps`, the LR schedule's horizon)."""
        from rayflux.train.optim import total_steps  # its module brings torch: not at import

        return total_steps(sum(self.steps_per_epoch), self.max_steps)

    def for_workers(self) -> TrainPlan:
        """This plan without its sample list, for the workers' loop config (the feed hands them their samples)."""
        return dataclasses.replace(self, refs=())

    def log(self) -> None:
        """One line: the epochs, workers and optimizer steps this trainer run plans, and what the remainder rule
        drops."""
        first, end = self.feed.epochs
        dropped = [self.counts[e]["dropped"] for e in range(first, end)]
        log.info(
            "train: epochs %d-%d on %d worker(s), %d planned steps per worker; the remainder rule drops %s samples "
            "per epoch",
            first + 1,
            end,
            self.world_size,
            sum(self.steps_per_epoch[first:end]),
            dropped[0] if len(set(dropped)) == 1 else "/".join(map(str, dropped)),
        )


def build(cfg: JobConfig, manifest: Manifest, output_dir: str, epochs: tuple[int, int] | None = None) -> TrainPlan:
    """The plan of the trainer run that trains epochs ``[first, end)`` (default: all) on ``manifest``'s generation.
    Writes the held-out samples' list (:data:`EVAL_FILE`) into ``output_dir``."""
    t = cfg.train
    refs = datasets.mix(
        batching.index_samples(manifest, preservation.words(cfg)),  # issue 45: output preservation's prompts
        datasets.sample_weights(cfg.data),
        datasets.mask_floors(cfg.data),
    )
    batching.check_references(refs, models.family(cfg.model))
    refs, eval_plan, eval_file = held_out(cfg, refs, output_dir)
    _, hi = worker_range(t.workers.num_workers)
    feed = feed_plan(cfg, output_dir, epochs)
    counts = plan_counts(feed, refs, hi)
    if counts[0]["batches"] == 0:
        raise RuntimeError(
            f"no full set of batches for {hi} workers: {manifest.cached} samples, batch_size {t.batch_size}"
        )
    return TrainPlan(
        feed=feed,
        refs=tuple(refs),
        eval_plan=tuple(eval_plan),
        eval_file=eval_file,
        world_size=hi,
        counts=counts,
        max_steps=t.max_steps,
    )


def feed_plan(cfg: JobConfig, output_dir: str, epochs: tuple[int, int] | None = None) -> FeedPlan:
    """The feed's part of the plan, from the config: epochs ``[first, end)`` (default: all)."""
    t = cfg.train
    return FeedPlan(
        batch_size=t.batch_size,
        seed=t.seed,
        epochs=tuple(epochs or (0, t.epochs)),
        total_epochs=t.epochs,
        accumulation=t.gradient_accumulation,
        shuffle_block=t.feed.shuffle_block,
        batches_per_read=t.feed.batches_per_read,
        reads_in_flight=t.feed.prefetch_reads + 1,
        run_storage=commits.run_storage(output_dir, cfg.run.name),
    )


def held_out(cfg: JobConfig, refs: list[batching.SampleRef], output_dir: str) -> tuple[list, list[dict], str]:
    """``(training refs, eval plan, eval file)``: hold out ``data.eval_samples`` samples (by sample id hash with
    ``cache.seed``; see :func:`rayflux.train.data.batching.split_held_out`) and list their sources in ``EVAL_FILE``."""
    n = cfg.data.eval_samples
    if n <= 0:
        return refs, [], ""
    train_refs, held = batching.split_held_out(refs, n, cfg.cache.seed)
    if len(held) < n:
        raise ValueError(f"data.eval_samples={n}, but the cache holds only {len(held)} samples")
    path = storage.join(output_dir, EVAL_FILE)
    storage.write_bytes_atomic(path, "".join(f"{r.source}\n" for r in held).encode())
    log.info("eval: %d samples held out of training (listed in %s)", len(held), path)
    return train_refs, batching.plan_eval(held, cfg.train.batch_size), path


def plan_counts(feed: FeedPlan, refs: list[batching.SampleRef], world_size: int) -> dict:
    """Per-epoch sample accounting for a world size: what the data feed's plan holds, from bucket sizes alone."""
    sizes = collections.Counter(batching.group(r) for r in refs)
    return {
        epoch: batching.epoch_counts(sizes, feed.batch_size, feed.seed, epoch, world_size, feed.accumulation)
        for epoch in range(feed.total_epochs)
    }
