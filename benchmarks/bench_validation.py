"""Validation renders against training: per-step wall time of a 2-worker run that renders every N steps, as a ratio
to the same run without validation.

    python benchmarks/bench_validation.py [--code DIR] [--work DIR] [--every 4] [--steps 16] [--resolution 64]

Runs ``DIR/jobs/train_flux.py`` (default: this tree; give an older checkout, e.g. one whose rank 0 renders inside
the loop, to compare) as a user does: the demo images and embedded tiny model, 2 workers, batch 1, once without and
once with validation images. The per-step wall time is read from rank 0's TensorBoard ``train/loss`` events (their
wall clock): from the first step to the last, over the steps between, so start-up, the model load and the first
read stay out, and a render inside the loop (every ``--every`` steps) is in. ``--work``: reuse a folder's cache.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def step_seconds(code: Path, out: Path, settings: list[str]) -> float:
    """Run ``code``'s job into ``out``; its per-step wall seconds from rank 0's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    argv = [sys.executable, str(code / "jobs" / "train_flux.py")]
    for s in [f"run.output_dir={out}", *settings]:
        argv += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(code), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env, cwd=code)
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({' '.join(settings)}): {proc.stderr[-2000:]}")
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    loss = events.Scalars("train/loss")
    grids = sorted((out / "validation").glob("step-*.png"))
    during = sum(g.stat().st_mtime < loss[-1].wall_time for g in grids)
    if grids:
        print(f"{out.name}: {len(grids)} grids, {during} of them written before the last step")
    return (loss[-1].wall_time - loss[0].wall_time) / (loss[-1].step - loss[0].step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", type=Path, default=ROOT)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--resolution", type=int, default=64)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="rayflux-bench-validation-"))
    epochs = -(-args.steps // 4) + 1  # the demo's 8 images are 4 steps per epoch on 2 workers
    common = [
        "train.workers.num_workers=2",
        f"data.resolution={args.resolution}",
        f"train.epochs={epochs}",
        f"cache.dir={work / 'cache'}",
        "run.ray_address=local",
    ]
    images = [
        'train.validation.prompts=["a red circle", "a blue square"]',
        f"train.validation.every={args.every}",
        "train.validation.inference_steps=4",
    ]
    run = tempfile.mkdtemp(prefix="run-", dir=work)
    per_step = {}
    for label, extra in (("off", []), ("on", images)):
        per_step[label] = step_seconds(args.code, Path(run) / label, [*common, *extra, f"train.max_steps={args.steps}"])
    print(
        f"code {args.code}: {args.resolution} px, 2 workers, validation every {args.every} steps: per-step wall "
        f"{per_step['off'] * 1000:.0f} ms without validation, {per_step['on'] * 1000:.0f} ms with it; ratio "
        f"{per_step['on'] / per_step['off']:.2f}"
    )


if __name__ == "__main__":
    main()
