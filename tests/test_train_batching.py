"""The batch plan: bucket-pure batches and the same whole number of optimizer steps on every rank."""

import json
import random

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rayflux.cache.layout import decode_planned
from rayflux.train import step
from rayflux.train.data import batching


def _refs(bucket_sizes: list[int]) -> list[batching.SampleRef]:
    return [
        batching.SampleRef(f"{b}-{i:03d}", f"{64 + 16 * b}x64", f"shard-{i % 3}.parquet", i)
        for b, n in enumerate(bucket_sizes)
        for i in range(n)
    ]


@settings(max_examples=60, deadline=None)
@given(
    bucket_sizes=st.lists(st.integers(1, 13), min_size=1, max_size=5),
    batch_size=st.integers(1, 4),
    world=st.integers(1, 4),
    accumulation=st.integers(1, 3),
    epoch=st.integers(0, 3),
)
def test_plan_is_bucket_pure_and_equal_per_rank(bucket_sizes, batch_size, world, accumulation, epoch):
    refs = _refs(bucket_sizes)
    bucket_of = {r.sample_id: r.bucket for r in refs}
    plan, dropped = batching.plan_epoch(refs, batch_size, 5, epoch, world, accumulation)

    assert len(plan) % (world * accumulation) == 0
    per_rank = [plan[r::world] for r in range(world)]
    assert len({len(p) for p in per_rank}) == 1  # every rank the same number of batches...
    assert len(per_rank[0]) % accumulation == 0  # ...forming whole optimizer steps
    ids = []
    for b in plan:
        members = [ref.sample_id for ref in decode_planned(b["refs"])]  # [file, row, sample_id, ...where its bytes are]
        assert {bucket_of[s] for s in members} == {b["bucket"]}  # one bucket per batch
        assert 1 <= len(members) == b["size"] <= batch_size
        ids.extend(members)
    assert len(ids) == len(set(ids))  # no sample twice in an epoch
    assert len(ids) + dropped == len(refs)
    all_batches = sum(-(-n // batch_size) for n in bucket_sizes)
    assert all_batches - len(plan) < world * accumulation  # only the remainder is dropped


def test_plan_ignores_listing_order_and_seeds_noise_per_batch():
    refs = _refs([7, 5, 1, 1])
    shuffled = refs[:]
    random.Random(3).shuffle(shuffled)
    a, _ = batching.plan_epoch(refs, 2, 11, 1, 2, 2)
    b, _ = batching.plan_epoch(shuffled, 2, 11, 1, 2, 2)
    assert a == b
    assert len({x["seed"] for x in a}) == len(a)
    other_epoch, _ = batching.plan_epoch(refs, 2, 11, 2, 2, 2)
    assert [x["refs"] for x in other_epoch] != [x["refs"] for x in a]


def test_uneven_buckets_example():
    """The Ray test's layout: buckets of 7, 5, 1 and 1 samples, batches of 2, 2 workers, 2 batches per step."""
    plan, dropped = batching.plan_epoch(_refs([7, 5, 1, 1]), 2, 0, 0, 2, 2)
    # 4 + 3 + 1 + 1 = 9 batches; 8 kept (2 optimizer steps of 2 batches on each of 2 ranks); 1 batch dropped.
    assert len(plan) == 8
    assert dropped in (1, 2)


def test_stacked_row_round_trips_to_tensors():
    lat = [np.full((4, 6, 10), i, np.float32) for i in range(2)]
    t5 = [np.full((7, 3), 10 + i, np.float32) for i in range(2)]
    clip = [np.full((3,), 20 + i, np.float32) for i in range(2)]
    plan = {"epoch": 1, "index": 4, "seed": 99, "step": 3, "total_steps": 8, "bucket": "80x48"}
    row = batching.stack_batch(plan, 2, ["a", "b"], {"latent": lat}, {"t5": t5, "clip_pooled": clip})
    batch = step.from_item(row)
    assert batch.seed == 99 and row["size"] == 2 and json.loads(row["sample_ids"]) == ["a", "b"]
    assert (row["step"], row["total_steps"], row["generation"]) == (3, 8, 2)
    assert batch.latents.shape == (2, 4, 6, 10) and torch.equal(batch.latents[1], torch.ones(4, 6, 10))
    assert batch.text["t5"].shape == (2, 7, 3) and float(batch.text["t5"][1, 0, 0]) == 11
    assert batch.text["clip_pooled"].shape == (2, 3) and float(batch.text["clip_pooled"][0, 0]) == 20


@settings(max_examples=60, deadline=None)
@given(
    unique=st.integers(2, 12),
    repeats=st.integers(2, 4),
    batch_size=st.integers(2, 4),
    epoch=st.integers(0, 5),
)
def test_repeats_are_spread_so_no_batch_holds_a_sample_twice(unique, repeats, batch_size, epoch):
    """kohya's and SimpleTuner's repeats mean more variety per epoch, not copies inside one batch."""
    refs = [r for r in _refs([unique]) for _ in range(repeats)]  # as rayflux.datasets.mix repeats them
    plan, dropped = batching.plan_epoch(refs, batch_size, 7, epoch, world_size=1)
    batches = [[ref.sample_id for ref in decode_planned(b["refs"])] for b in plan]
    assert sorted(s for b in batches for s in b) == sorted(r.sample_id for r in refs) and dropped == 0
    if repeats <= len(batches) - 1:  # enough batches to keep the copies apart
        assert all(len(set(b)) == len(b) for b in batches), batches
    assert [b["size"] for b in plan].count(batch_size) >= len(plan) - 1  # full batches, one short at most


def test_read_run_one_is_a_per_sample_shuffle_of_the_sample_ids():
    refs = _refs([9])
    plan, _ = batching.plan_epoch(refs, 4, 3, 0, world_size=1, shuffle_block=1)
    members = sorted(refs, key=lambda r: r.sample_id)  # not storage order: shard names differ per build
    batching._rng(3, 0, refs[0].bucket).shuffle(members)
    cut = [[r.sample_id for r in members[i : i + 4]] for i in range(0, 9, 4)]
    assert sorted([ref.sample_id for ref in decode_planned(b["refs"])] for b in plan) == sorted(cut)
