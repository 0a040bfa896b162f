"""Eval-loss cost: one eval (``data.eval_samples`` samples at ``train.eval.sigmas`` σ values) ÷ one training step.

    python benchmarks/bench_eval.py [--resolution 256] [--eval-samples 2] [--steps 24] [--eval-every 4]

Runs ``jobs/train_flux.py`` as a user does (its defaults except 1 worker, ``data.resolution`` and the eval settings)
and reads its step log: ``eval_time`` of every eval (the scoring and its all-reduce, not the best file's write)
against the median ``step_time`` of the training steps (the loop restarts its step clock after an eval, so no step
time includes one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from benchmarks.job_runs import _run_job  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--resolution", type=int, default=256)
    ap.add_argument("--eval-samples", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--eval-every", type=int, default=4)
    args = ap.parse_args()
    from rayflux.train.observe import metrics

    work = Path(tempfile.mkdtemp(prefix="rayflux-bench-eval-"))
    out = work / "run"
    epochs = -(-args.steps // (8 - args.eval_samples)) + 1  # the demo's 8 images, less the held-out ones
    _run_job(
        [],
        [
            "train.workers.num_workers=1",
            f"data.resolution={args.resolution}",
            f"train.epochs={epochs}",
            f"train.max_steps={args.steps}",
            f"data.eval_samples={args.eval_samples}",
            f"train.eval.every={args.eval_every}",
            f"run.output_dir={out}",
            "run.ray_address=local",
        ],
        timeout=3600,
    )
    steps = metrics.read_steps(str(out))
    evals = metrics.read_steps(str(out), evals=True)
    step_ms = statistics.median(s["step_time"] for s in steps[1:]) * 1000  # the first step includes the first read
    eval_ms = [e["eval_time"] * 1000 for e in evals]
    forwards = args.eval_samples * len(evals[0]["eval_loss_sigmas"])
    print(
        f"{args.resolution} px, batch 1: training step {step_ms:.1f} ms (median of {len(steps) - 1}); eval of "
        f"{args.eval_samples} samples x {len(evals[0]['eval_loss_sigmas'])} sigmas: median "
        f"{statistics.median(eval_ms):.1f} ms over {len(eval_ms)} evals ({', '.join(f'{m:.0f}' for m in eval_ms)}); "
        f"eval / step {statistics.median(eval_ms) / step_ms:.2f}; per sample-sigma forward "
        f"{statistics.median(eval_ms) / forwards / step_ms:.2f} of a step"
    )


if __name__ == "__main__":
    main()
