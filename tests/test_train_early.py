"""The training worker group started during the cache stage (rayflux.train.early, rayflux.train.handoff): where it
fits, a cache stage that fails while the group waits, a resumed run that starts its group before the cache check, and
a rerun with nothing left to train (real local Ray, the job's own entry point)."""

import json
import logging
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rayflux import config, job, phases
from rayflux.train import early
from rayflux.train.resume import commits


def _cfg(tiny_model, images, tmp_path, out: Path, *extra: str) -> config.JobConfig:
    return config.load(
        None,
        [
            f"model.path={tiny_model}",
            f"data.images_dir={images}",
            f"cache.dir={tmp_path / 'cache'}",
            f"run.output_dir={out}",
            "data.resolution=64",
            "train.workers.num_workers=1",
            "train.checkpoint.every=1",
            "train.optim.learning_rate=0.01",
            *extra,
        ],
    )


def _marks(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _first(marks: list[dict], phase: str) -> float:
    return min(m["time"] for m in marks if m["phase"] == phase)


def _alive_train_actors() -> list[str]:
    from ray._private.state import actors  # the GCS's table: no dashboard needed

    names = [a["ActorClassName"] for a in actors(actor_state_name="ALIVE").values()]
    return [n for n in names if "Train" in n or n == "Handoff"]


def test_the_group_starts_early_only_where_it_fits_beside_the_encoders(ray_session, tiny_model, demo_images, tmp_path):
    out = tmp_path / "run"
    fits = early.choose(_cfg(tiny_model, demo_images, tmp_path, out), False)
    # The session's Ray has 2 CPUs: the worker's 0.5 leaves the encoders 1.5, less 0.75 for the tasks.
    assert fits.early and fits.encoders.resources["num_cpus"] == pytest.approx(0.75), fits.reason
    off = early.choose(_cfg(tiny_model, demo_images, tmp_path, out, "train.workers.start_during_cache=false"), False)
    assert not off.early and "start_during_cache is off" in off.reason
    crowded = early.choose(_cfg(tiny_model, demo_images, tmp_path, out, "cache.actor_cpus=1.5"), False)
    assert not crowded.early and "do not fit beside the workers' 0.5 CPU" in crowded.reason


def test_a_cache_stage_that_fails_while_the_group_waits_ends_the_job_with_its_error(
    ray_session, tiny_model, tmp_path, monkeypatch
):
    from rayflux.cache.stage import BadInputError
    from rayflux.generation_stages import GenerationStages
    from rayflux.testing.images import write_images

    images = tmp_path / "images"
    write_images(images, [(64, 64)] * 2)
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    marks = tmp_path / "phases.jsonl"
    monkeypatch.setenv(phases.ENV, str(marks))
    build = GenerationStages._generation

    def after_the_group_waits(self, g):
        deadline = time.monotonic() + 120
        while not any(m["phase"] == "handoff_wait_start" for m in _marks(marks)):
            assert time.monotonic() < deadline, "no training worker started waiting for the generation"
            time.sleep(0.2)
        return build(self, g)  # the real build, which cache.strict fails on the broken image

    monkeypatch.setattr(GenerationStages, "_generation", after_the_group_waits)
    with pytest.raises(BadInputError, match="broken.png"):
        job.run(_cfg(tiny_model, images, tmp_path, tmp_path / "run", "cache.strict=true"))
    got = [m["phase"] for m in _marks(marks)]
    assert "handoff_wait_end" in got and "step_start" not in got and "handoff" not in got
    deadline = time.monotonic() + 30
    while _alive_train_actors() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _alive_train_actors() == []


def test_a_resumed_run_starts_its_group_before_the_cache_check_and_trains_the_same_lora(
    ray_session, tiny_model, demo_images, tmp_path, monkeypatch, caplog
):
    whole = job.run(_cfg(tiny_model, demo_images, tmp_path, tmp_path / "whole", "train.max_steps=4"))
    out = tmp_path / "resumed"
    job.run(_cfg(tiny_model, demo_images, tmp_path, out, "train.max_steps=2"))
    marks = tmp_path / "phases.jsonl"
    monkeypatch.setenv(phases.ENV, str(marks))
    resumed = job.run(_cfg(tiny_model, demo_images, tmp_path, out, "train.max_steps=4"))

    m = _marks(marks)
    # The group was launched before the cache check and given the generation after it; it restored step 2.
    assert _first(m, "train_launch") < _first(m, "cache_start") <= _first(m, "cache_end") <= _first(m, "handoff")
    assert _first(m, "handoff_wait_start") < _first(m, "handoff_wait_end") and _first(m, "model_load_start")
    assert commits.read_json(resumed.checkpoint)["resumed_at"] == [2]
    a, b = load_file(whole.lora_path), load_file(resumed.lora_path)
    assert a.keys() == b.keys() and max(float(v.abs().max()) for k, v in a.items() if "lora_B" in k) > 1e-3
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-4, atol=1e-5)

    # Killed after its last checkpoint, before the ledger recorded it: the rerun has nothing left to train.
    ledger = out / "ledger.json"
    state = json.loads(ledger.read_text())
    state["stages"] = [s for s in state["stages"] if s["name"] not in ("train:seg0", "export")]
    ledger.write_text(json.dumps(state))
    marks.unlink()
    with caplog.at_level(logging.INFO):
        again = job.run(_cfg(tiny_model, demo_images, tmp_path, out, "train.max_steps=4"))
    said = [r.getMessage() for r in caplog.records if "nothing to train" in r.getMessage()]
    assert len(said) == 1 and "the model was not loaded" in said[0], said
    assert not {"train_launch", "worker_start", "model_load_start"} & {x["phase"] for x in _marks(marks)}
    assert again.steps == 4 and Path(again.lora_path).is_file()
