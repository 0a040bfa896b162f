"""Encoder pools sized to the cluster, a request that cannot fit refused before any work, a stalled stage failed,
and the text and image passes sharing the cluster by the joint rule (at once, or the VAE after the text pool, or one
after the other), an error in one stopping the other.

The sizing tests give :mod:`rayflux.cache.fit` cluster capacities directly (a p5-like GPU node, an autoscaler's
maximum); the others run the real job on the session's 2-CPU local Ray.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import cache_sets
import pytest

from rayflux import config, models
from rayflux.cache import fit, generations, host
from rayflux.cache.shards import CacheShapeError
from rayflux.cache.encoders import threads_for
from rayflux.cache.stall import CacheStallError
from rayflux.models import choose_device, vae_dtype

TWO_CPUS = fit.Capacity(now={"CPU": 2.0}, most=None, largest_node_cpus=2.0)
GPU_NODE = fit.Capacity(now={"CPU": 16.0, "GPU": 8.0}, most=None, largest_node_cpus=16.0)


def _plan(cap: fit.Capacity, *items: str, gpus: bool = False):
    p = fit.plan(config.load(None, list(items)), gpus, cap)
    return p.resources, p.vae, p.text


def _joint(cap: fit.Capacity, *items: str, gpus: bool = False) -> str:
    return fit.plan(config.load(None, list(items)), gpus, cap).encoders


def test_auto_gives_cpu_encoders_what_preparation_and_writing_leave():
    res, vae, text = _plan(TWO_CPUS)
    assert res == {"num_cpus": 1.25}  # 2 - 0.5 (preparation) - 0.25 (writing)
    assert threads_for(res["num_cpus"]) == 2  # torch on both cores, as a plain loop with default threads
    assert vae == text == fit.PoolSize(1, 1, 1)
    res, vae, _ = _plan(TWO_CPUS, "cache.vae_actors=2")
    assert res == {"num_cpus": 0.625} and vae == fit.PoolSize(1, 2, 2)
    assert threads_for(0.625) == 1
    big = fit.Capacity(now={"CPU": 64.0}, most=None, largest_node_cpus=64.0)
    res, vae, text = _plan(big)
    assert res == {"num_cpus": 8} and vae == fit.PoolSize(1, 7, 7)  # (64 - 0.75) // 8
    assert text == fit.PoolSize(1, 1, 1)  # one T5 copy on CPU


def test_auto_gives_gpu_encoders_every_gpu_share_up_to_the_autoscalers_maximum():
    res, vae, text = _plan(GPU_NODE, gpus=True)
    assert res == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert vae == text == fit.PoolSize(1, 8, 8)
    res, vae, _ = _plan(GPU_NODE, "cache.gpus_per_actor=0.25", gpus=True)
    assert res["num_gpus"] == 0.25
    assert vae == fit.PoolSize(1, 15, 15)  # 32 GPU shares, but 15 CPUs beside preparation and writing
    growing = fit.Capacity(now={"CPU": 16.0, "GPU": 8.0}, most={"CPU": 64.0, "GPU": 32.0}, largest_node_cpus=16.0)
    _, vae, _ = _plan(growing, gpus=True)
    assert vae == fit.PoolSize(1, 8, 32)


def test_a_fractional_gpu_share_reaches_the_ray_data_pool(ray_session):
    from rayflux.cache.stage import _pool

    res, vae, _ = _plan(GPU_NODE, "cache.gpus_per_actor=0.25", "cache.vae_actors=4", gpus=True)
    pool = _pool(vae)
    assert (pool.min_size, pool.max_size) == (1, 4)
    assert res == {"num_cpus": 1.0, "num_gpus": 0.25}


@pytest.mark.parametrize(
    "items, gpus, message",
    [
        (
            ["cache.vae_actors=2", "cache.actor_cpus=1.0"],
            False,
            "cache.vae_actors=2 x cache.actor_cpus=1 + 0.5 CPU for preparation + 0.25 for writing > 2 CPUs in the cluster",
        ),
        (["cache.text_actors=9"], True, "cache.text_actors=9 x cache.gpus_per_actor=1 > 8 GPU in the cluster"),
        (
            ["cache.vae_actors=3", "cache.gpus_per_actor=4"],
            True,
            "cache.vae_actors=3 x cache.gpus_per_actor=4 > 8 GPU in the cluster",
        ),
        (
            ["cache.vae_actors=1", "cache.actor_cpus=3"],
            False,
            "cache.vae_actors=1 x cache.actor_cpus=3 + 0.5 CPU for preparation + 0.25 for writing > 2 CPUs in the cluster",
        ),
    ],
)
def test_a_request_that_cannot_fit_is_refused_with_its_numbers(items, gpus, message):
    with pytest.raises(fit.FitError) as err:
        _plan(GPU_NODE if gpus else TWO_CPUS, *items, gpus=gpus)
    assert str(err.value) == message


def test_the_autoscalers_maximum_decides_what_fits():
    growing = fit.Capacity(now={"CPU": 2.0}, most={"CPU": 2.0, "encode": 4.0}, largest_node_cpus=2.0)
    _, vae, _ = _plan(growing, "cache.vae_actors=4", "cache.actor_resources={encode: 1}", "cache.actor_cpus=0.25")
    assert vae == fit.PoolSize(1, 4, 4)
    with pytest.raises(fit.FitError, match=r"cache.vae_actors=5 x cache.actor_resources.encode=1 > 4 encode at the"):
        _plan(growing, "cache.vae_actors=5", "cache.actor_resources={encode: 1}", "cache.actor_cpus=0.25")
    with pytest.raises(fit.FitError, match="cache.accelerator_type=L4: no such GPU at the autoscaler's maximum"):
        _plan(growing, "cache.accelerator_type=L4")
    # No autoscaler config to read: a resource the cluster lacks may still come, so the request waits for it.
    _, vae, _ = _plan(TWO_CPUS, "cache.vae_actors=2", "cache.actor_resources={encode: 1}", "cache.actor_cpus=0.25")
    assert vae == fit.PoolSize(1, 2, 2)


def test_the_pools_share_the_cluster_by_the_joint_rule():
    # Room for both pools' actors, one preparation task and both passes' writers (0.25 + 0.25 + 0.5 + 0.5 + 0.5).
    assert _joint(TWO_CPUS, "cache.actor_cpus=0.25", "cache.vae_actors=1") == fit.SIDE_BY_SIDE
    assert _joint(GPU_NODE, "cache.vae_actors=4", "cache.text_actors=4", gpus=True) == fit.SIDE_BY_SIDE
    # No VAE actor ever fits beside the text pool: preparation overlaps the text encoders, the VAE waits.
    assert _joint(TWO_CPUS) == fit.VAE_AFTER_TEXT  # 1.25 CPUs each
    assert _joint(GPU_NODE, gpus=True) == fit.VAE_AFTER_TEXT  # eight text actors on eight GPUs
    # Some VAE actors would fit beside the text pool, not all of them with the tasks: one pass after the other.
    assert _joint(TWO_CPUS, "cache.vae_actors=2") == fit.SEQUENTIAL  # 3 x 0.625 + 1.0 > 2, but 2 x 0.625 fit
    assert _joint(GPU_NODE, "cache.vae_actors=4", "cache.text_actors=5", gpus=True) == fit.SEQUENTIAL
    big = fit.Capacity(now={"CPU": 64.0}, most=None, largest_node_cpus=64.0)
    assert _joint(big) == fit.SEQUENTIAL  # 7 VAE + 1 text actors of 8 CPUs: 64 + 1.0 > 64


def test_one_process_runs_both_passes_where_the_pools_take_the_same_resources_in_turn():
    def one_process(cap: fit.Capacity, *items: str, gpus: bool = False) -> bool:
        return host.wanted(fit.plan(config.load(None, list(items)), gpus, cap))

    assert one_process(TWO_CPUS)  # VAE after text: one 1.25-CPU actor each
    assert one_process(GPU_NODE, gpus=True)  # eight text actors, then eight VAE actors, on the same eight GPUs
    assert not one_process(TWO_CPUS, "cache.actor_cpus=0.25", "cache.vae_actors=1")  # side by side: both at once
    assert not one_process(TWO_CPUS, "cache.vae_actors=2")  # sequential, but two VAE actors and one text actor


@pytest.mark.parametrize(
    "item, message",
    [
        ("cache.vae_actors=0", "cache.vae_actors must be auto or a positive integer"),
        ("cache.text_actors=many", "cache.text_actors must be auto or a positive integer"),
        ("cache.actor_cpus=-1", "cache.actor_cpus must be auto or a positive number"),
        ("cache.gpus_per_actor=0", "cache.gpus_per_actor must be positive"),
        ("cache.gpus_per_actor=1.5", "cache.gpus_per_actor above 1 must be a whole number"),
        ("cache.stall_seconds=0", "cache.stall_seconds must be positive"),
    ],
)
def test_bad_pool_values_name_their_key(item, message):
    with pytest.raises(config.ConfigError, match=message):
        config.load(None, [item])


def test_encoders_use_cuda_only_where_ray_gave_them_a_gpu():
    assert choose_device(cuda_available=True, in_ray_worker=True, ray_gpu_ids=[]) == "cpu"
    assert choose_device(cuda_available=True, in_ray_worker=True, ray_gpu_ids=[3]) == "cuda"
    assert choose_device(cuda_available=True, in_ray_worker=False, ray_gpu_ids=[]) == "cuda"
    assert choose_device(cuda_available=False, in_ray_worker=True, ray_gpu_ids=[0]) == "cpu"


def test_the_vae_encodes_in_bf16_on_gpus_and_on_cpus_that_compute_it_natively():
    import torch

    model = config.ModelConfig()
    assert vae_dtype(model, "cuda") == torch.bfloat16
    assert vae_dtype(model, "cpu", fast_bf16=True) == torch.bfloat16
    assert vae_dtype(model, "cpu", fast_bf16=False) == torch.float32
    # An explicit dtype wins everywhere; model.dtype decides when vae_dtype is left empty.
    assert vae_dtype(config.ModelConfig(vae_dtype="float32"), "cpu", fast_bf16=True) == torch.float32
    assert vae_dtype(config.ModelConfig(dtype="float32"), "cuda") == torch.float32
    assert vae_dtype(config.ModelConfig(vae_dtype="float16"), "cuda") == torch.float16


def test_two_actors_that_cannot_fit_fail_before_any_work(ray_session, job_config):
    from rayflux.job import run

    job_config.cache.vae_actors, job_config.cache.actor_cpus = 2, 1.0
    t0 = time.monotonic()
    with pytest.raises(fit.FitError, match=r"cache.vae_actors=2 x cache.actor_cpus=1 \+ 0.5 CPU .* > 2 CPUs"):
        run(job_config, only="cache")
    assert time.monotonic() - t0 < 60  # the bound: refused at once, not after a wait


def test_two_auto_sized_actors_run_on_two_cpus(ray_session, job_config):
    from rayflux.job import run

    job_config.cache.vae_actors = 2
    summary = run(job_config, only="cache")
    assert summary.cached == summary.discovered > 0
    # Two 0.625-CPU VAE actors and the text actor do not all fit with the tasks, yet one VAE actor would fit beside
    # the text actor: the passes run one after the other.
    passes = generations.load_manifest(summary.cache_dir)["passes"]
    assert passes["encoders"] == fit.SEQUENTIAL and passes["text"]["end"] <= passes["images"]["start"]
    assert not passes["one_process"]  # the pools differ (two VAE actors, one text actor): no one host for both


def _encoder_actors(since_ms: float) -> dict[str, list[tuple[float, float]]]:
    """Each encoder class's actors started since ``since_ms``, as (alive from, dead at) in ms, from the GCS."""
    from ray._private.state import actors

    out: dict[str, list] = {"VaeEncoder": [], "TextEncoder": []}
    for a in actors().values():
        for name, spans in out.items():
            if name in a["ActorClassName"] and a["StartTime"] >= since_ms:
                spans.append((a["StartTime"], a["EndTime"]))
    return out


