"""Resuming after a world-size change: every rank keeps equal steps, and no planned batch is trained twice."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from rayflux.cache.layout import decode_planned
from rayflux.train.data import batching, elastic
from rayflux.train.resume.checkpoint import Progress
from rayflux.train.loop import grouped
from rayflux.train.plan import FeedPlan


def _refs(n: int, buckets: int) -> list[batching.SampleRef]:
    return [batching.SampleRef(f"s{i:03d}", f"b{i % buckets}", "f", i) for i in range(n)]


def _feed(batch_size: int, epochs: int, accumulation: int = 1) -> FeedPlan:
    return FeedPlan(batch_size=batch_size, seed=0, epochs=(0, epochs), total_epochs=epochs, accumulation=accumulation)


def _run(refs, batch_size, epochs, accumulation, world, saved, steps_allowed):
    """One worker group, all ranks in lockstep, as the data feed plans (cut at ``saved``, a checkpoint's position
    record) and the training loop steps; returns the new position record and the steps' log records."""
    per_rank = elastic.plan_rows(refs, _feed(batch_size, epochs, accumulation), world, saved)
    # What the feed's read adds to each planned row that the loop's digest records: the batch's sample ids.
    per_rank = [
        [{**r, "sample_ids": json.dumps([x.sample_id for x in decode_planned(r["refs"])])} for r in rows]
        for rows in per_rank
    ]
    resume = {row["resume_step"] for rows in per_rank for row in rows}
    assert resume <= {saved["step"] if saved else 0}, "rows disagree on the restored step"
    streams = [grouped(rows, accumulation) for rows in per_rank]
    progress = Progress(**{k: v for k, v in (saved or {}).items() if k not in ("log", "world_size")}, world_size=world)
    log = list((saved or {}).get("log", []))
    while steps_allowed is None or progress.step < (saved["step"] if saved else 0) + steps_allowed:
        groups = [next(s, None) for s in streams]
        if groups == [None] * world:
            break
        assert None not in groups, "ranks ran out of steps at different times"
        positions = [elastic.step_position(g, r, world) for r, g in enumerate(groups)]
        assert all(p == positions[0] for p in positions), "ranks disagree on the step's batches"
        assert len({int(g[0]["step"]) for g in groups}) == 1, "ranks disagree on the step number"
        progress.advance(int(groups[0][0]["step"]), positions[0], groups[0])
        log.append({"step": progress.step, **positions[0]})
    record = {k: getattr(progress, k) for k in ("step", "epoch", "index", "world_size", "digest")}
    return {**record, "log": log}


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 24),
    buckets=st.integers(1, 3),
    batch_size=st.integers(1, 3),
    accumulation=st.integers(1, 2),
    epochs=st.integers(1, 3),
    segments=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 5)), max_size=4),
    last_world=st.integers(1, 4),
)
def test_restarts_with_any_world_size_never_repeat_a_batch(
    n, buckets, batch_size, accumulation, epochs, segments, last_world
):
    refs = _refs(n, buckets)
    saved = None
    for world, steps in [*segments, (last_world, None)]:
        saved = _run(refs, batch_size, epochs, accumulation, world, saved, steps)
    metrics = {**saved, "history": saved["log"]}
    history = metrics["history"]
    assert [h["step"] for h in history] == list(range(1, len(history) + 1))
    trained = [(h["epoch"], h["index"] + k) for h in history for k in range(h["span"])]
    assert len(trained) == len(set(trained)), "a batch was trained twice"
    planned = {(e, b["index"]) for e in range(epochs) for b in batching.plan_epoch(refs, batch_size, 0, e, 1)[0]}
    assert set(trained) <= planned
    # Missed: each epoch's remainder and each restart's rounding, both under one world size × accumulation.
    biggest = max([last_world, *(w for w, _ in segments)]) * accumulation
    assert len(planned - set(trained)) <= (epochs + len(segments)) * (biggest - 1)


def _steps(world: int, saved, steps_allowed, epochs: int = 2):
    return _run(_refs(8, 1), 1, epochs, 1, world, saved, steps_allowed)


def test_shrinking_from_two_workers_to_one_trains_every_batch_once():
    first = _steps(2, None, 3)  # 3 steps on 2 workers: batches 0..5 of epoch 0
    assert first["log"][-1] == {"step": 3, "epoch": 0, "index": 4, "span": 2, "world": 2}
    assert (first["epoch"], first["index"]) == (0, 6)  # the position record: every batch before 6 is done
    final = _steps(1, first, None)
    trained = sorted((h["epoch"], h["index"] + k) for h in final["log"] for k in range(h["span"]))
    assert trained == [(e, i) for e in range(2) for i in range(8)]
    assert final["step"] == 3 + 10  # 2 epochs of 8 batches, 6 done on 2 workers, 10 left for one


def test_growing_at_an_odd_position_skips_one_batch_to_keep_ranks_equal():
    first = _steps(1, None, 3, epochs=1)  # batches 0..2 on one worker
    final = _steps(2, first, None, epochs=1)  # resumes at 4 on two: batch 3 is dropped
    trained = sorted(h["index"] + k for h in final["log"] for k in range(h["span"]))
    assert trained == [0, 1, 2, 4, 5, 6, 7] and final["step"] == 3 + 2


def test_a_resumed_plan_holds_no_batch_before_the_checkpoint():
    refs = _refs(8, 1)
    saved = _steps(2, None, 3)
    rows = elastic.plan_rows(refs, _feed(1, 2), 2, saved)
    first = [(r["epoch"], r["index"]) for r in rows[0]][:1] + [(r["epoch"], r["index"]) for r in rows[1]][:1]
    assert first == [(0, 6), (0, 7)]  # nothing before the checkpoint's position is planned, so nothing is read
    assert [r["step"] for r in rows[0]] == [4, 5, 6, 7, 8] and {r["resume_step"] for r in rows[0]} == {3}
    # The same digest of what was trained, however the run was cut into restarts.
    straight = _steps(2, None, None)
    assert _steps(2, saved, None)["digest"] == straight["digest"]
