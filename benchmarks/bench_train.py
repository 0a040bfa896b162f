"""Train-stage overhead: wall time per extra optimizer step in the job ÷ the same steps in a plain PyTorch loop.

    python benchmarks/bench_train.py [--short 20] [--long 220] [--resolution 256] [--rounds 2]

Job side: ``jobs/train_flux.py`` as a user runs it, with its defaults except 1 worker and ``data.resolution``, run
twice with different ``train.max_steps``; its train stage's wall time (from the run's ledger) is timed, so the
worker group's start-up, model load and first read cancel out of ``(long - short) / (long_steps - short_steps)``.
Both runs share one cache, built before timing.

Plain side: the same ``LoraTrainer`` steps on the same cached batches, read into memory first, in one process with
torch's default threads (what a user would write), timed the same way: two loops of different lengths, each from a
fresh trainer. Rounds alternate the two sides; medians are reported. The plain loop is also timed on one torch
thread, the thread count a Ray Train worker that reserves less than two CPUs gets (``train.workers.cpus_per_worker``), so
the job's own overhead can be told apart from the thread count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from benchmarks.job_runs import build_cache, cached_batches, job_train_seconds  # noqa: E402


def plain_seconds(cfg, batches: list[dict], steps: int) -> float:
    """A fresh ``LoraTrainer`` (torch's default threads) and ``steps`` optimizer steps over ``batches`` in order."""
    import torch

    from rayflux.train import step
    from rayflux.train.trainer import LoraTrainer

    t0 = time.perf_counter()
    trainer = LoraTrainer(cfg, torch.device("cpu"), steps)
    for i in range(steps):
        trainer.train_step([step.from_item(batches[i % len(batches)])])
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", type=int, default=20, help="train.max_steps of the short runs")
    ap.add_argument("--long", type=int, default=220, help="train.max_steps of the long runs")
    ap.add_argument("--resolution", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    import torch

    from rayflux import config

    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    epochs = -(-args.long // 8) + 1  # the demo's 8 images are 8 steps per epoch on one worker
    # run.ray_address=local: every job starts its own Ray, never joining another head that runs on this machine.
    common = [
        "train.workers.num_workers=1",
        f"data.resolution={args.resolution}",
        f"train.epochs={epochs}",
        f"cache.dir={work / 'cache'}",
        "run.ray_address=local",
    ]
    # Build the shared cache (not timed), and take its batches for the plain loop.
    batches = cached_batches(common, build_cache(work, common))
    cfg = config.load(None, common)

    job, plain, one = [], [], []
    default_threads = torch.get_num_threads()
    for r in range(args.rounds):
        short = job_train_seconds(work, f"short-{r}", args.short, common)
        long = job_train_seconds(work, f"long-{r}", args.long, common)
        job.append((long - short) / (args.long - args.short))
        torch.set_num_threads(default_threads)
        p_short, p_long = plain_seconds(cfg, batches, args.short), plain_seconds(cfg, batches, args.long)
        plain.append((p_long - p_short) / (args.long - args.short))
        torch.set_num_threads(1)
        o_short, o_long = plain_seconds(cfg, batches, args.short), plain_seconds(cfg, batches, args.long)
        one.append((o_long - o_short) / (args.long - args.short))
        print(
            f"round {r}: job {short:.1f}s/{long:.1f}s -> {job[-1] * 1000:.1f} ms/step; "
            f"plain {plain[-1] * 1000:.1f} ms/step; 1 thread {one[-1] * 1000:.1f} ms/step",
            flush=True,
        )
    j, p, o = statistics.median(job), statistics.median(plain), statistics.median(one)
    print(
        f"extra step: job {j * 1000:.1f} ms; plain loop ({default_threads} threads) {p * 1000:.1f} ms, ratio "
        f"{j / p:.3f}; plain loop (1 thread) {o * 1000:.1f} ms, ratio {j / o:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
