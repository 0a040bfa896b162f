"""Encoder pools sized to the cluster, a request that cannot fit refused before any work, and a stalled stage failed.

The sizing tests give :mod:`rayflux.cache.fit` cluster capacities directly (a p5-like GPU node, an autoscaler's
maximum); the others run the real job on the session's 2-CPU local Ray.
"""

from __future__ import annotations

import time

import pytest

from rayflux import config
from rayflux.cache import fit
from rayflux.cache.encoders import threads_for
from rayflux.cache.stall import CacheStallError
from rayflux.models import choose_device, vae_dtype

TWO_CPUS = fit.Capacity(now={"CPU": 2.0}, most=None, largest_node_cpus=2.0)
GPU_NODE = fit.Capacity(now={"CPU": 16.0, "GPU": 8.0}, most=None, largest_node_cpus=16.0)


def _plan(cap: fit.Capacity, *items: str, gpus: bool = False):
    return fit.plan(config.load(None, list(items)), gpus, cap)


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
        (["cache.vae_actors=2", "cache.actor_cpus=1.0"], False,
         "cache.vae_actors=2 x cache.actor_cpus=1 + 0.5 CPU for preparation + 0.25 for writing > 2 CPUs in the cluster"),
        (["cache.text_actors=9"], True, "cache.text_actors=9 x cache.gpus_per_actor=1 > 8 GPU in the cluster"),
        (["cache.vae_actors=3", "cache.gpus_per_actor=4"], True,
         "cache.vae_actors=3 x cache.gpus_per_actor=4 > 8 GPU in the cluster"),
        (["cache.vae_actors=1", "cache.actor_cpus=3"], False,
         "cache.vae_actors=1 x cache.actor_cpus=3 + 0.5 CPU for preparation + 0.25 for writing > 2 CPUs in the cluster"),
    ],
)  # fmt: skip
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


@pytest.mark.parametrize(
    "item, message",
    [("cache.vae_actors=0", "cache.vae_actors must be auto or a positive integer"),
     ("cache.text_actors=many", "cache.text_actors must be auto or a positive integer"),
     ("cache.actor_cpus=-1", "cache.actor_cpus must be auto or a positive number"),
     ("cache.gpus_per_actor=0", "cache.gpus_per_actor must be positive"),
     ("cache.gpus_per_actor=1.5", "cache.gpus_per_actor above 1 must be a whole number"),
     ("cache.stall_seconds=0", "cache.stall_seconds must be positive")],
)  # fmt: skip
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


def _pending_text_actors(dashboard: str) -> int:
    from ray.util.state import list_actors

    actors = list_actors(address=dashboard, limit=10_000, raise_on_missing_output=False)
    return sum("TextEncoder" in (a.class_name or "") and a.state in ("PENDING_CREATION", "DEPENDENCIES_UNREADY")
               for a in actors)  # fmt: skip


def test_a_stage_that_cannot_be_scheduled_fails_with_what_is_pending(ray_session, ray_dashboard, job_config):
    from rayflux.job import run

    # A custom resource no node has and no autoscaler to add it: accepted, then never scheduled.
    job_config.cache.actor_resources = {"nowhere": 1}
    job_config.cache.stall_seconds = 4
    with pytest.raises(CacheStallError) as err:
        run(job_config, only="cache")
    message = str(err.value)
    assert "no progress for 4 s (cache.stall_seconds)" in message
    assert "TextEncoder" in message and "free {" in message
    assert "\n" not in message
    # Ray Data shut the stage down: none of its actors keeps waiting for the resource.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _pending_text_actors(ray_dashboard):
        time.sleep(0.5)
    assert _pending_text_actors(ray_dashboard) == 0
