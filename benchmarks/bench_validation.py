"""Validation renders against training: per-step wall time of a 2-worker run that renders every N steps, as a ratio
to the same run without validation.

    python benchmarks/bench_validation.py [--code DIR] [--every 4] [--short 4] [--long 12] [--resolution 64]

Runs ``DIR/jobs/train_flux.py`` (default: this tree; give an older checkout, e.g. one whose rank 0 renders inside
the loop, to compare) as a user does: the demo images and embedded tiny model, 2 workers, batch 1. The per-step
wall time is the train stage's wall time at ``--long`` steps less that at ``--short`` steps, over the difference
(:func:`benchmarks.job_runs.job_train_seconds`), so start-up, model loads and the wait for the last render cancel out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_seconds(code: Path, out: Path, settings: list[str]) -> float:
    """Run ``code``'s job into ``out``; the train stage's wall seconds from its ledger."""
    argv = [sys.executable, str(code / "jobs" / "train_flux.py")]
    for s in [f"run.output_dir={out}", *settings]:
        argv += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(code), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env, cwd=code)
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({' '.join(settings)}): {proc.stderr[-2000:]}")
    stages = [s for s in json.loads((out / "ledger.json").read_text())["stages"] if s["name"].startswith("train")]
    return sum(s["end"] - s["start"] for s in stages)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", type=Path, default=ROOT)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--short", type=int, default=4)
    ap.add_argument("--long", type=int, default=12)
    ap.add_argument("--resolution", type=int, default=64)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rayflux-bench-validation-"))
    epochs = -(-args.long // 4) + 1  # the demo's 8 images are 4 steps per epoch on 2 workers
    common = ["train.num_workers=2", f"data.resolution={args.resolution}", f"train.epochs={epochs}",
              f"cache.dir={work / 'cache'}", "run.ray_address=local"]  # fmt: skip
    images = ["train.validation_prompts=[\"a red circle\", \"a blue square\"]", f"train.validation_every={args.every}",
              "train.validation_inference_steps=4"]  # fmt: skip
    train_seconds(args.code, work / "cache-run", [*common, "train.max_steps=1"])  # builds the cache (not timed)
    per_step = {}
    for label, extra in (("off", []), ("on", images)):
        short = train_seconds(args.code, work / f"{label}-short", [*common, *extra, f"train.max_steps={args.short}"])
        long = train_seconds(args.code, work / f"{label}-long", [*common, *extra, f"train.max_steps={args.long}"])
        per_step[label] = (long - short) / (args.long - args.short)
    print(f"code {args.code}: {args.resolution} px, 2 workers, validation every {args.every} steps: per-step wall "
          f"{per_step['off'] * 1000:.0f} ms without validation, {per_step['on'] * 1000:.0f} ms with it; ratio "
          f"{per_step['on'] / per_step['off']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
