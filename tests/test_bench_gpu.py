"""``benchmarks/bench_gpu.py --dry-run``: every section of the GPU benchmark runs on CPU with tiny shapes, the job
section included; its MFU formula counts a frozen base without weight gradients; the job section's model is written
in bf16."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "benchmarks" / "bench_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_model_flops_of_a_frozen_base():
    flops = _bench().model_flops
    # 2 forward + 2 input-gradient FLOPs per frozen parameter and token; a LoRA parameter adds its weight gradient.
    assert flops(frozen=10, trainable=0, tokens=3, checkpointing=False) == 3 * 4 * 10
    assert flops(frozen=10, trainable=1, tokens=3, checkpointing=False) == 3 * (4 * 10 + 6 * 1)
    # Checkpointing runs every forward twice.
    assert flops(frozen=10, trainable=1, tokens=3, checkpointing=True) == 3 * (6 * 10 + 8 * 1)


def test_the_gpu_benchmark_runs_dry_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/bench_gpu.py", "--dry-run", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["device"] == "cpu"
    eager = [r for r in results["lora_step"] if not r["compile"] and not r["token_routing"]]
    rows = {(r["model"], r["px"], r["batch"], r["checkpointing"]): r for r in eager}
    assert set(rows) == {
        ("flux1-dev", 64, 1, False),
        ("flux1-dev", 64, 2, True),
        ("flux2-klein-9b", 64, 1, True),
        ("flux2-dev", 64, 1, True),
    }
    # The train.compile row beside its eager one: GPU only (inductor's CPU compile takes minutes), recorded as such.
    [compiled] = [r for r in results["lora_step"] if r["compile"]]
    assert (compiled["model"], compiled["px"], compiled["checkpointing"]) == ("flux1-dev", 64, False)
    assert compiled["refused"].startswith("train.compile rows run on a GPU only")
    for key in (("flux1-dev", 64, 1, False), ("flux1-dev", 64, 2, True)):
        row = rows[key]
        assert row["steps_per_s"] > 0 and row["bare_s_per_step"] > 0 and row["job_over_bare"] > 0
    assert rows[("flux2-klein-9b", 64, 1, True)]["steps_per_s"] > 0
    # The TREAD row (train.token_routing) beside the plain one of its shape.
    [routed] = [r for r in results["lora_step"] if r["token_routing"]]
    assert (routed["model"], routed["px"], routed["checkpointing"], routed["token_routing"]) == (
        "flux1-dev",
        64,
        False,
        "0.5:0-1",
    )
    assert routed["steps_per_s"] > 0
    # FLUX.2 [dev] runs with an fp8 base, which a CPU refuses in one line rather than training in bf16.
    assert rows[("flux2-dev", 64, 1, True)]["refused"].startswith("train.base_dtype=fp8 needs a CUDA GPU")
    assert [v["processes"] for v in results["vae"]] == [1, 2] and all(v["images_per_s"] > 0 for v in results["vae"])
    assert results["text"]["captions_per_s"] > 0
    # The job section: the tiny model written, the job run twice on its cache, the same steps in-process.
    job = results["job"]
    assert job["px"] == 64 and job["batch"] == 1 and job["blocks"] == [1, 1] and job["max_steps"] == [2, 4]
    assert job["model_gib"] > 0 and job["model_write_s"] >= 0
    assert job["trainer_s_per_step"] > 0 and job["bare_s_per_step"] > 0 and job["checkpointing"] is False
    assert len(job["job_train_s"]) == 2 and all(s > 0 for s in job["job_train_s"])
    # Two runs' start-up dwarfs two steps on CPU, so the difference may come out either way: check only that the
    # figures are the ones derived from the two runs.
    short, long = job["job_train_s"]
    assert abs(job["job_s_per_extra_step"] - (long - short) / 2) < 0.01
    assert abs(job["job_over_trainer"] - job["job_s_per_extra_step"] / job["trainer_s_per_step"]) < 0.01 * max(
        1, abs(job["job_over_trainer"])
    )
    assert abs(job["job_over_bare"] - job["job_s_per_extra_step"] / job["bare_s_per_step"]) < 0.01 * max(
        1, abs(job["job_over_bare"])
    )
    # The short run's way to its first step, phase by phase from its marks: every phase measured, and the total
    # no shorter than its parts, the first read counted beside the model load and the first step it runs during
    # (rayflux/train/loop.py reads the feed's first batch while the model loads).
    first = job["time_to_first_step_s"]
    parts = [k for k in first if k != "time to first step"]
    assert len(parts) == 5 and all(first[k] >= 0 for k in parts), first
    start, group, read, load, step = (first[k] for k in parts)
    assert first["time to first step"] >= start + group + max(read, load + step) - 0.05, first


def test_the_job_sections_model_is_built_and_written_in_bf16(tmp_path):
    from safetensors import safe_open

    from rayflux.testing.tiny import TinySpec, ensure_tiny_model

    # Real widths in bf16 on GPU (23 GiB written); the same writer at tiny widths here.
    spec = _bench().job_spec((19, 38), dry=False)
    assert (spec.num_layers, spec.num_single_layers) == (19, 38)
    assert (spec.attention_head_dim, spec.num_attention_heads, spec.text_dim) == (128, 24, 4096)
    assert spec.dtype == "bfloat16" and spec.flux_vae
    path = ensure_tiny_model(tmp_path / "model", TinySpec(dtype="bfloat16"))
    assert torch.get_default_dtype() == torch.float32  # restored after the build
    floats = set()
    for part in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        for f in (path / part).glob("*.safetensors"):
            with safe_open(str(f), "pt") as h:
                floats |= {h.get_slice(k).get_dtype() for k in h.keys()} & {"F32", "F16", "BF16"}
    assert floats == {"BF16"}
    # The dtype is part of the directory's identity: asking for fp32 there rebuilds it, with the marker fp32 models
    # always had (no dtype key), so directories written before stay current.
    ensure_tiny_model(tmp_path / "model", TinySpec())
    marker = json.loads((path / "rayflux_tiny.json").read_text())
    assert "dtype" not in marker["spec"]
    with safe_open(str(next((path / "transformer").glob("*.safetensors"))), "pt") as h:
        assert {h.get_slice(k).get_dtype() for k in h.keys()} == {"F32"}
