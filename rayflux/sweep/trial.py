"""One trial: the ordinary job, with the trial's settings, in its own run directory under the sweep's output.

The trial runs :func:`rayflux.job.run` inside its Tune trainable (:mod:`rayflux.sweep.trainable`): the cache stage
finds the sweep's committed generation and reuses it (nothing is encoded), the train stage launches the
``TorchTrainer`` (its eval reports reach the trainable through :mod:`rayflux.sweep.report`), and the export stage
writes the LoRA. The run directory holds what any job's does (ledger, checkpoints, step log, TensorBoard, best and
exported LoRA), so a restarted trial resumes from its checkpoints exactly as a rerun job does, and the same settings
as a standalone job train the same LoRA.
"""

from __future__ import annotations

import json
import os
import time

from rayflux import lease, storage

TRIALS_DIR = "trials"
"""Under the sweep's output: one run directory per trial, named by its Tune trial id."""
TRIAL_FILE = "trial.json"
"""In a trial's run directory: its settings and, once the job returned, its outcome."""


def trial_dir(sweep_output: str, trial_id: str) -> str:
    return storage.join(sweep_output, TRIALS_DIR, trial_id)


def run_trial(settings: dict, base: dict, out: str, callbacks) -> None:
    """One trial's job (run by :class:`rayflux.sweep.trainable.TrialTrainable`). ``base``: the sweep's job config
    (``JobConfig.to_dict()``), its ``cache.dir`` set to the sweep's cache; ``settings``: ``train.key -> value`` drawn
    by Tune; ``out``: the trial's run directory; ``callbacks``: makes the Ray Train callbacks of each of its trainers
    (its reports to Tune)."""
    from rayflux import job
    from rayflux.config import from_dict
    from rayflux.sweep.config import trial_job
    from rayflux.sweep import seal

    cfg = trial_job(from_dict(base), settings, out)
    # The process id says which trials a process ran in turn (Tune's reuse_actors), for the tests and the benchmark.
    started = time.time()
    _write(out, {"settings": settings, "started": started, "pid": os.getpid()})
    _wait_for_lease(out, cfg.run.lease_seconds)
    seal.unseal(out)  # sealed when an earlier run of the sweep tabulated this trial (one that failed, run again)
    summary = job.run(cfg, trainer_callbacks=callbacks)
    _write(
        out,
        {
            "settings": settings,
            "started": started,
            "finished": time.time(),
            "pid": os.getpid(),
            "steps": summary.steps,
            "lora": summary.lora_path,
            "best": list(summary.best) if summary.best else None,
        },
    )


def _wait_for_lease(out: str, seconds: float) -> None:
    """A trial restarted after its sweep was killed finds its old lease until it expires: wait for it (the holder is
    gone; only this trial ever writes its directory) instead of failing the attempt."""
    held = lease.Lease(out, f"trial {out}", seconds).acquire(wait=True)
    held.release()


def _write(out: str, record: dict) -> None:
    storage.write_bytes_atomic(storage.join(out, TRIAL_FILE), json.dumps(record, indent=1, default=str).encode())


def read(out: str) -> dict:
    """A trial's ``trial.json`` ({} when the trial never started)."""
    path = storage.join(out, TRIAL_FILE)
    return json.loads(storage.read_bytes(path)) if storage.exists(path) else {}
