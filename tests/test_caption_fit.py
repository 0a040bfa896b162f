"""The captioner pool's fit check (issue 47): sized to the cluster like the encoders, refused with the numbers
when its actors or its model's memory cannot fit. Pure arithmetic over a stated cluster: no Ray."""

import pytest

from rayflux import config
from rayflux.cache.fit import Capacity, FitError
from rayflux.caption import fit

GIB = 2**30


def _caption(*sets: str):
    return config.load(None, list(sets)).caption


def _cap(cpus: float, gpus: float = 0, **extra) -> Capacity:
    now = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **extra}
    return Capacity(now, None, cpus)


def test_one_cpu_actor_by_default_and_one_per_gpu_share():
    pool = fit.size(_caption(), False, None, _cap(2), fit.Memory())
    assert (pool.actors, pool.resources) == (1, {"num_cpus": 1.0})
    pool = fit.size(_caption("caption.gpus_per_actor=0.5"), True, None, _cap(16, 4), fit.Memory())
    assert (pool.actors, pool.resources) == (8, {"num_cpus": 1.0, "num_gpus": 0.5})


def test_actors_that_cannot_fit_are_refused_with_the_keys_and_numbers():
    with pytest.raises(FitError, match=r"caption.actors=3: .* > 2 CPUs in the cluster \(room for 1\)"):
        fit.size(_caption("caption.actors=3"), False, None, _cap(2), fit.Memory())
    with pytest.raises(FitError, match="caption.gpus_per_actor=1 of 2 GPUs"):
        fit.size(_caption("caption.actors=3"), True, None, _cap(16, 2), fit.Memory())
    with pytest.raises(FitError, match="caption.accelerator_type=H100: no such GPU"):
        fit.size(_caption("caption.accelerator_type=H100"), True, None, _cap(16, 2), fit.Memory())


def test_the_model_memory_is_counted_from_its_weights(tmp_path):
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"a": np.zeros((3, 5), np.float32), "b": np.zeros(7, np.float16)}, str(tmp_path / "model.safetensors"))
    save_file({"c": np.zeros((2, 2, 2), np.float32)}, str(tmp_path / "model-2.safetensors"))
    assert fit.parameters(str(tmp_path)) == 15 + 7 + 8
    assert fit.needed_bytes(str(tmp_path), "bfloat16") == int(30 * 2 * fit.MARGIN)
    assert fit.parameters("org/some-hub-id") is None  # unknown: not refused, Ray's own limits apply
    # A 7B VLM in bf16 (about 15.6 GiB with the margin) fits a 24 GiB L4, not half of one.
    need = int(7e9 * 2 * fit.MARGIN)
    c = _caption("caption.model=Qwen/Qwen2.5-VL-7B-Instruct")
    assert fit.size(c, True, need, _cap(8, 1), fit.Memory(gpu=24 * GIB), "bfloat16").actors == 1
    half = _caption("caption.model=Qwen/Qwen2.5-VL-7B-Instruct", "caption.gpus_per_actor=0.5")
    with pytest.raises(FitError, match=r"needs about 15.6 GiB in bfloat16 .* 24 GiB GPU gives \(12.0 GiB\)"):
        fit.size(half, True, need, _cap(8, 1), fit.Memory(gpu=24 * GIB), "bfloat16")
    with pytest.raises(FitError, match=r"15.6 GiB in bfloat16 on CPU, more than the largest node's 8.0 GiB"):
        fit.size(c, False, need, _cap(8), fit.Memory(largest_node=8 * GIB), "bfloat16")


def test_the_caption_section_changes_no_existing_identity_until_it_is_used():
    from rayflux.job import run_identity

    base = config.load(None, [])
    same = config.load(None, ["caption.batch_size=2", "caption.actors=1"])  # resources: no identity
    assert run_identity(same) == run_identity(base)  # the defaults and their fingerprint(): test_config_sections
    prompt = config.load(None, ["caption.prompt=Say the colours."])
    assert run_identity(prompt) != run_identity(base)
    assert prompt.fingerprint("data", "model", "cache") == base.fingerprint("data", "model", "cache")
    assert config.load(None, ["data.caption_strategy=vlm"]).data.caption_strategy == "vlm"
    assert config.load(None, ["data.missing_caption=vlm"]).data.missing_caption == "vlm"
    for bad, match in (
        ("caption.dtype=int8", "caption.dtype must be one of auto, float32, bfloat16, float16"),
        ("caption.gpus_per_actor=1.5", "caption.gpus_per_actor must be a fraction"),
        ("caption.max_new_tokens=0", "caption.max_new_tokens must be positive"),
    ):
        with pytest.raises(config.ConfigError, match=match):
            config.load(None, [bad])
