"""Read runs: batches filled with shuffled runs of storage neighbours (rayflux.train.data.runs), as plan_epoch plans them."""

import dataclasses
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from rayflux.cache.layout import decode_planned
from rayflux.train.data import batching, runs


def _refs(per_file: list[int], bucket: str = "64x64", every: int = 1) -> list[batching.SampleRef]:
    """``per_file[f]`` rows of one bucket in file f; with ``every`` > 1 the bucket has every ``every``-th row."""
    return [
        batching.SampleRef(f"{bucket}-{f}-{i}", bucket, f"shard-{f}.parquet", i * every)
        for f, n in enumerate(per_file)
        for i in range(n)
    ]


def _batches(plan) -> list[list[tuple[str, int]]]:
    return [[(ref.file, ref.row) for ref in decode_planned(b["refs"])] for b in plan]  # (file, row)


def _pieces(batch: list[tuple[str, int]], rows_of: dict) -> int:
    """How many reads a batch's latents take: maximal stretches of consecutive rows (of its bucket) of one file."""
    pieces, prev = 0, None
    for file, row in sorted(batch):
        if prev is None or prev[0] != file or rows_of[file].index(row) != rows_of[file].index(prev[1]) + 1:
            pieces += 1
        prev = (file, row)
    return pieces


@settings(max_examples=60, deadline=None)
@given(
    per_file=st.lists(st.integers(1, 20), min_size=1, max_size=4),
    batch_size=st.integers(1, 8),
    k=st.integers(1, 6),
    epoch=st.integers(0, 3),
    every=st.integers(1, 3),
)
def test_runs_are_storage_neighbours_and_every_sample_is_trained_once(per_file, batch_size, k, epoch, every):
    refs = _refs(per_file, every=every)
    plan, dropped = batching.plan_epoch(refs, batch_size, 5, epoch, world_size=1, shuffle_block=k)
    assert dropped == 0
    batches = _batches(plan)
    trained = [s for b in batches for s in b]
    assert sorted(trained) == sorted((r.file, r.row) for r in refs)  # every sample exactly once
    assert [len(b) for b in batches].count(batch_size) >= len(batches) - 1  # full batches, one short at most
    # Before the batch order is shuffled, the bucket's batches are a shuffle of its storage order cut into runs of
    # k rows of one file: each run stays together, in row order.
    filled = runs.fill(refs, batch_size, k, random.Random(epoch))
    flat = [(r.file, r.row) for b in filled for r in b]
    ordered = sorted((r.file, r.row) for r in refs)
    expected = [
        [x for x in ordered if x[0] == f][i : i + k]
        for f in sorted({x[0] for x in ordered})
        for i in range(0, sum(x[0] == f for x in ordered), k)
    ]
    starts = sorted(flat.index(run[0]) for run in expected)
    assert sorted(tuple(flat[a:b]) for a, b in zip(starts, starts[1:] + [len(flat)])) == sorted(map(tuple, expected))
    rows_of = {f: sorted(x[1] for x in ordered if x[0] == f) for f in {x[0] for x in ordered}}
    # So the epoch's latents take one read per run, plus one for each run that a batch boundary cuts.
    assert sum(_pieces(b, rows_of) for b in batches) <= len(expected) + len(batches) - 1


def test_the_plan_is_identical_across_calls_and_listing_orders_and_differs_per_epoch():
    refs = _refs([40, 25]) + _refs([17], bucket="80x48")
    shuffled = refs[:]
    random.Random(1).shuffle(shuffled)
    a, _ = batching.plan_epoch(refs, 8, 11, 1, 2, 2, shuffle_block=4)
    assert a == batching.plan_epoch(shuffled, 8, 11, 1, 2, 2, shuffle_block=4)[0]
    other = batching.plan_epoch(refs, 8, 11, 2, 2, 2, shuffle_block=4)[0]
    assert [x["refs"] for x in other] != [x["refs"] for x in a]


def test_the_plan_does_not_depend_on_the_names_a_build_gave_its_shards():
    """Two builds of the same images lay the samples out alike, but each names its shards with its own build id and
    a random part: the plan (which samples each batch trains, in which order) must be the same for both, or a rebuilt
    cache (a clean run against one through S3 faults) trains different batches and another LoRA."""
    refs = _refs([40, 25, 31]) + _refs([17, 9], bucket="80x48")
    # The second build's names sort the other way round.
    renamed = {f: f"samples-{9 - int(f.split('-')[1][0])}-{f}" for f in {r.file for r in refs}}
    rebuilt = [dataclasses.replace(r, file=renamed[r.file]) for r in refs]
    for k in (1, 4):
        a = batching.plan_epoch(refs, 8, 11, 1, 2, 2, shuffle_block=k)[0]
        b = batching.plan_epoch(rebuilt, 8, 11, 1, 2, 2, shuffle_block=k)[0]
        assert [[r.sample_id for r in decode_planned(x["refs"])] for x in a] == [
            [r.sample_id for r in decode_planned(x["refs"])] for x in b
        ]


