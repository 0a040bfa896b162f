"""TensorBoard event files: no step twice after a resume, and an object-store run's events copied up while it runs."""

import time

import pyarrow.fs as pafs

from rayflux import storage
from rayflux.train.observe import metrics


def _steps(logdir) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return [e.step for e in events.Scalars("train/loss")]


def _log(run_dir, steps, purge_step=None) -> None:
    board = metrics.TensorBoardLog(str(run_dir), purge_step=purge_step)
    for step in steps:
        board.scalars(step, {"loss": 1.0 / step})
    board.close()


def test_a_resume_purges_the_steps_logged_after_the_last_checkpoint(tmp_path):
    """The first run logged steps 1-5 but its last checkpoint was step 2: the resumed run logs 3-6 again."""
    for run in ("plain", "resumed"):
        _log(tmp_path / run, range(1, 6))
    time.sleep(1.1)  # event file names carry the second they were created: two writers in one second share a name
    _log(tmp_path / "plain", range(3, 7))
    _log(tmp_path / "resumed", range(3, 7), purge_step=3)
    assert _steps(tmp_path / "plain" / "tensorboard") == [1, 2, 3, 4, 5, 3, 4, 5, 6]  # what the purge prevents
    assert _steps(tmp_path / "resumed" / "tensorboard") == [1, 2, 3, 4, 5, 6]


def test_object_store_events_are_copied_up_between_checkpoints(s3_bucket):
    board = metrics.TensorBoardLog(f"{s3_bucket}/run", upload_seconds=0.2)
    try:
        board.scalars(1, {"loss": 0.5})
        fs, inner = storage.resolve(f"{s3_bucket}/run/tensorboard")
        deadline = time.monotonic() + 60
        found = []
        while not found and time.monotonic() < deadline:  # no flush() call: only the periodic copy can put it there
            time.sleep(0.2)
            found = [i for i in fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True)) if i.size]
        assert found and found[0].base_name.startswith("events.out.tfevents")
    finally:
        board.close()
