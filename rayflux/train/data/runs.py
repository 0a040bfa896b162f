"""Read runs: a bucket's batches filled with short runs of neighbouring rows, so that a run's latents are one read.

Training reads each latent by byte range (:mod:`rayflux.cache.reads`), and ranges of one file that lie close together
share one GET. A per-sample shuffle scatters a batch over the cache, so every sample costs its own GET. Here a
bucket's samples are taken in storage order (each file's rows in row order: a shard keeps each bucket's rows together,
see :mod:`rayflux.cache.writer`), cut into runs of at most ``k`` consecutive rows of one file, and the *runs* (listed by
their first sample id, never by shard name: :func:`cut_runs`) are shuffled (seeded per seed, epoch and bucket by the
caller); batches are cut from the shuffled runs. A run's latents are then one GET: ``1/k`` latent requests per
sample. This is the block shuffle of MosaicML Streaming and WebDataset at its smallest: what it trades is batch
diversity (a batch of ``B`` holds ``B/k`` runs of storage neighbours, which are often images that were listed
together) against requests. ``k = 1`` is a plain per-sample shuffle.

Repeats (``datasets.mix`` lists a repeated sample once per copy): runs are cut from the distinct samples, never
mixing samples with different copy counts, and the copies of one run are dealt to consecutive batches, a run-sized
chunk of each batch at a time (chunk 0 of every batch, then chunk 1, ...), so a batch holds a sample once when the
bucket has at least as many batches as copies. Where short runs or a short last batch would break that, the bucket
falls back to dealing single samples the same way (:func:`deal_samples`), which always keeps copies apart.
"""

from __future__ import annotations

import random
from typing import TypeVar

T = TypeVar("T")


def cut_runs(refs: list, k: int) -> list[list]:
    """Distinct ``refs`` (each with ``file``, ``row``, ``sample_id``) cut into runs of at most ``k`` consecutive rows
    of one file (each file's rows in row order), the runs ordered by their first sample id.

    Not by file name: two builds of the same images lay the samples out alike but name their shards apart (a name
    carries its build's id and a random part, :func:`rayflux.cache.shards.new_shard_name`), so runs in file-name order
    gave the seeded shuffle a different list, and a rebuilt cache (a clean run against one through S3 faults, say)
    different batches, losses and LoRA. Sample ids are the same in every build; listing order never mattered."""
    by_file: dict[str, list] = {}
    for r in refs:
        by_file.setdefault(r.file, []).append(r)
    runs: list[list] = []
    for rows in by_file.values():
        rows.sort(key=lambda r: (r.row, r.sample_id))
        runs.extend(rows[i : i + k] for i in range(0, len(rows), k))
    return sorted(runs, key=lambda run: run[0].sample_id)


def batch_sizes(n: int, batch_size: int) -> list[int]:
    """Batches of ``batch_size`` and one short one for the remainder (what :func:`rayflux.train.data.batching.epoch_counts`
    counts from bucket sizes alone)."""
    return [min(batch_size, n - i) for i in range(0, n, batch_size)]


def _chunk_slots(sizes: list[int], k: int) -> list[int]:
    """For each position of the dealing order, the batch it falls in: chunk ``j`` (positions ``jk .. jk + k - 1``) of
    every batch that has it, then chunk ``j + 1``. With ``k = 1`` this is slot 0 of every batch, then slot 1."""
    slots = []
    for j in range(0, max(sizes, default=0), k):
        for b, size in enumerate(sizes):
            slots.extend([b] * max(0, min(size, j + k) - j))
    return slots


def _deal(items: list[T], sizes: list[int], k: int) -> list[list[T]]:
    batches: list[list[T]] = [[] for _ in sizes]
    for item, b in zip(items, _chunk_slots(sizes, k)):
        batches[b].append(item)
    return batches


def deal_samples(copies: list[list[T]], sizes: list[int]) -> list[list[T]]:
    """Each sample's copies (``copies``: one list per sample) dealt to consecutive batches, slot 0 of every batch
    first: copies land in distinct batches whenever a sample has no more copies than there are batches."""
    return _deal([c for group in copies for c in group], sizes, 1)


def fill(members: list, batch_size: int, k: int, rng: random.Random) -> list[list]:
    """One bucket's batches from its ``members`` (a repeated sample appears once per copy): runs of at most ``k``
    storage neighbours, shuffled with ``rng``, cut into batches of ``batch_size`` (the last may be short)."""
    copies: dict[str, list] = {}
    for r in members:
        copies.setdefault(r.sample_id, []).append(r)
    sizes = batch_sizes(len(members), batch_size)
    if all(len(c) == 1 for c in copies.values()):
        runs = cut_runs(members, k)
        rng.shuffle(runs)
        flat = [r for run in runs for r in run]
        return [flat[i : i + batch_size] for i in range(0, len(flat), batch_size)]
    # Runs never mix copy counts, so all copies of a run are the same run: each copy fills one chunk of a batch.
    by_count: dict[int, list] = {}
    for c in copies.values():
        by_count.setdefault(len(c), []).append(c[0])
    runs = [run for n in sorted(by_count) for run in cut_runs(by_count[n], k)]
    rng.shuffle(runs)
    runs.sort(key=lambda run: len(run) < k)  # full runs first: a short one shifts the chunks after it
    units = [copies[r.sample_id][i] for run in runs for i in range(len(copies[run[0].sample_id])) for r in run]
    batches = _deal(units, sizes, k)
    if len(batches) >= max(len(c) for c in copies.values()) and any(
        len({r.sample_id for r in b}) < len(b) for b in batches
    ):
        order = [copies[r.sample_id] for run in runs for r in run]
        batches = deal_samples(order, sizes)
    return batches