def test_both_pools_run_at_once_when_they_fit_side_by_side(ray_session, tiny_model, tmp_path):
    images = cache_sets.captioned_pictures(tmp_path, 30)
    cfg = cache_sets.job_config(
        tiny_model,
        images,
        tmp_path,
        "data.resolution=64",
        "cache.actor_cpus=0.25",
        "cache.vae_actors=1",
        "cache.text_batch_size=1",  # 31 encoder calls: the text pass outlasts the VAE actor's start
    )
    since = time.time() * 1000
    _, manifest = cache_sets.build(cfg)
    assert manifest["cached"] == 30 and manifest["encoded"]["captions"] == 31
    passes = manifest["passes"]
    assert passes["encoders"] == fit.SIDE_BY_SIDE
    assert passes["images"]["start"] < passes["text"]["end"] and passes["text"]["start"] < passes["images"]["end"]
    # The two pools' actors were alive at the same time (Ray's own record of them).
    actors = _encoder_actors(since)
    assert len(actors["VaeEncoder"]) == len(actors["TextEncoder"]) == 1
    (vae_start, _), (_, text_end) = actors["VaeEncoder"][0], actors["TextEncoder"][0]
    assert vae_start < text_end


def _task_starts(dashboard: str, name_part: str) -> list[float]:
    """When each Ray task whose name holds ``name_part`` started (ms), from Ray's task events."""
    from ray.util.state import list_tasks

    tasks = list_tasks(address=dashboard, limit=10_000, detail=True, raise_on_missing_output=False)
    return [t.start_time_ms for t in tasks if name_part in (t.name or "") and t.start_time_ms]


