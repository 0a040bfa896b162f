"""The training bar's text, its channel from rank 0 to the driver, and which Ray output reaches the terminal."""

import dataclasses
import logging
import time

import pytest

from rayflux import config, console, progress
from rayflux.train import plan
from rayflux.train.data import batching, elastic

COUNTS = {0: {"batches": 6}, 1: {"batches": 4}}


def _plan(counts: dict, world_size: int = 2, accumulation: int = 1, max_steps: int = 0) -> plan.TrainPlan:
    feed = plan.FeedPlan(
        batch_size=2, seed=0, epochs=(0, len(counts)), total_epochs=len(counts), accumulation=accumulation
    )
    return plan.TrainPlan(feed=feed, world_size=world_size, counts=counts, max_steps=max_steps)


def test_training_progress_text():
    per_epoch = _plan(COUNTS).steps_per_epoch
    assert per_epoch == [3, 2]
    assert _plan(COUNTS, max_steps=4).total_steps == 4 and _plan(COUNTS).total_steps == 5
    assert [progress.epoch_of(s, per_epoch) for s in range(1, 6)] == [1, 1, 1, 2, 2]
    assert progress.describe(4, {"loss": 0.123456}, per_epoch) == "train epoch 2/2 loss 0.1235"
    line = progress.plain_line(120, 800, {"loss": 0.41}, [400, 400], rate=2.1)
    assert line == "train step 120/800 epoch 1/2 loss 0.4100 2.10 step/s ETA 5m"
    assert progress.plain_line(1, 5, {}, per_epoch, rate=0.0) == "train step 1/5 epoch 1/2"


@pytest.mark.parametrize("accumulation", [1, 3])
def test_the_bar_counts_the_optimizer_steps_the_loop_trains(accumulation):
    """The driver's counts (plan line, bar, epoch, ETA, ``train.max_steps``) against the step numbers the feed gives
    the loop: ``accumulation`` batches per optimizer step on each of 2 workers, over 3 epochs of uneven buckets."""
    refs = [
        batching.SampleRef(f"{bucket}-{i}", bucket, f"shard-{bucket}.parquet", i)
        for bucket, n in (("64x64", 29), ("80x48", 13))
        for i in range(n)
    ]
    cfg = config.load(None, ["train.batch_size=2", "train.epochs=3", f"train.gradient_accumulation={accumulation}"])
    feed = plan.feed_plan(cfg, "/run")
    counts = plan.plan_counts(feed, refs, 2)
    rows = elastic.plan_rows(refs, feed, 2)[0]  # rank 0's, as the loop reads
    steps = sorted({r["step"] for r in rows})
    assert len(rows) == len(steps) * accumulation  # the loop's optimizer steps, `accumulation` rows each
    planned = plan.TrainPlan(feed=feed, refs=tuple(refs), world_size=2, counts=counts)
    bar = progress.TrainBar(planned.steps_per_epoch, planned.total_steps)
    # 15 + 7 batches an epoch: 22 / 2 = 11 steps a worker, or 18 (the remainder rule's multiple of 6) / 6 = 3.
    assert bar.total == steps[-1] == rows[0]["total_steps"] == {1: 33, 3: 9}[accumulation]
    assert sum(planned.steps_per_epoch) == bar.total  # the plan line's figure
    assert {r["step"]: progress.epoch_of(r["step"], bar.per_epoch) for r in rows} == {
        r["step"]: r["epoch"] + 1 for r in rows
    }
    half = bar.total // 2
    line = progress.plain_line(half, bar.total, {}, bar.per_epoch, rate=0.1)  # 10 s a step
    assert line.endswith(f"ETA {progress._duration(10 * (bar.total - half))}")
    # train.max_steps counts the optimizer steps the loop counts (the LR schedule's horizon, where the loop stops).
    assert dataclasses.replace(planned, max_steps=5).total_steps == 5
    assert dataclasses.replace(planned, max_steps=100).total_steps == bar.total


def test_bar_reads_rank_zeros_updates_without_a_terminal(ray_session, caplog):
    """Plain lines when stdout is not a terminal; the last step always shows, however fast the steps came."""
    with caplog.at_level(logging.INFO, logger="rayflux"):
        with progress.TrainBar(_plan(COUNTS).steps_per_epoch, 5, interactive=False) as bar:
            sender = progress.BoardSender(bar.board)
            for step in range(1, 6):
                sender.send({"step": step, "loss": 1.0 / step}, force=step == 5)
            time.sleep(1.5)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("train step")]
    assert lines and lines[-1].startswith("train step 5/5 epoch 2/2 loss 0.2000")


def test_ray_chatter_is_kept_off_the_console():
    def shown(level, msg, filename="worker.py"):
        return console.shown(logging.LogRecord("ray", level, filename, 1, msg, None, None))

    assert not shown(logging.INFO, "Started a local Ray instance.")
    assert not shown(logging.INFO, "Execution plan of Dataset x: InputDataBuffer[Input] -> ...")
    assert not shown(logging.WARNING, "Progress bars disabled. To enable, set `ray.data...`")
    assert not shown(logging.WARNING, "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=...")
    # Ray Data's plain progress when stdout is not a terminal says nothing while a pipeline streams ("0/?").
    assert not shown(logging.INFO, "Total Progress: 0/?", filename="logging_progress.py")
    assert shown(logging.WARNING, "The actor cannot be scheduled right now")
    assert shown(logging.WARNING, "Token authentication is disabled for this Ray cluster. Anyone with ...")
    assert shown(logging.ERROR, "anything")
