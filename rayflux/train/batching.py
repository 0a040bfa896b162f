"""Bucket-pure batches with equal steps on every rank.

The driver plans every batch of an epoch before training: one bucket per batch, a shuffle seeded per
(seed, epoch, bucket) over the bucket's *sorted* sample ids, then a seeded shuffle of the batch order. Every
process that computes the plan gets the same answer, regardless of listing order.

Remainder rule (the same on every rank): a bucket's last batch may be smaller than ``batch_size``; then the
epoch's batch count is cut down to a multiple of ``world_size * accumulation`` by dropping batches from the *end*
of the shuffled order. Each rank then gets exactly ``len(plan) / world_size`` batches, a whole number of optimizer
steps of ``accumulation`` batches each, so every rank runs the same number of optimizer steps and DDP never waits on
a rank that ran out; an optimizer step never straddles two epochs. The dropped samples are counted in the epoch's
metrics; the shuffle differs per epoch, so the dropped samples usually differ too.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

import numpy as np

from rayflux import storage
from rayflux.cache import shards, tensors


@dataclass(frozen=True)
class SampleRef:
    """Where one cached sample lives: its shard and row (row group) number."""

    sample_id: str
    bucket: str
    file: str
    row: int
    dataset: str = ""
    """The shards' ``dataset`` column; decides repeats and loss weight (see :func:`rayflux.datasets.mix`)."""
    weight: float = 1.0
    """Loss weight of this sample (regularisation datasets use ``data.reg_loss_weight``)."""


def _rng(*parts) -> random.Random:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def index_samples(files: list[str]) -> list[SampleRef]:
    """Every sample of a generation's shards, read from the id and bucket columns only."""
    refs = []
    for f in files:
        t = shards.read_column(f, ["sample_id", "bucket", "dataset"])
        columns = zip(t["sample_id"].to_pylist(), t["bucket"].to_pylist(), t["dataset"].to_pylist())
        for i, (sid, b, d) in enumerate(columns):
            refs.append(SampleRef(sid, b, f, i, d))
    return refs


def _fill(members: list[SampleRef], batch_size: int) -> list[list[SampleRef]]:
    """Cut a bucket's shuffled samples into batches of ``batch_size`` (the last one may be short).

    Repeated samples (``repeats``) are spread so that a batch holds each sample once whenever the bucket has enough
    batches: the copies of a sample are dealt to consecutive batches, one each, largest groups first, instead of
    landing wherever the shuffle put them. Without repeats the batches are the shuffled order cut in runs.
    """
    n = len(members)
    if len({r.sample_id for r in members}) == n:
        return [members[i : i + batch_size] for i in range(0, n, batch_size)]
    groups: dict[str, list[SampleRef]] = {}
    for r in members:  # first appearance in the shuffle orders the groups
        groups.setdefault(r.sample_id, []).append(r)
    dealt = [r for g in groups.values() for r in g]
    sizes = [min(batch_size, n - i) for i in range(0, n, batch_size)]
    slots = [b for k in range(batch_size) for b in range(len(sizes)) if k < sizes[b]]  # slot k of every batch, then k+1
    batches: list[list[SampleRef]] = [[] for _ in sizes]
    for r, b in zip(dealt, slots):
        batches[b].append(r)
    return batches


def plan_epoch(
    refs: list[SampleRef], batch_size: int, seed: int, epoch: int, world_size: int, accumulation: int = 1
) -> tuple[list[dict], int]:
    """Plan one epoch. Returns (batches, dropped_samples); each batch is a dict ready for ``ray.data.from_items``.

    Each batch carries its own noise ``seed``, so its noise and σ do not depend on which rank trains it.
    """
    by_bucket: dict[str, list[SampleRef]] = {}
    for r in refs:
        by_bucket.setdefault(r.bucket, []).append(r)
    batches: list[list[SampleRef]] = []
    for bucket in sorted(by_bucket):
        members = sorted(by_bucket[bucket], key=lambda r: r.sample_id)
        _rng(seed, epoch, bucket).shuffle(members)
        batches.extend(_fill(members, batch_size))
    _rng(seed, epoch, "order").shuffle(batches)
    keep = len(batches) - len(batches) % (world_size * accumulation)
    dropped = sum(len(b) for b in batches[keep:])
    planned = [
        {
            "epoch": epoch,
            "index": i,
            "seed": _rng(seed, epoch, "batch", i).getrandbits(62),
            "bucket": b[0].bucket,
            "size": len(b),
            "refs": json.dumps([[r.file, r.row, r.sample_id] for r in b]),
            "weights": json.dumps([r.weight for r in b]),
        }
        for i, b in enumerate(batches[:keep])
    ]
    return planned, dropped