def test_images_are_prepared_while_the_text_pool_encodes(ray_session, ray_dashboard, tiny_model, tmp_path):
    """On two CPUs no VAE actor fits beside the text actor, so the VAE waits; preparing the images (decode, bucket,
    crop) needs no encoder and runs during the text pass. It once waited for the whole text pass: the image pass's
    input was made by ``from_arrow``, whose metadata tasks queued behind the text pass's tasks."""
    images = cache_sets.captioned_pictures(tmp_path, 40)
    cfg = cache_sets.job_config(
        tiny_model, images, tmp_path, "data.resolution=64", "cache.text_batch_size=1"
    )  # 41 encoder calls: a text pass of a few seconds
    _, manifest = cache_sets.build(cfg)
    passes = manifest["passes"]
    assert passes["encoders"] == fit.VAE_AFTER_TEXT and manifest["cached"] == 40
    assert passes["one_process"]  # one actor on the pools' resources ran both passes (rayflux.cache.host)
    text_end_ms = passes["text"]["end"] * 1000
    starts = []
    for _ in range(60):  # task events reach the GCS a second or so after the fact
        starts = _task_starts(ray_dashboard, "prepare_in_dataset")
        if starts:
            break
        time.sleep(1)
    assert starts, "no preparation task in Ray's task events"
    assert min(starts) < text_end_ms


