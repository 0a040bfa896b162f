"""Resuming after a world-size change: every rank keeps equal steps, and no planned batch is trained twice."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from rayflux.train import batching, elastic
from rayflux.train.checkpoint import METRICS_FILE, Progress
from rayflux.train.loop import grouped, skip_trained


def _refs(n: int, buckets: int) -> list[batching.SampleRef]:
    return [batching.SampleRef(f"s{i:03d}", f"b{i % buckets}", "f", i) for i in range(n)]


def _feed(refs, batch_size: int, epochs: int, world: int, accumulation: int) -> list[list[dict]]:
    """Each rank's rows, numbered as the data feed numbers them (rayflux.train.feed.PlannedDataConfig)."""
    per_rank: list[list[dict]] = [[] for _ in range(world)]
    for epoch in range(epochs):
        planned = batching.plan_epoch(refs, batch_size, 0, epoch, world, accumulation)[0]
        per_epoch = len(planned) // (world * accumulation)
        for i, b in enumerate(planned):
            per_rank[i % world].append({**b, "step": epoch * per_epoch + (i // world) // accumulation + 1})
    return per_rank


def _run(refs, batch_size, epochs, accumulation, world, saved_dir, steps_allowed):
    """One worker group, all ranks in lockstep, as the training loop resumes and steps; returns its metrics."""
    saved = json.loads((saved_dir / METRICS_FILE).read_text()) if saved_dir else {"step": 0, "history": []}
    streams, offsets = [], set()
    for rows in _feed(refs, batch_size, epochs, world, accumulation):
        rows, offset, positioned = elastic.resume_rows(rows, saved_dir, METRICS_FILE, world, accumulation)
        if not positioned:
            rows = skip_trained(rows, Progress(step=saved["step"]))
        streams.append(grouped(rows, accumulation))
        offsets.add(offset)
    assert len(offsets) == 1, "ranks disagree on the step offset"
    offset, step, history = offsets.pop(), saved["step"], list(saved["history"])
    while steps_allowed is None or step < saved["step"] + steps_allowed:
        groups = [next(s, None) for s in streams]
        if groups == [None] * world:
            break
        assert None not in groups, "ranks ran out of steps at different times"
        step = int(groups[0][0]["step"]) + offset
        positions = [elastic.step_position(g, r, world) for r, g in enumerate(groups)]
        assert all(p == positions[0] for p in positions), "ranks disagree on the step's batches"
        history.append({"step": step, **positions[0]})
    return {"step": step, "world_size": world, "history": history}


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
    tmp_path_factory, n, buckets, batch_size, accumulation, epochs, segments, last_world
):
    refs = _refs(n, buckets)
    saved_dir, metrics = None, None
    for world, steps in [*segments, (last_world, None)]:
        metrics = _run(refs, batch_size, epochs, accumulation, world, saved_dir, steps)
        saved_dir = tmp_path_factory.mktemp("ckpt")
        (saved_dir / METRICS_FILE).write_text(json.dumps(metrics))
    history = metrics["history"]
    assert [h["step"] for h in history] == list(range(1, len(history) + 1))
    trained = [(h["epoch"], h["index"] + k) for h in history for k in range(h["span"])]
    assert len(trained) == len(set(trained)), "a batch was trained twice"
    planned = {(e, b["index"]) for e in range(epochs) for b in batching.plan_epoch(refs, batch_size, 0, e, 1)[0]}
    assert set(trained) <= planned
    # Missed: each epoch's remainder and each restart's rounding, both under one world size × accumulation.
    biggest = max([last_world, *(w for w, _ in segments)]) * accumulation
    assert len(planned - set(trained)) <= (epochs + len(segments)) * (biggest - 1)


def _steps(world: int, saved_dir, steps_allowed, tmp_path, name: str, epochs: int = 2):
    metrics = _run(_refs(8, 1), 1, epochs, 1, world, saved_dir, steps_allowed)
    (tmp_path / name).mkdir()
    (tmp_path / name / METRICS_FILE).write_text(json.dumps(metrics))
    return metrics, tmp_path / name


def test_shrinking_from_two_workers_to_one_trains_every_batch_once(tmp_path):
    first, saved = _steps(2, None, 3, tmp_path, "a")  # 3 steps on 2 workers: batches 0..5 of epoch 0
    assert first["history"][-1] == {"step": 3, "epoch": 0, "index": 4, "span": 2, "world": 2}
    final, _ = _steps(1, saved, None, tmp_path, "b")
    trained = sorted((h["epoch"], h["index"] + k) for h in final["history"] for k in range(h["span"]))
    assert trained == [(e, i) for e in range(2) for i in range(8)]
    assert final["step"] == 3 + 10  # 2 epochs of 8 batches, 6 done on 2 workers, 10 left for one


def test_growing_at_an_odd_position_skips_one_batch_to_keep_ranks_equal(tmp_path):
    _, saved = _steps(1, None, 3, tmp_path, "a", epochs=1)  # batches 0..2 on one worker
    final, _ = _steps(2, saved, None, tmp_path, "b", epochs=1)  # resumes at 4 on two: batch 3 is dropped
    trained = sorted(h["index"] + k for h in final["history"] for k in range(h["span"]))
    assert trained == [0, 1, 2, 4, 5, 6, 7] and final["step"] == 3 + 2
