"""``train.base_dtype``: fp8 and nf4 refused in one line wherever they cannot run (config, driver, worker), the fp8
module filter that never touches a LoRA layer, and a LoRA file that does not depend on the base's precision."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from rayflux import config, job, models
from rayflux.config.base_dtype import refusal, shardable
from rayflux.config.placement import Cluster, validate_for_cluster
from rayflux.train.adapter import base_weights, lora
from rayflux.train.trainer import LoraTrainer


@pytest.mark.parametrize("dtype", ["fp8", "nf4"])
def test_the_refusal_reasons(dtype):
    assert refusal(dtype, gpu=True, capability=(9, 0)) == ""
    assert "needs a CUDA GPU" in refusal(dtype, gpu=False)
    extra = {"fp8": "rayflux[fp8]", "nf4": "rayflux[nf4]"}[dtype]
    missing = refusal(dtype, gpu=True, capability=(9, 0), installed=False)
    assert missing.startswith(f"train.base_dtype={dtype} needs ") and extra in missing
    assert "train.workers.base_fsdp=node" in refusal(dtype, gpu=True, sharding="node")
    assert refusal("bf16", gpu=False, sharding="node") == ""
    assert not shardable(dtype) and shardable("bf16")
    for reason in (refusal(dtype, gpu=False), missing):
        assert "\n" not in reason


def test_fp8_needs_compute_capability_8_9():
    assert "compute capability 8.9 or more" in refusal("fp8", gpu=True, capability=(8, 0))
    assert "this GPU is 8.6" in refusal("fp8", gpu=True, capability=(8, 6))
    assert refusal("fp8", gpu=True, capability=(8, 9)) == ""
    assert refusal("nf4", gpu=True, capability=(8, 0)) == ""  # bitsandbytes' NF4 runs on older GPUs too


@pytest.mark.parametrize("dtype", ["fp8", "nf4"])
def test_the_config_refuses_what_it_can_know(dtype):
    with pytest.raises(config.ConfigError, match=f"train.base_dtype={dtype} needs a CUDA GPU"):
        config.load(None, [f"train.base_dtype={dtype}", "train.workers.on_gpu=false"])
    with pytest.raises(config.ConfigError, match=f"train.base_dtype={dtype} with train.workers.base_fsdp=node"):
        config.load(None, [f"train.base_dtype={dtype}", "train.workers.base_fsdp=node"])
    assert config.load(None, [f"train.base_dtype={dtype}"]).train.base_dtype == dtype  # GPUs may still come


@pytest.mark.parametrize("dtype", ["fp8", "nf4"])
def test_the_driver_refuses_a_cluster_without_gpus(dtype):
    cfg = config.load(None, [f"train.base_dtype={dtype}"])
    with pytest.raises(ValueError, match=f"train.base_dtype={dtype} needs a CUDA GPU"):
        validate_for_cluster(cfg, Cluster(gpus=False))
    validate_for_cluster(cfg, Cluster(gpus=True))
    # An accelerator type asks for GPU workers before the autoscaler has started any.
    validate_for_cluster(
        config.load(None, [f"train.base_dtype={dtype}", "train.workers.accelerator_type=H100"]), Cluster(False)
    )


@pytest.mark.parametrize("key, value", [("base_dtype", "nf4"), ("optim.name", "adamw8bit")])
def test_the_job_refuses_before_any_cache_work(ray_session, job_config, key, value):
    config.apply(job_config, {"train": {key: value}})  # train.optim.name=adamw8bit: 8-bit kernels need CUDA too
    with pytest.raises(ValueError, match=f"train.{key}={value} needs a CUDA GPU"):
        job.run(job_config)
    cache = Path(job.resolve_dirs(job_config)[1])
    assert not cache.exists() or not any(cache.iterdir())


@pytest.mark.parametrize("dtype", ["fp8", "nf4"])
def test_a_worker_refuses_at_load_on_cpu(tmp_path, dtype):
    # A model.path that does not exist: loading first would fail on it; the refusal comes before any load.
    cfg = config.load(None, [f"model.path={tmp_path / 'absent'}", f"train.base_dtype={dtype}"])
    with pytest.raises(RuntimeError, match=f"^train.base_dtype={dtype} needs a CUDA GPU"):
        LoraTrainer(cfg, "cpu", total_steps=1)


def test_nf4_loads_through_a_bitsandbytes_config():
    pytest.importorskip("bitsandbytes", reason="the nf4 extra is not installed here")
    q = base_weights.load_kwargs("nf4")["quantization_config"]
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_compute_dtype == torch.bfloat16


def test_only_nf4_changes_the_load():
    assert base_weights.load_kwargs("bf16") == {} and base_weights.load_kwargs("fp8") == {}


def _tiny_with_lora(tiny_model):
    cfg = config.load(None, [f"model.path={tiny_model}"])
    transformer = models.load_transformer(cfg.model, "cpu", torch.float32)
    lora.add_lora(transformer, 4, 4, "all")
    return transformer


def test_the_fp8_filter_takes_frozen_base_linears_and_never_a_lora_layer(tiny_model):
    transformer = _tiny_with_lora(tiny_model)
    linears = {n: m for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    chosen = {n for n, m in linears.items() if base_weights.fp8_target(m, n)}
    lora_layers = {n for n in linears if ".lora_A." in n or ".lora_B." in n}
    assert lora_layers and not chosen & lora_layers
    assert any(n.endswith("to_q.base_layer") for n in chosen)
    for n in set(linears) - lora_layers - chosen:  # left out only for widths fp8 matmuls cannot take
        assert linears[n].in_features % 16 or linears[n].out_features % 16, n
    assert base_weights.convert(transformer, "bf16") == 0
    with pytest.raises(ValueError, match="train.base_dtype=nf4 quantizes the transformer as it loads"):
        base_weights.convert(transformer, "nf4")  # never trained as bf16 under an nf4 label


def test_base_counts_count_the_base_and_not_the_lora(tiny_model):
    transformer = _tiny_with_lora(tiny_model)
    counts = base_weights.counts(transformer)
    trainable = sum(p.numel() for p in transformer.parameters() if p.requires_grad)
    assert counts.total + trainable == sum(p.numel() for p in transformer.parameters())
    base_linear = [
        m.weight.numel()
        for n, m in transformer.named_modules()
        if isinstance(m, torch.nn.Linear) and not base_weights.is_lora(n)
    ]
    assert counts.linear == sum(base_linear) < counts.total and counts.largest_linear == max(base_linear)
    blocks = [
        sum(p.numel() for p in b.parameters() if not p.requires_grad)
        for b in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    ]
    assert counts.largest_block == max(blocks)
    bare = models.load_transformer(config.ModelConfig(path=str(tiny_model)), "cpu", torch.float32)
    assert base_weights.counts(bare) == counts  # the adapter changes none of them


def test_the_lora_file_does_not_depend_on_the_base_dtype(tiny_model, tmp_path):
    """The saved keys and dtypes come from the fp32 LoRA layers alone: a base held in another dtype writes the
    same file, and it loads into an adapter on the full-precision base."""
    from safetensors.torch import load_file

    files = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        torch.manual_seed(0)
        transformer = _tiny_with_lora(tiny_model)
        for n, p in transformer.named_parameters():
            if not p.requires_grad:
                p.data = p.data.to(dtype)
        files[name] = load_file(str(lora.save_diffusers(transformer, tmp_path / name)))
    assert files["fp32"].keys() == files["bf16"].keys() and files["fp32"]
    assert {v.dtype for v in files["bf16"].values()} == {torch.float32}
    for k in files["fp32"]:
        assert torch.equal(files["fp32"][k], files["bf16"][k]), k
    fresh = _tiny_with_lora(tiny_model)
    lora.load_into(fresh, tmp_path / "bf16" / lora.WEIGHT_NAME)


def test_the_job_prints_its_base_dtype_at_start(tiny_model, caplog):
    cfg = config.load(None, [f"model.path={tiny_model}"])
    with caplog.at_level(logging.INFO, logger="rayflux.train.trainer"):
        LoraTrainer(cfg, "cpu", total_steps=1)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("frozen base:"))
    assert "train.base_dtype=bf16 (4.00 bytes a parameter" in line and "train.workers.base_fsdp=none" in line


def test_an_fp8_base_trains_the_lora_alone_and_saves_the_bf16_runs_file(tiny_model, tmp_path):
    """torchao's fp8 emulation on CPU: the swapped base stays frozen, the LoRA layers stay fp32 Linear layers and get
    gradients, and the LoRA file has the keys and dtypes of the same adapter on a plain base."""
    pytest.importorskip("torchao.float8", reason="the fp8 extra (torchao) is not installed here")
    from safetensors.torch import load_file

    from rayflux import families
    from rayflux.train import step

    torch.manual_seed(0)
    plain = _tiny_with_lora(tiny_model)
    torch.manual_seed(0)
    fp8 = _tiny_with_lora(tiny_model)
    swapped = base_weights.convert(fp8, "fp8", emulate=True)
    assert swapped == sum(base_weights.fp8_target(m, n) for n, m in plain.named_modules()) > 0
    kinds = {type(m).__name__ for n, m in fp8.named_modules() if ".lora_A." in n or ".lora_B." in n}
    assert kinds == {"Linear"}

    family, (c, side) = families.of_transformer(fp8), (4, 8)
    text = {"t5": torch.randn(1, 512, 32), "clip_pooled": torch.randn(1, 32)}
    batch = step.Batch(torch.randn(1, c, side, side), text, 0)
    cfg = config.load(None, ["train.flow.sigma_sampling=uniform"]).train
    with torch.autocast("cpu", torch.bfloat16):
        loss = step.flow_loss(fp8, batch, cfg, True, None, step.Runtime("cpu", torch.float32, family))
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in fp8.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for n, g in grads.items() if ".lora_A." in n)
    assert all(p.grad is None for p in fp8.parameters() if not p.requires_grad)

    saved = {
        name: load_file(str(lora.save_diffusers(model, tmp_path / name)))
        for name, model in (("plain", plain), ("fp8", fp8))
    }
    assert saved["plain"].keys() == saved["fp8"].keys()
    assert {v.dtype for v in saved["fp8"].values()} == {torch.float32}
    lora.load_into(_tiny_with_lora(tiny_model), tmp_path / "fp8" / lora.WEIGHT_NAME)
