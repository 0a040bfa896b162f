"""A sweep of K trials (``rayflux sweep``) against K separate runs of the job on the same machine: wall time, encoder
passes and bytes read.

    python benchmarks/bench_sweep.py [--images 32] [--resolution 256] [--steps 20] [--trials 4] [--concurrent 2]
        [--arms sweep,separate,shared]

The same K LoRAs are trained three ways (a grid of 2 learning rates x K/2 ranks; the ``fifo`` scheduler, so every
trial trains all its steps and the three do the same training):

- **sweep**: ``python -m rayflux sweep``: one cache build, then the K trials, ``--concurrent`` at a time, in one Ray;
- **separate runs**: ``jobs/train_flux.py`` K times, one after another, with the job's defaults: each run has its own
  output folder and so its own cache (``cache.dir`` defaults to ``<run.output_dir>/cache``);
- **separate runs, one cache.dir**: the same K runs sharing a ``cache.dir``: the first encodes, the rest reuse it.

Every run has its own Ray (``run.ray_address=local``), one worker, the tiny FLUX.1 model, generated captioned images
(bench_cold's), an eval loss every half of the steps on 2 held-out images (the sweep's metric, so the separate runs
compute it too). Encoder passes are the cache builds the ledgers record (a ``cache:g0`` stage that did not reuse a
generation). Bytes read are the image and caption files each build reads, plus training's reads of the cache (the
step logs' ``read_bytes``).

For the sweep, the handover between trials: for each trial that waited for a slot, the seconds from the end of the
trial whose slot it took (its ``trial.json`` ``finished``) to its own start (its job's first stage, in its ledger),
and to the end of its first training step (the wall time TensorBoard records with ``train/loss`` at step 1); the
medians are printed, with how many trials ran in an earlier trial's process (Tune's ``reuse_actors``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _job(args, images: Path) -> dict:
    """The job config every arm shares (as a nested mapping, the sweep file's shape)."""
    from rayflux.testing.tiny import ensure_tiny_model

    return {
        "model": {"path": str(ensure_tiny_model())},
        "data": {"images_dir": str(images), "resolution": args.resolution, "eval_samples": 2},
        "train": {"num_workers": 1, "max_steps": args.steps, "eval_every": max(1, args.steps // 2)},
        "run": {"ray_address": "local"},
    }


def _grid(trials: int) -> tuple[list[float], list[int]]:
    return [1.0e-4, 1.0e-3], [2 * (i + 1) for i in range(trials // 2)]


def _settings(job: dict) -> list[str]:
    return [f"{section}.{k}={v}" for section, values in job.items() for k, v in values.items()]


def _run(argv: list[str], timeout: float = 3600) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRANSFORMERS_VERBOSITY": "error"}
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(argv)}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def _ledger(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "ledger.json").read_text())["stages"]


def _builds(run_dirs: list[Path]) -> int:
    """Cache builds across these run folders: ``cache:g0`` stages that encoded (did not reuse a generation)."""
    return sum(1 for d in run_dirs for s in _ledger(d) if s["name"] == "cache:g0" and not s.get("reused"))


def _train_bytes(run_dirs: list[Path]) -> int:
    total = 0
    for d in run_dirs:
        for log in (d / "metrics").glob("steps*.jsonl"):
            total += sum(json.loads(x).get("read_bytes", 0) for x in log.read_text().splitlines() if x.strip())
    return total


def _first_step(run_dir: Path) -> float | None:
    """The wall time of a run's first training step (``train/loss`` at step 1 in its TensorBoard events)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    times = [
        event.wall_time
        for events in (run_dir / "tensorboard").glob("events.out.tfevents.*")
        for event in EventFileLoader(str(events)).Load()
        if event.step == 1 and any(v.tag == "train/loss" for v in event.summary.value)
    ]
    return min(times) if times else None


def handovers(sweep_dir: Path, trials: list[Path], concurrent: int) -> dict:
    """The gaps between a trial's end and the start (and the first step) of the trial that took its slot: the
    trials in order of start, the ``concurrent`` first ones took free slots; each later one took the slot of the
    earliest end not yet taken."""
    import statistics

    # A trial starts where its job's first stage starts (its ledger), the same in every version of trial.json.
    info = [json.loads((t / "trial.json").read_text()) | {"dir": t, "started": _ledger(t)[0]["start"]} for t in trials]
    starts = sorted(info, key=lambda i: i["started"])
    ends = sorted(i["finished"] for i in info if "finished" in i)
    to_start, to_step = [], []
    for waited, freed in zip(starts[concurrent:], ends):
        to_start.append(waited["started"] - freed)
        step = _first_step(waited["dir"])
        if step is not None:
            to_step.append(step - freed)
    pids = [i.get("pid") for i in info]

    def med(xs: list[float]) -> float | None:
        return round(statistics.median(xs), 2) if xs else None

    stage = next(s for s in _ledger(sweep_dir) if s["name"] == "sweep")
    return {
        "trials_stage_s": round(stage["end"] - stage["start"], 1),
        "end_to_start_s": [round(x, 2) for x in to_start],
        "end_to_first_step_s": [round(x, 2) for x in to_step],
        "median_end_to_start_s": med(to_start),
        "median_end_to_first_step_s": med(to_step),
        "trials_in_a_reused_process": len(pids) - len(set(pids)) if None not in pids else None,
    }


def sweep_arm(args, job: dict, work: Path) -> tuple[float, list[Path], list[Path]]:
    rates, ranks = _grid(args.trials)
    out = work / "sweep"
    doc = {
        "sweep": {
            "space": {"train.optim.learning_rate": {"grid": rates}, "train.adapter.rank": {"grid": ranks}},
            "max_concurrent": args.concurrent,
            "scheduler": "fifo",
        },
        **{k: dict(v) for k, v in job.items()},
    }
    doc["run"]["output_dir"] = str(out)
    path = work / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc))
    wall = _run([sys.executable, "-m", "rayflux", "sweep", "--config", str(path)])
    trials = sorted(p for p in (out / "trials").iterdir() if (p / "ledger.json").exists())
    return wall, [out, *trials], trials


def separate_arm(args, job: dict, work: Path, name: str, shared_cache: bool) -> tuple[float, list[Path], list[Path]]:
    rates, ranks = _grid(args.trials)
    runs, wall = [], 0.0
    for i, (lr, rank) in enumerate((lr, rank) for lr in rates for rank in ranks):
        out = work / name / f"run{i}"
        sets = _settings(job) + [
            f"run.output_dir={out}",
            f"train.optim.learning_rate={lr}",
            f"train.adapter.rank={rank}",
        ]
        if shared_cache:
            sets.append(f"cache.dir={work / name / 'cache'}")
        argv = [sys.executable, str(ROOT / "jobs" / "train_flux.py")]
        for s in sets:
            argv += ["--set", s]
        wall += _run(argv)
        runs.append(out)
    return wall, runs, runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=32)
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--trials", type=int, default=4, help="an even number: 2 learning rates x trials/2 ranks")
    p.add_argument("--concurrent", type=int, default=2, help="sweep.max_concurrent")
    p.add_argument("--arms", default="sweep,separate,shared", help="which ways to run (comma-separated)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.trials < 2 or args.trials % 2:
        p.error("--trials must be an even number, 2 or more")
    from bench_cold import write_images

    work = Path(tempfile.mkdtemp(prefix="bench-sweep-"))
    images = write_images(work / "images", args.images)
    image_bytes = sum(f.stat().st_size for f in images.iterdir() if not f.name.startswith("."))
    job = _job(args, images)
    rows, arms, gaps = {}, set(args.arms.split(",")), None
    for key, name, arm in (
        ("sweep", "sweep", lambda: sweep_arm(args, job, work)),
        ("separate", "separate runs", lambda: separate_arm(args, job, work, "separate", False)),
        ("shared", "separate runs, one cache.dir", lambda: separate_arm(args, job, work, "shared", True)),
    ):
        if key not in arms:
            continue
        wall, ledgers, trained = arm()
        if key == "sweep":
            gaps = handovers(ledgers[0], trained, args.concurrent)
            print("sweep handovers", gaps, flush=True)
        builds = _builds(ledgers)
        rows[name] = {
            "wall_s": round(wall, 1),
            "encoder_passes": builds,
            "image_bytes_read": builds * image_bytes,
            "cache_bytes_read_by_training": _train_bytes(trained),
            "loras": len(trained),
        }
        print(name, rows[name], flush=True)
    base = rows[next(iter(rows))]["wall_s"]
    print(f"\n{args.trials} LoRAs, {args.steps} steps each, {args.images} images at {args.resolution} px\n")
    if gaps:
        print(
            f"a trial's end -> the next trial's start: median {gaps['median_end_to_start_s']} s; -> its first step: "
            f"median {gaps['median_end_to_first_step_s']} s ({len(gaps['end_to_start_s'])} handovers, "
            f"{gaps['trials_in_a_reused_process']} trial(s) in a reused process); the trials' stage: "
            f"{gaps['trials_stage_s']} s\n"
        )
    print("| way | wall | vs the first | encoder passes | image bytes read | cache bytes read by training |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['wall_s']:.1f} s | {r['wall_s'] / base:.2f}x | {r['encoder_passes']} | "
            f"{r['image_bytes_read'] / 1e6:.2f} MB | {r['cache_bytes_read_by_training'] / 1e6:.2f} MB |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "handovers": gaps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
