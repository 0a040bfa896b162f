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


def _gpu_node(gpus: float):
    """One node of 64 CPUs and ``gpus`` GPUs, as the cache's pre-flight sees a cluster (no autoscaler)."""
    from rayflux.cache import fit

    return fit.Capacity(now={"CPU": 64.0, "GPU": gpus, "memory": 5e11}, most=None, largest_node_cpus=64.0)


def _gpu_cfg(tiny_model, images, tmp_path, *extra: str) -> config.JobConfig:
    sets = [f"model.path={tiny_model}", f"data.images_dir={images}", f"cache.dir={tmp_path / 'cache'}"]
    return config.load(None, [*sets, f"run.output_dir={tmp_path / 'run'}", "train.workers.num_workers=8", *extra])


def test_where_every_gpu_trains_each_is_shared_with_one_encoder_only_if_both_fit(tiny_model, demo_images, tmp_path):
    """8 workers on an 8-GPU node leave the encoders no GPU. The tiny model's worker peak and encoders fit an 80 GiB
    GPU many times: each GPU is split (the worker 0.9, one encoder 0.1) and the pools have one actor per GPU. On a
    GPU too small for both, or with validation renders already sharing the GPUs, the cache stage runs first."""
    from rayflux.train import gpu_sharing, stage

    cfg = _gpu_cfg(tiny_model, demo_images, tmp_path)
    shared = early.choose(cfg, True, _gpu_node(8), gpu_bytes=80 * gpu_sharing.GIB)
    assert shared.early and shared.encoder_share == gpu_sharing.MIN_SHARE, shared.reason
    assert shared.encoders.resources["num_gpus"] == gpu_sharing.MIN_SHARE and shared.encoders.vae.max == 8
    assert "the worker 0.9, one encoder 0.1" in shared.reason
    assert stage.scaling_config(cfg, True, shared.encoder_share).resources_per_worker["GPU"] == pytest.approx(0.9)

    small = gpu_sharing.encoder_bytes(cfg)  # a GPU that holds the encoders and nothing beside them
    cramped = early.choose(cfg, True, _gpu_node(8), gpu_bytes=small)
    assert not cramped.early and "do not fit one GPU" in cramped.reason and "no GPU left" not in cramped.reason

    renders = _gpu_cfg(tiny_model, demo_images, tmp_path, "train.validation.prompts=[a red square]")
    rendering = early.choose(renders, True, _gpu_node(8), gpu_bytes=80 * gpu_sharing.GIB)
    assert not rendering.early and "validation renders already share" in rendering.reason

    spare = early.choose(cfg, True, _gpu_node(12), gpu_bytes=80 * gpu_sharing.GIB)  # 4 GPUs the workers leave
    assert spare.early and spare.encoder_share == 0 and spare.encoders.resources["num_gpus"] == 1.0, spare.reason


@pytest.mark.parametrize(
    "gpu_gib, fits, share",
    [(80, True, 0.15), (141, True, 0.1), (40, False, None), (24, False, None)],
)
def test_flux1_dev_shares_a_gpu_with_its_encoders_on_80_gib_and_up(gpu_gib, fits, share):
    """FLUX.1-dev at 512 px, batch 1, rank 16 on attention (the planner's figures), beside its encoders: T5-XXL's
    encoder (4,762,310,656 parameters), CLIP-L's text model (123,060,480) and the VAE (83,819,683) in bf16."""
    from rayflux import gpu_memory
    from rayflux.families.flux1 import FLUX1_DEV
    from rayflux.train import gpu_sharing

    from test_plan import _trainable

    total, lora = 11_901_408_320, _trainable("attention", 16)
    worker = gpu_memory.estimate(FLUX1_DEV, total * 2, lora, 512, 1, False, rank=16).total
    encoders = int((4_762_310_656 + 123_060_480 + 83_819_683) * 2 * gpu_sharing.ENCODER_MARGIN)
    split = gpu_sharing.Sharing(worker, encoders, gpu_gib * gpu_sharing.GIB)
    assert split.fits == fits, split.describe()
    if fits:
        assert split.share == share and split.share <= gpu_sharing.MAX_SHARE
