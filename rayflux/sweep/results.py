"""The sweep's results: one row per trial, written as ``sweep/results.parquet`` and ``.csv``, and the best LoRA.

Each row is read from the trial's run directory (its step log, best LoRA and ``trial.json``) and Tune's last result for
it, so a sweep restored after an interruption tabulates every trial, the ones trained before the interruption
included. The driver reads it only once nothing of the trial can write there any more (:mod:`rayflux.sweep.seal`).
A trial's best eval loss is the one its best LoRA file records with its tensors: each new lowest eval writes that
file before the step is logged, so no eval in the log beats it, and a worker ended in between (a stopped trial's
are ended wherever they are) leaves an eval only that file records.
"""

from __future__ import annotations

import io
import logging
import os
from dataclasses import dataclass

from rayflux import storage
from rayflux.sweep import trial as trial_mod

log = logging.getLogger("rayflux")

RESULTS_DIR = "sweep"
BEST_LORA = "best.safetensors"
"""In the sweep's ``lora/``: a copy of the best trial's lowest-metric LoRA."""


@dataclass
class Row:
    """One trial's line of the table."""

    trial: str
    """Tune's trial id; its run directory is ``trials/<trial>``."""
    settings: dict
    """``train.key -> value`` of this trial."""
    status: str
    """``finished`` (trained to its end and exported), ``stopped`` (the scheduler stopped it) or ``error``."""
    best: float | None
    """The lowest value of the sweep's metric this trial reached (None: never scored)."""
    best_step: int | None
    """The step of that value; the trial's ``lora/<name>-best.safetensors`` holds the LoRA of that step."""
    stopped_at: int | None
    """For a stopped trial: the last step it reported before the scheduler stopped it."""
    steps: int
    """The last step the trial's step log recorded."""
    wall_seconds: float
    """Time Tune counted for the trial's function (every attempt)."""
    lora: str
    """The exported LoRA of a finished trial; else its best LoRA so far ("" when none was written)."""
    best_lora: str
    """The LoRA of the trial's best step ("" when none was written)."""
    error: str = ""
    """The first line of a failed trial's error."""

    def record(self, metric: str) -> dict:
        d = {
            "trial": self.trial,
            **self.settings,
            "status": self.status,
            f"best_{metric}": self.best,
            "best_step": self.best_step,
            "stopped_at": self.stopped_at,
            "steps": self.steps,
            "wall_seconds": round(self.wall_seconds, 1),
            "lora": self.lora,
            "error": self.error,
        }
        return d


def trial_id_of(result) -> str:
    """The trial id of a Tune ``Result``: the name of its trial folder (see ``trial_dirname_creator``)."""
    return os.path.basename(str(result.path).rstrip("/"))


def row(result, base, sweep_output: str, metric: str) -> Row:
    """The row of one Tune ``Result``: its run directory (named by the trial id, see ``trial_dirname_creator``)."""
    from rayflux.sweep.config import trial_job
    from rayflux.train.adapter import lora_files
    from rayflux.train.observe import metrics

    trial_id = trial_id_of(result)
    out = trial_mod.trial_dir(sweep_output, trial_id)
    settings = dict(result.config or {})
    info = trial_mod.read(out)
    cfg = trial_job(base, settings, out)
    scored = [r for r in metrics.read_steps(out, evals=metric == "eval_loss") if metric in r]
    logged = metrics.read_steps(out)
    best = min(scored, key=lambda r: r[metric]) if scored else None
    best_lora = storage.join(out, lora_files.LORA_DIR, lora_files.best_name(cfg))
    best_lora = best_lora if storage.exists(best_lora) else ""
    recorded = lora_files.best_recorded(best_lora) if best_lora and metric == "eval_loss" else None
    if recorded:  # the eval of the LoRA the trial hands out, which no eval in its log beats (written before each)
        best = {"step": recorded[0], metric: recorded[1]}
    error = str(result.error).strip().splitlines()[-1] if result.error else ""
    status = "finished" if "finished" in info else "error" if result.error else "stopped"
    last = dict(result.metrics or {})
    return Row(
        trial=trial_id,
        settings=settings,
        status=status,
        best=float(best[metric]) if best else None,
        best_step=int(best["step"]) if best else None,
        stopped_at=int(last["step"]) if status == "stopped" and "step" in last else None,
        steps=int(logged[-1]["step"]) if logged else 0,
        wall_seconds=float(last.get("time_total_s", 0.0)),
        lora=info.get("lora", "") if status == "finished" else best_lora,
        best_lora=best_lora,
        error=error,
    )


def best_row(rows: list[Row]) -> Row | None:
    """The trial with the lowest best metric that left its best LoRA."""
    scored = [r for r in rows if r.best is not None and r.best_lora]
    return min(scored, key=lambda r: r.best) if scored else None


def write(rows: list[Row], sweep_output: str, metric: str) -> tuple[str, str]:
    """Write ``sweep/results.parquet`` and ``sweep/results.csv``; returns their paths."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([r.record(metric) for r in rows])
    parquet_path = storage.join(sweep_output, RESULTS_DIR, "results.parquet")
    csv_path = storage.join(sweep_output, RESULTS_DIR, "results.csv")
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    storage.write_bytes_atomic(parquet_path, sink.getvalue().to_pybytes())
    text = io.BytesIO()
    pacsv.write_csv(table, text)
    storage.write_bytes_atomic(csv_path, text.getvalue())
    return parquet_path, csv_path


def copy_best(best: Row, sweep_output: str) -> str:
    """Copy the best trial's best LoRA to ``lora/best.safetensors``; returns that path."""
    dest = storage.join(sweep_output, "lora", BEST_LORA)
    storage.write_bytes_atomic(dest, storage.read_bytes(best.best_lora))
    return dest


def lines(rows: list[Row], metric: str) -> list[str]:
    """The table as text, best first."""
    keys = sorted({k for r in rows for k in r.settings})
    head = ["trial", *keys, "status", f"best {metric}", "at step", "stopped at", "wall s"]
    body = []
    for r in sorted(rows, key=lambda r: (r.best is None, r.best or 0.0)):
        body.append(
            [
                r.trial,
                *(_short(r.settings.get(k)) for k in keys),
                r.status,
                "-" if r.best is None else f"{r.best:.5f}",
                _short(r.best_step),
                _short(r.stopped_at),
                f"{r.wall_seconds:.0f}",
            ]
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*head)] + [fmt.format(*b) for b in body]
    out += [f"  {r.trial}: {r.error}" for r in rows if r.error]
    return out


def _short(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)
