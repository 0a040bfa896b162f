"""The training worker group started during the cache stage (rayflux.train.early, rayflux.train.handoff): where it
fits, and a cache stage that fails while the group waits (real local Ray, the job's own entry point). A resumed run
that starts its group before the cache check, and a rerun with nothing left to train, are in
tests/test_rerun_after_kill.py (they reuse its runs)."""

import json
import time
from pathlib import Path

import pytest

from rayflux import config, job, phases
from rayflux.train import early


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
