"""``benchmarks/bench_gpu.py --dry-run``: every section of the GPU benchmark runs on CPU with tiny shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_benchmark_runs_dry_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "benchmarks/bench_gpu.py", "--dry-run", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["device"] == "cpu"
    assert [(r["px"], r["batch"], r["checkpointing"]) for r in results["lora_step"]] == [(64, 1, False), (64, 2, True)]
    for row in results["lora_step"]:
        assert row["steps_per_s"] > 0 and row["bare_s_per_step"] > 0 and row["job_over_bare"] > 0
    assert [v["processes"] for v in results["vae"]] == [1, 2] and all(v["images_per_s"] > 0 for v in results["vae"])
    assert results["text"]["captions_per_s"] > 0
