"""``run.wandb_project``: rank 0's scalars, eval losses and validation grids reach a real (offline) wandb run, a rerun
continues the same run, and a missing wandb is refused with the extra that installs it."""

from __future__ import annotations

import os
import sys

import pytest

from rayflux import config
from rayflux.train.observe import metrics, validation, wandb_log
from wandb_support import offline_runs


@pytest.fixture
def offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield tmp_path
    import wandb

    wandb.teardown()  # stop wandb's service process; the next init reads WANDB_DIR afresh


def test_rank0_logs_what_tensorboard_gets_and_a_rerun_continues_the_run(offline, monkeypatch):
    from PIL import Image

    storage = str(offline / "out" / "checkpoints" / "rayflux")
    monkeypatch.setenv("WANDB_DIR", str(offline))
    log = wandb_log.Both(
        metrics.TensorBoardLog(str(offline / "out")),
        wandb_log.WandbLog("rayflux-test", storage, "rayflux", {"train": {"rank": 8}}),
    )
    log.scalars(0, {"step": 0, "eval_loss": 0.9, "eval_quantiles": [0.25, 0.75], "eval_loss_sigmas": [0.8, 1.0]})
    log.scalars(1, {"step": 1, "loss": 0.5, "lr": 1e-4, "grad_norm": 2.0, "samples_per_s": 3.0})
    log.image(1, "validation", validation.grid([Image.new("RGB", (16, 16), c) for c in ("red", "blue")]))
    log.close()

    ((run_id, history),) = offline_runs(str(offline))
    assert run_id == wandb_log.run_id(storage, "rayflux")
    assert history[0]["train/eval_loss"] == 0.9
    assert (history[0]["eval/loss_q0.25"], history[0]["eval/loss_q0.75"]) == (0.8, 1.0)
    assert {k: history[1][f"train/{k}"] for k in ("loss", "lr", "grad_norm", "samples_per_s")} == {
        "loss": 0.5,
        "lr": 1e-4,
        "grad_norm": 2.0,
        "samples_per_s": 3.0,
    }
    assert history[1]["validation/_type"] == "image-file"
    assert (history[1]["validation/width"], history[1]["validation/height"]) == (32, 16)  # the 2-image grid
    assert os.listdir(offline / "out" / "tensorboard")  # TensorBoard still gets its events

    # A rerun of the same run (same output dir and run.name) continues the same wandb run; another output dir not.
    again = wandb_log.WandbLog("rayflux-test", storage + "/", "rayflux", {})
    again.scalars(2, {"loss": 0.25})
    again.close()
    _, (resumed_id, resumed) = offline_runs(str(offline))  # offline, each process writes its own part
    assert resumed_id == run_id and resumed[2]["train/loss"] == 0.25
    assert wandb_log.run_id(str(offline / "other" / "checkpoints" / "rayflux"), "rayflux") != run_id


def test_a_missing_wandb_is_refused_with_its_extra(monkeypatch):
    cfg = config.load(None, ["run.wandb_project=demo"])
    assert cfg.run.wandb_project == "demo"
    wandb_log.check("")  # unset: nothing to check, nothing imported
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python marks a module that cannot be imported
    with pytest.raises(ValueError, match=r"^run.wandb_project=demo needs wandb, .*pip install 'rayflux\[wandb\]'"):
        wandb_log.check(cfg.run.wandb_project)  # the driver, before the cache stage
    with pytest.raises(ValueError, match=r"pip install 'rayflux\[wandb\]'"):
        wandb_log.WandbLog("demo", "/tmp/run", "rayflux", {})  # rank 0, in the worker's own environment
