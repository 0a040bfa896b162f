"""Resume by plan cursor: restarts at any step with any world size train every planned batch at most once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rayflux.train import batching
from rayflux.train.progress import Progress


def _refs(n: int, buckets: int) -> list[batching.SampleRef]:
    return [batching.SampleRef(f"s{i:03d}", f"b{i % buckets}", "f", i) for i in range(n)]


def _rank_items(refs, batch_size: int, epochs: int, world: int, rank: int) -> list[dict]:
    """What the data feed gives a rank: the plan for this world size, batches rank, rank + world, ..."""
    plan = [b for e in range(epochs) for b in batching.plan_epoch(refs, batch_size, 0, e, world)[0]]
    return plan[rank::world]


def _run(refs, batch_size, epochs, saved, step, world, max_steps):
    """One worker group, in lockstep, until it ends or ``max_steps``; returns (progress, step, batches trained)."""
    progs = [Progress.restore(saved, step, world) for _ in range(world)]
    streams = [p.remaining(_rank_items(refs, batch_size, epochs, world, r), world, None) for r, p in enumerate(progs)]
    trained = []
    while max_steps is None or len(trained) < max_steps * world:
        got = [next(s, None) for s in streams]
        if got == [None] * world:
            break
        assert None not in got, "ranks ran out of batches at different steps"
        assert len({last for _, last in got}) == 1, "ranks disagree on the last step"
        for r, (item, _) in enumerate(got):
            progs[r].advance(item, world)
            trained.append((item["epoch"], item["index"]))
        step += 1
        assert len({(p.epoch, p.index) for p in progs}) == 1
        if got[0][1]:
            break
    return progs[0].to_dict(), step, trained


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 24),
    buckets=st.integers(1, 3),
    batch_size=st.integers(1, 3),
    epochs=st.integers(1, 3),
    segments=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6)), max_size=4),
    last_world=st.integers(1, 4),
)
def test_restarts_with_any_world_size_never_repeat_a_batch(n, buckets, batch_size, epochs, segments, last_world):
    refs = _refs(n, buckets)
    saved, step, trained, restarts = None, 0, [], []
    for world, steps in [*segments, (last_world, None)]:
        if saved is not None:
            restarts.append(world)
        saved, step, done = _run(refs, batch_size, epochs, saved, step, world, steps)
        trained += done
    assert len(trained) == len(set(trained))
    planned = {(e, b["index"]) for e in range(epochs) for b in batching.plan_epoch(refs, batch_size, 0, e, 1)[0]}
    assert set(trained) <= planned
    # Missed batches: each epoch's remainder (< the largest world size) and each restart's rounding (< its world).
    biggest = max([last_world, *(w for w, _ in segments)])
    assert len(planned - set(trained)) <= epochs * (biggest - 1) + sum(w - 1 for w in restarts)


def test_shrinking_from_two_workers_to_one_trains_every_batch():
    refs = _refs(8, 1)
    saved, step, first = _run(refs, 1, 2, None, 0, 2, 3)  # 3 steps on 2 workers: batches 0..5 of epoch 0
    assert (saved["epoch"], saved["index"]) == (0, 6)
    saved, step, rest = _run(refs, 1, 2, saved, step, 1, None)
    assert sorted(first + rest) == [(e, i) for e in range(2) for i in range(8)]
    assert [s["world"] for s in saved["starts"]] == [2, 1] and saved["starts"][1]["step"] == 3


def test_growing_at_an_odd_cursor_drops_one_batch_and_keeps_ranks_equal():
    refs = _refs(8, 1)
    saved, step, first = _run(refs, 1, 1, None, 0, 1, 3)  # batches 0..2 on one worker
    saved, step, rest = _run(refs, 1, 1, saved, step, 2, None)  # resumes at 4: batch 3 is skipped by the rounding
    assert sorted(first + rest) == [(0, i) for i in range(8) if i != 3]
