"""The job as a user runs it, for the benchmarks that time it (bench_train on CPU, bench_gpu's job section).

``python jobs/train_flux.py`` runs in a subprocess with ``--set`` overrides: the cache is built once (not timed),
then the job is run with different ``train.max_steps`` and its train stage's wall time is read from the run's
ledger, so the worker group's start-up, the model load and the first read cancel out of the difference.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "train_flux.py"


# (label, start, end) of the way to the first optimizer step, over a run's named Unix times: ``launch`` (this
# process starts the job), the train stage's start from the ledger, and the ``RAYFLUX_PHASES`` marks.
FIRST_STEP = (
    ("job start -> train stage (config, checks, cache reuse)", "launch", "train_start"),
    ("worker group start (Ray Train controller, worker, torch)", "train_start", "worker_start"),
    ("first read (the feed's first batch, read while the model loads)", "worker_start", "first_read_end"),
    ("model load + LoRA", "model_load_start", "model_load_end"),
    ("first step (on a GPU: CUDA's lazy init, kernel selection)", "model_load_end", "step_end"),
    ("time to first step", "launch", "step_end"),
)


def _run_job(args: list[str], settings: list[str], timeout: float, marks: Path | None = None) -> None:
    argv = [sys.executable, str(JOB), *args]
    for s in settings:
        argv += ["--set", s]
    env = {**os.environ, "RAYFLUX_PHASES": str(marks)} if marks else None
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"job failed ({' '.join(args + settings)}): {proc.stderr[-2000:]}")


def build_cache(work: Path, common: list[str], timeout: float = 1800) -> dict:
    """Build the cache ``common`` names (``--only cache``, into ``work/cache-run``); its generation's manifest."""
    from rayflux.cache import generations

    _run_job(["--only", "cache"], [*common, f"run.output_dir={work / 'cache-run'}"], timeout)
    cfg = _config(common)
    [gen_dir] = [p for p in Path(cfg.cache.dir).glob("*/g*") if (p / generations.MANIFEST).exists()]
    return generations.load_manifest(str(gen_dir))


def cached_batches(common: list[str], manifest: dict) -> list[dict]:
    """The first epoch's planned batches of one worker, read from the cache into memory (rows for
    ``rayflux.train.step.from_item``)."""
    from rayflux.train.data import batching

    cfg = _config(common)
    refs = batching.index_samples(manifest)
    planned = batching.plan_epoch(refs, cfg.train.batch_size, cfg.train.seed, 0, 1)[0]
    return [batching.load_batch({**b, "step": i + 1, "total_steps": len(planned)}) for i, b in enumerate(planned)]


def job_train_seconds(work: Path, name: str, steps: int, common: list[str], timeout: float = 1800) -> float:
    """Run the job with ``train.max_steps=steps`` into a fresh run directory; the train stage's wall seconds. The
    launch time and the run's phase marks are kept beside it, for :func:`first_step`."""
    out = work / name
    # Marks go to the file the benchmark's own Ray already names (its workers inherit that Ray's environment, not
    # this job's), else to one of this run's own.
    marks = Path(os.environ.get("RAYFLUX_PHASES") or work / f"{name}.phases")
    launch = time.time()
    _run_job([], [f"run.output_dir={out}", f"train.max_steps={steps}", *common], timeout, marks)
    (work / f"{name}.run.json").write_text(json.dumps({"launch": launch, "exit": time.time(), "marks": str(marks)}))
    stages = {s["name"]: s for s in json.loads((out / "ledger.json").read_text())["stages"]}
    return stages["train:seg0"]["end"] - stages["train:seg0"]["start"]


def first_step(work: Path, name: str) -> dict[str, float]:
    """Seconds of each :data:`FIRST_STEP` phase of the run :func:`job_train_seconds` made as ``name``."""
    run = json.loads((work / f"{name}.run.json").read_text())
    times = {"launch": run["launch"]}
    stages = {s["name"]: s for s in json.loads((work / name / "ledger.json").read_text())["stages"]}
    times["train_start"] = stages["train:seg0"]["start"]
    for line in Path(run["marks"]).read_text().splitlines():
        rec = json.loads(line)
        if run["launch"] <= rec["time"] <= run["exit"]:  # a shared file also holds the other runs' marks
            times.setdefault(rec["phase"], rec["time"])  # the first of each: the first worker's, the first step's
    return {label: round(times[b] - times[a], 2) for label, a, b in FIRST_STEP if a in times and b in times}


def _config(common: list[str]):
    from rayflux import config

    return config.load(None, common)
