"""The training bar's text, its channel from rank 0 to the driver, and which Ray output reaches the terminal."""

import logging
import time

from rayflux import console, progress

COUNTS = {0: {"batches": 6}, 1: {"batches": 4}}


def test_training_progress_text():
    per_epoch = progress.steps_per_epoch(COUNTS, world_size=2)
    assert per_epoch == [3, 2]
    assert [progress.epoch_of(s, per_epoch) for s in range(1, 6)] == [1, 1, 1, 2, 2]
    assert progress.describe(4, {"loss": 0.123456}, per_epoch) == "train epoch 2/2 loss 0.1235"
    assert progress.TrainBar(COUNTS, 2, max_steps=4).total == 4
    assert progress.TrainBar(COUNTS, 2).total == 5
    line = progress.plain_line(120, 800, {"loss": 0.41}, [400, 400], rate=2.1)
    assert line == "train step 120/800 epoch 1/2 loss 0.4100 2.10 step/s ETA 5m"
    assert progress.plain_line(1, 5, {}, per_epoch, rate=0.0) == "train step 1/5 epoch 1/2"


def test_bar_reads_rank_zeros_updates_without_a_terminal(ray_session, caplog):
    """Plain lines when stdout is not a terminal; the last step always shows, however fast the steps came."""
    with caplog.at_level(logging.INFO, logger="rayflux"):
        with progress.TrainBar(COUNTS, 2, interactive=False) as bar:
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