def test_runs_shuffle_which_neighbours_share_a_batch():
    """Runs are shuffled as whole runs: two epochs cut the same runs but put them in different batches."""
    refs = _refs([64])
    first = _batches(batching.plan_epoch(refs, 8, 0, 0, 1, shuffle_block=4)[0])
    second = _batches(batching.plan_epoch(refs, 8, 0, 1, 1, shuffle_block=4)[0])
    assert sorted(map(sorted, first)) != sorted(map(sorted, second))
    for batches in (first, second):
        for b in batches:  # 8 samples = two runs of 4 consecutive rows
            rows = sorted(row for _, row in b)
            assert len({row // 4 for row in rows}) == 2 and all(rows.count(r) == 1 for r in rows)


@settings(max_examples=80, deadline=None)
@given(
    plain=st.integers(0, 30),
    repeated=st.integers(1, 12),
    repeats=st.integers(2, 4),
    batch_size=st.integers(2, 8),
    k=st.integers(1, 5),
    epoch=st.integers(0, 3),
)
def test_repeats_are_spread_over_batches(plain, repeated, repeats, batch_size, k, epoch):
    """A repeated sample is listed once per copy (datasets.mix); copies go to different batches when the bucket has
    at least as many batches as copies, beside samples that are not repeated."""
    once = _refs([plain]) if plain else []
    many = [batching.SampleRef(f"r-{i}", "64x64", "shard-r.parquet", i) for i in range(repeated)]
    refs = once + [r for r in many for _ in range(repeats)]
    plan, dropped = batching.plan_epoch(refs, batch_size, 7, epoch, world_size=1, shuffle_block=k)
    batches = [[ref.sample_id for ref in decode_planned(b["refs"])] for b in plan]
    assert sorted(s for b in batches for s in b) == sorted(r.sample_id for r in refs) and dropped == 0
    if len(batches) >= repeats + 1:
        assert all(len(set(b)) == len(b) for b in batches), batches
    assert [len(b) for b in batches].count(batch_size) >= len(batches) - 1


def test_repeated_runs_stay_runs():
    """With every sample repeated, each copy of a run still reads as one run."""
    many = [batching.SampleRef(f"r-{i}", "64x64", "shard.parquet", i) for i in range(32)]
    refs = [r for r in many for _ in range(3)]
    batches = [sorted(ref.row for ref in decode_planned(b["refs"])) for b in batching.plan_epoch(refs, 8, 3, 0, 1)[0]]
    assert all(len(set(b)) == 8 for b in batches)
    assert all(len({row // 4 for row in b}) == 2 for b in batches)  # two runs of 4 neighbours, whole


def test_batch_sizes_are_what_epoch_counts_counts():
    assert runs.batch_sizes(10, 4) == [4, 4, 2] and runs.batch_sizes(8, 4) == [4, 4] and runs.batch_sizes(0, 4) == []


def test_held_out_samples_are_stable_and_never_planned():
    """data.eval_samples: the same samples whatever the listing order, the repeats or the world size; none of them
    (nor a repeat of one) is in any planned training batch; the eval plan covers each once, bucket-pure."""
    refs = _refs([9, 7]) + _refs([5], bucket="80x48")
    train, held = batching.split_held_out(refs * 2, 4, seed=7)  # every sample repeated twice
    shuffled = list(refs)
    random.Random(1).shuffle(shuffled)
    assert [r.sample_id for r in batching.split_held_out(shuffled, 4, seed=7)[1]] == [r.sample_id for r in held]
    assert len(held) == 4 and len(train) == 2 * (len(refs) - 4)
    assert batching.split_held_out(refs, 4, seed=8)[1] != held  # the cache seed picks another stable subset
    ids = {r.sample_id for r in held}
    for world in (1, 2, 3):
        planned = batching.plan_epoch(train, 2, 0, 0, world)[0]
        assert not ids & {ref.sample_id for b in planned for ref in decode_planned(b["refs"])}
    plan = batching.plan_eval(held, 3)
    assert sorted(ref.sample_id for b in plan for ref in decode_planned(b["refs"])) == sorted(ids)
    assert all(len({ref.sample_id.split("-")[0] for ref in decode_planned(b["refs"])}) == 1 for b in plan)
    assert batching.split_held_out(refs, 0, seed=7) == (refs, [])
