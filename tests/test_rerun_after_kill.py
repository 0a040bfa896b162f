"""The recovery the README promises: a job SIGKILLed with its whole process group (as an out-of-memory kill or a
lost terminal does), then the same command at once. The rerun takes over the dead driver's lease without waiting
for it to expire, resumes from the last checkpoint (its worker group started before the cache check: issue 46), and
ends with the LoRA an uninterrupted run trains; a rerun with nothing left to train loads no model (real local Ray,
the job's own entry point)."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rayflux import config, job, phases
from rayflux.train.resume import commits

ROOT = Path(__file__).resolve().parents[1]


def _settings(tiny_model, demo_images, tmp_path, out: Path) -> list[str]:
    return [
        f"model.path={tiny_model}",
        f"data.images_dir={demo_images}",
        f"cache.dir={tmp_path / 'cache'}",
        f"run.output_dir={out}",
        "data.resolution=64",
        "train.workers.num_workers=1",
        "train.max_steps=4",
        "train.checkpoint.every=1",
        "train.optim.learning_rate=0.01",
        # run.lease_seconds stays the default 60 s: the rerun must not wait for it.
    ]


def test_sigkilled_job_rerun_at_once_resumes_to_the_uninterrupted_lora(
    ray_session, tiny_model, demo_images, tmp_path, caplog
):
    whole = job.run(config.load(None, _settings(tiny_model, demo_images, tmp_path, tmp_path / "whole")))

    out = tmp_path / "killed"
    # Each step sleeps 1.5 s first, so steps remain when the first checkpoint is committed.
    cmd = [sys.executable, str(ROOT / "jobs" / "train_flux.py"), "--set", "run.debug_slow_rank=0:1.5"]
    for item in _settings(tiny_model, demo_images, tmp_path, out):
        cmd += ["--set", item]
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    run_dir = commits.run_storage(str(out), config.load(None, []).run.name)
    try:
        deadline = time.monotonic() + 300
        while not commits.latest(run_dir):
            assert proc.poll() is None, "the job ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint was committed"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started
        proc.wait()
    interrupted_at = commits.read_json(commits.latest(run_dir))["step"]
    assert 1 <= interrupted_at < 4
    assert (out / "lease.json").exists()  # the dead driver never let go of its lease

    marks = tmp_path / "rerun.phases.jsonl"
    rerun = subprocess.run(cmd, env={**env, phases.ENV: str(marks)}, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    said = rerun.stdout + rerun.stderr
    assert f"took over the lease of a job (host {os.uname().nodename}, pid {proc.pid})" in said, said[-3000:]
    assert "that process no longer runs on this machine" in said
    position = commits.read_json(commits.latest(run_dir))
    assert position["resumed_at"] == [interrupted_at] and position["step"] == 4  # restored, not started over

    resumed, uninterrupted = load_file(out / "lora" / Path(whole.lora_path).name), load_file(whole.lora_path)
    assert resumed.keys() == uninterrupted.keys()
    assert max(float(v.abs().max()) for k, v in uninterrupted.items() if "lora_B" in k) > 1e-3  # it trained
    for key, value in uninterrupted.items():
        torch.testing.assert_close(resumed[key], value, rtol=1e-4, atol=1e-5)
    # The rerun launched its worker group before the cache check, and handed it the generation after it (issue 46).
    first = _first_marks(marks)
    assert first["train_launch"] < first["cache_start"] <= first["cache_end"] <= first["handoff"]
    assert first["handoff_wait_start"] < first["handoff_wait_end"] and first["handoff"] <= first["handoff_wait_end"]

    # Killed after its last checkpoint, before the ledger recorded it: a rerun has nothing left to train.
    _forget_training(out / "ledger.json")
    marks.unlink()
    with caplog.at_level(logging.INFO), pytest.MonkeyPatch.context() as mp:
        mp.setenv(phases.ENV, str(marks))
        again = job.run(config.load(None, _settings(tiny_model, demo_images, tmp_path, out)))
    said = [r.getMessage() for r in caplog.records if "nothing to train" in r.getMessage()]
    assert len(said) == 1 and "the model was not loaded" in said[0], said
    assert not {"train_launch", "worker_start", "model_load_start"} & set(_first_marks(marks))
    assert again.steps == 4 and Path(again.lora_path).is_file()


def _first_marks(path: Path) -> dict[str, float]:
    """Each phase's first time in a ``RAYFLUX_PHASES`` file."""
    first: dict[str, float] = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        first.setdefault(rec["phase"], rec["time"])
    return first


def _forget_training(ledger: Path) -> None:
    """The ledger as a job killed between its last checkpoint's commit and the train stage's record leaves it."""
    state = json.loads(ledger.read_text())
    state["stages"] = [s for s in state["stages"] if s["name"] not in ("train:seg0", "export")]
    ledger.write_text(json.dumps(state))
