"""The job as a user runs it, for the benchmarks that time it (bench_train on CPU, bench_gpu's job section).

``python jobs/train_flux.py`` runs in a subprocess with ``--set`` overrides: the cache is built once (not timed),
then the job is run with different ``train.max_steps`` and its train stage's wall time is read from the run's
ledger, so the worker group's start-up, the model load and the first read cancel out of the difference.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "train_flux.py"


def _run_job(args: list[str], settings: list[str], timeout: float) -> None:
    argv = [sys.executable, str(JOB), *args]
    for s in settings:
        argv += ["--set", s]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
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
    from rayflux.train import batching

    cfg = _config(common)
    refs = batching.index_samples(manifest)
    planned = batching.plan_epoch(refs, cfg.train.batch_size, cfg.train.seed, 0, 1)[0]
    return [batching.load_batch({**b, "step": i + 1, "total_steps": len(planned)}) for i, b in enumerate(planned)]


def job_train_seconds(work: Path, name: str, steps: int, common: list[str], timeout: float = 1800) -> float:
    """Run the job with ``train.max_steps=steps`` into a fresh run directory; the train stage's wall seconds."""
    out = work / name
    _run_job([], [f"run.output_dir={out}", f"train.max_steps={steps}", *common], timeout)
    stages = {s["name"]: s for s in json.loads((out / "ledger.json").read_text())["stages"]}
    return stages["train:seg0"]["end"] - stages["train:seg0"]["start"]


def _config(common: list[str]):
    from rayflux import config

    return config.load(None, common)