class GenerationNotReadable(RuntimeError):
    """A reader reached a generation that is not committed, or already retired: a stage-ordering bug, never data."""


def check_readable(shard_path: str) -> None:
    """Refuse to read a shard whose generation has no committed manifest or has been retired."""
    from rayflux.cache import generations

    gen_dir = shard_path.rsplit("/", 2)[0]  # <gen_dir>/samples/<file>
    if generations.is_retired(gen_dir) or not storage.exists(storage.join(gen_dir, generations.MANIFEST)):
        raise GenerationNotReadable(f"{shard_path}: generation {gen_dir} is not committed or has been retired")


def load_batch(item: dict) -> dict:
    """Ray Data ``map``: read one planned batch's rows and stack them; a shape mismatch is a CacheShapeError."""
    refs = json.loads(item["refs"])
    by_file: dict[str, list[int]] = {}
    for f, row, _ in refs:
        by_file.setdefault(f, []).append(row)
    for f in by_file:
        check_readable(f)
    # Rows are read file by file (a repeated sample once per ask): order the refs' loss weights the same way.
    ref_weights = json.loads(item["weights"]) if "weights" in item else [1.0] * len(refs)
    weights = [w for f in by_file for (ref_f, _, _), w in zip(refs, ref_weights) if ref_f == f]
    cols = ["sample_id", "source_uri", "bucket", "generation", "latent", "latent_c", "latent_h", "latent_w", "latent_dtype",
            "t5", "t5_len", "t5_dim", "clip_pooled", "clip_dim", "text_dtype"]  # fmt: skip
    rows = shards.read_batch(by_file, item["bucket"], cols)  # every row checked against the bucket's shape
    first = rows[0]
    lat_shape = (first["latent_c"], first["latent_h"], first["latent_w"])
    t5_shape = (first["t5_len"], first["t5_dim"])
    lat, t5, clip = [], [], []
    for r in rows:
        lat.append(tensors.from_bytes_numpy(r["latent"], r["latent_dtype"], lat_shape))
        t5.append(tensors.from_bytes_numpy(r["t5"], r["text_dtype"], t5_shape))
        clip.append(tensors.from_bytes_numpy(r["clip_pooled"], r["text_dtype"], (r["clip_dim"],)))
    return stack_batch(item, int(first["generation"]), [r["sample_id"] for r in rows], lat, t5, clip, weights)


def stack_batch(
    item: dict, generation: int, sample_ids: list[str], latents: list, t5: list, clip: list, weights: list | None = None
) -> dict:
    """One training row: the plan fields of ``item``, the cache generation, the stacked float32 tensors, and each
    sample's loss weight."""
    lat, t5, clip = (np.stack([np.asarray(x, np.float32) for x in xs]) for xs in (latents, t5, clip))
    return {
        "epoch": item["epoch"],
        "index": item["index"],
        "seed": item["seed"],
        "step": item["step"],
        "total_steps": item["total_steps"],
        "generation": generation,
        "bucket": item["bucket"],
        "size": len(sample_ids),
        "sample_ids": json.dumps(sample_ids),
        "latent": lat.tobytes(),
        "latent_shape": json.dumps(list(lat.shape)),
        "t5": t5.tobytes(),
        "t5_shape": json.dumps(list(t5.shape)),
        "clip": clip.tobytes(),
        "clip_dim": int(clip.shape[1]),
        "weights": json.dumps(weights or [1.0] * len(sample_ids)),
    }