def test_a_text_pass_error_stops_the_waiting_image_pass(ray_session, tiny_model, tmp_path):
    """On two CPUs the VAE waits for the text pool; a text shard that fails validation stops the image pass too,
    with no actor (the CPU check after each test) or thread left, and nothing committed. Two captions are one encoder
    call and two shards, queued before the VAE actor can start; 200 images one by one are 200 VAE calls and 200
    shards after it, so the image pass is still at work when the text error comes."""
    images = cache_sets.captioned_pictures(tmp_path, 200, caption="the same caption")
    cfg = cache_sets.job_config(
        tiny_model, images, tmp_path, "data.resolution=64", "cache.batch_size=1", "cache.rows_per_shard=1"
    )
    facts = models.model_facts(cfg.model)
    t5 = facts.text[0]
    wrong = dataclasses.replace(facts, text=(dataclasses.replace(t5, length=t5.length + 1), *facts.text[1:]))
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(CacheShapeError) as err:
        cache_sets.build(cfg, facts=wrong)
    assert f"{t5.name} length expected {t5.length + 1}, got {t5.length}" in str(err.value)
    assert "the image pass was stopped because of this error" in getattr(err.value, "__notes__", [])
    assert {t.name for t in threading.enumerate()} <= before
    assert not list((tmp_path / "cache").rglob(generations.MANIFEST))


def _pending_text_actors(dashboard: str) -> int:
    from ray.util.state import list_actors

    actors = list_actors(address=dashboard, limit=10_000, raise_on_missing_output=False)
    return sum(
        any(k in (a.class_name or "") for k in ("TextEncoder", "EncoderHost"))
        and a.state in ("PENDING_CREATION", "DEPENDENCIES_UNREADY")
        for a in actors
    )


def test_a_stage_that_cannot_be_scheduled_fails_with_what_is_pending(ray_session, ray_dashboard, job_config):
    from rayflux.job import run

    # A custom resource no node has and no autoscaler to add it: accepted, then never scheduled.
    job_config.cache.actor_resources = {"nowhere": 1}
    job_config.cache.stall_seconds = 4
    with pytest.raises(CacheStallError) as err:
        run(job_config, only="cache")
    message = str(err.value)
    assert "no progress for 4 s (cache.stall_seconds)" in message
    # The pending encoder: the text pool's actor, or the host that would run both passes (rayflux.cache.host).
    assert "TextEncoder" in message or "EncoderHost (text then VAE encoder): 1 of 1 not started" in message
    assert "free {" in message
    assert "\n" not in message
    # Ray Data shut the stage down: none of its actors keeps waiting for the resource.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _pending_text_actors(ray_dashboard):
        time.sleep(0.5)
    assert _pending_text_actors(ray_dashboard) == 0
