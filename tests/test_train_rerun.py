"""Reruns of a finished run: a larger ``train.max_steps`` trains on from the checkpoint; a rerun with nothing left to
train says so (real local Ray, the job's own entry point)."""

import json
import logging
from pathlib import Path

from rayflux import config, job
from rayflux.train.observe import metrics
from rayflux.train.resume import commits


def _cfg(tiny_model, demo_images, out, max_steps: int) -> config.JobConfig:
    return config.load(
        None,
        [
            f"model.path={tiny_model}",
            f"data.images_dir={demo_images}",
            f"run.output_dir={out}",
            "data.resolution=64",
            "train.epochs=2",
            "train.workers.num_workers=1",
            f"train.max_steps={max_steps}",
        ],
    )


def test_a_larger_max_steps_continues_and_an_idle_rerun_says_why(
    ray_session, tiny_model, demo_images, tmp_path, caplog
):
    out = tmp_path / "run"
    first = job.run(_cfg(tiny_model, demo_images, out, 3))
    assert first.steps == 3

    longer = job.run(_cfg(tiny_model, demo_images, out, 6))
    assert longer.steps == 6 and Path(longer.lora_path).is_file()
    position = commits.read_json(longer.checkpoint)
    assert position["resumed_at"] == [3]  # continued from the first run's checkpoint, not from scratch
    assert [h["step"] for h in metrics.read_steps(str(out))] == list(range(1, 7))
    stages = [s for s in json.loads(Path(longer.ledger).read_text())["stages"] if s["name"] == "train:seg0"]
    assert stages[-1]["outputs"]["steps"] == 6 and not stages[-1]["outputs"]["complete"]

    with caplog.at_level(logging.INFO, logger="rayflux"):
        again = job.run(_cfg(tiny_model, demo_images, out, 6))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nothing to train")]
    assert len(said) == 1 and "train.max_steps" in said[0], [r.getMessage() for r in caplog.records]
    assert again.steps == 0 and commits.read_json(commits.latest(str(out / "checkpoints" / "rayflux")))["step"] == 6
