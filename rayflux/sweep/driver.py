"""A whole sweep: the cache once, a pre-flight fit, the trials through Ray Tune (or its restore), the results.

Layout of the sweep's ``run.output_dir``: ``ledger.json`` (the cache stage, the sweep, one entry per trial),
``cache/`` (unless ``cache.dir`` says otherwise), ``trials/<trial id>/`` (each an ordinary job's run directory),
``tune/`` (Tune's experiment state, which a rerun restores), ``sweep/results.{parquet,csv}`` and
``lora/best.safetensors``. ``tensorboard --logdir <output>/trials`` shows every trial's curves side by side.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from dataclasses import dataclass, field

from rayflux import job, lease, storage
from rayflux.config import ConfigError, JobConfig, worker_range
from rayflux.config.placement import Cluster, place
from rayflux.config.loader import old_key
from rayflux.ledger import Ledger
from rayflux.sweep import results, seal
from rayflux.sweep.config import SweepConfig, SweepFile, tune_space
from rayflux.sweep.groups import release
from rayflux.sweep.trial import TRIALS_DIR, trial_dir

log = logging.getLogger("rayflux")

TUNE_NAME = "tune"
"""Tune's experiment folder under the sweep's output: what a rerun restores."""


@dataclass
class Outcome:
    """What a sweep did."""

    rows: list = field(default_factory=list)
    """One :class:`rayflux.sweep.results.Row` per trial."""
    best: object = None
    """The best row (None when no trial was scored)."""
    best_lora: str = ""
    results: tuple = ()
    """Paths of the parquet and CSV tables."""
    ledger: str = ""
    cached: int = 0
    """Samples in the shared cache generation."""
    tensorboard_dir: str = ""


def run(sf: SweepFile) -> Outcome:
    """Run (or continue) the sweep; raises when every trial failed, with the first trial's error."""
    cfg, sweep = sf.job, sf.sweep
    _, cache_root, output = job.resolve_dirs(cfg)
    cfg.cache.dir, cfg.run.output_dir = cache_root, output
    cached = job.run(cfg, only="cache")  # the one cache build: every trial reuses this committed generation
    if cached.cached == 0:
        raise RuntimeError(f"no image could be cached (see {cached.cache_dir}/skipped.jsonl)")
    preflight(cfg, sweep)
    held = lease.Lease(output, f"run.output_dir {output}", cfg.run.lease_seconds).acquire()
    try:
        ledger = Ledger(output, job.run_identity(cfg), guard=held.check)
        outcome = _trials(cfg, sweep, output, ledger)
        outcome.cached = cached.cached
        return outcome
    finally:
        held.release()


def preflight(cfg: JobConfig, sweep: SweepConfig) -> None:
    """Refuse a sweep whose single trial can never be scheduled (Tune would wait for it forever)."""
    from rayflux.cache.fit import Capacity

    cap = Capacity.of_cluster()
    budget = cap.budget(now=False)
    workers = worker_range(cfg.train.workers.num_workers)[0]
    need = {"CPU": workers * cfg.train.workers.cpus_per_worker + sweep.trial_cpus}
    if place(cfg, Cluster(gpus=job.cluster_has_gpus())).training:
        need["GPU"] = float(workers)
    short = {k: v for k, v in need.items() if budget.get(k, 0.0) + 1e-9 < v}
    if short:
        have = ", ".join(f"{k} {budget.get(k, 0.0):g}" for k in need)
        raise ConfigError(
            f"one trial needs {', '.join(f'{k} {v:g}' for k, v in need.items())} (train.workers.num_workers "
            f"x train.workers.cpus_per_worker, plus sweep.trial_cpus), but the cluster has {have}"
        )
    per_trial = need["CPU"]
    log.info(
        "sweep: each trial reserves %g CPU; the cluster has %g: up to %d trial(s) at once (sweep.max_concurrent %d)",
        per_trial,
        budget.get("CPU", 0.0),
        int(budget.get("CPU", 0.0) // per_trial),
        sweep.max_concurrent,
    )


def _fingerprint(sweep: SweepConfig) -> str:
    """What a sweep's ledger entry is checked against on a rerun. The space's keys are hashed under their keys from
    before the config's sections (``train.learning_rate``), so a sweep started before them still continues."""
    space = {_old_key(key): spec for key, spec in sweep.space.items()}
    blob = json.dumps(
        {"space": space, "num_samples": sweep.num_samples, "metric": sweep.metric, "scheduler": sweep.scheduler},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _old_key(key: str) -> str:
    section, _, path = key.partition(".")
    return f"{section}.{old_key(section, path)}"


def _trials(cfg: JobConfig, sweep: SweepConfig, output: str, ledger: Ledger) -> Outcome:
    fp = _fingerprint(sweep)
    old = ledger.find("sweep")
    if old is not None and old["inputs"] != fp:
        raise ConfigError(
            f"{output} holds a sweep with another space, metric or scheduler; use a new run.output_dir "
            "or restore the original sweep section"
        )
    entry = ledger.start(
        "sweep",
        fp,
        space=sweep.space,
        num_samples=sweep.num_samples,
        scheduler=sweep.scheduler,
        metric=sweep.metric,
        max_concurrent=sweep.max_concurrent,
    )
    grid = _tuner(cfg, sweep, output).fit()
    for r in grid:
        _end(trial_dir(output, results.trial_id_of(r)), cfg.run.lease_seconds)
    rows = [results.row(r, cfg, output, sweep.metric) for r in grid]
    for r in rows:
        trial = ledger.start(
            f"trial:{r.trial}",
            json.dumps(r.settings, sort_keys=True, default=str),
            settings=r.settings,
            dir=storage.join(output, TRIALS_DIR, r.trial),
        )
        ledger.finish(trial, status="done" if r.status != "error" else "failed", result=r.record(sweep.metric))
    out = Outcome(rows=rows, ledger=ledger.path, tensorboard_dir=storage.join(output, TRIALS_DIR))
    out.results = results.write(rows, output, sweep.metric)
    out.best = results.best_row(rows)
    if out.best is not None:
        out.best_lora = results.copy_best(out.best, output)
    failed = [r for r in rows if r.status == "error"]
    ledger.finish(
        entry,
        status="failed" if rows and len(failed) == len(rows) else "done",
        results=out.results[0],
        best=out.best.trial if out.best else None,
        best_lora=out.best_lora,
    )
    if rows and len(failed) == len(rows):
        first = next(r for r in rows if r.error)  # its error's last line, not Tune's whole remote traceback
        raise RuntimeError(f"every trial of the sweep failed; the first ({first.trial}): {first.error}")
    return out


SEAL_SECONDS = 60.0
"""How long the driver waits, at the least, for a stopped trial's training processes to end before it reads the
trial's results anyway (with a warning); Ray usually ends them within seconds of Tune's stop."""


def _end(out: str, lease_seconds: float) -> None:
    """Make sure nothing of a trial still writes its run directory before its row is read. Tune reports a trial
    stopped before Ray has ended its trainer: its rank 0 may train on for seconds, log more evals and rewrite its best
    LoRA. So remove its placement groups (again: its controller may have started a new worker group before it died),
    which ends its workers, and seal the directory, which waits until they are gone (:mod:`rayflux.sweep.seal`)."""
    release(out)
    seal.seal(out, timeout=max(SEAL_SECONDS, 4 * lease_seconds))


def _tuner(cfg: JobConfig, sweep: SweepConfig, output: str):
    """A new Tuner, or the interrupted sweep's restored one (finished trials kept, unfinished ones run again and
    resume from their own checkpoints)."""
    import ray.tune as tune

    from rayflux.sweep.trainable import TrialTrainable

    base = copy.deepcopy(cfg.to_dict())
    trainable = tune.with_parameters(TrialTrainable, base=base, sweep_output=output, metric=sweep.metric)
    trainable = tune.with_resources(trainable, {"CPU": sweep.trial_cpus})
    storage_path, storage_fs = storage.for_ray_train(output)
    path = storage.join(output, TUNE_NAME)
    if tune.Tuner.can_restore(path, storage_filesystem=storage_fs):
        log.info("sweep: continuing the interrupted sweep in %s", path)
        try:
            return tune.Tuner.restore(path, trainable, resume_errored=True, storage_filesystem=storage_fs)
        except ValueError as exc:
            if "Invalid `trainable`" not in str(exc):
                raise
            raise ConfigError(  # a sweep interrupted under a rayflux whose trials were a Tune function
                f"{path} holds a sweep started by an earlier rayflux (its trials ran another Tune trainable), which "
                "this one cannot continue: finish it with that version, or start it again in a new run.output_dir"
            ) from None
    return tune.Tuner(
        trainable,
        param_space=tune_space(sweep),
        tune_config=tune.TuneConfig(
            metric=sweep.metric,
            mode="min",
            num_samples=sweep.num_samples,
            max_concurrent_trials=sweep.max_concurrent,
            # A freed trial's process runs the next trial: no process start, no second import of torch and the job's
            # modules (every trial asks the same resources: sweep.trial_cpus). TrialTrainable.reset_config ends a
            # stopped trial's trainer before the next trial starts.
            reuse_actors=True,
            scheduler=_scheduler(cfg, sweep),
            trial_dirname_creator=lambda t: t.trial_id,  # results.row finds a trial's run directory by it
        ),
        run_config=tune.RunConfig(
            name=TUNE_NAME,
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            failure_config=tune.FailureConfig(max_failures=max(cfg.train.workers.max_failures, 0)),
            callbacks=[release_callback(output)],
            # Nothing for Tune to save: a trial's checkpoints are its run directory's. (Tune's default for a class
            # trainable saves one at each trial's end, and a trainable without save_checkpoint fails the trial.)
            checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False),
            verbose=1,
        ),
    )


def _scheduler(cfg: JobConfig, sweep: SweepConfig):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if sweep.scheduler == "fifo":
        return FIFOScheduler()
    grace = sweep.grace_period or cfg.train.eval.every or 1
    # ASHA stops a trial that reaches max_t; one past the last step lets a trial that trains to its end export.
    return ASHAScheduler(
        time_attr="step",
        max_t=(cfg.train.max_steps or 10**9) + 1,
        grace_period=grace,
        reduction_factor=sweep.reduction_factor,
    )


def release_callback(sweep_output: str):
    """The Tune callback of the sweep's driver: release a trial's placement groups when Tune stops, fails or retries
    it (see :mod:`rayflux.sweep.groups`)."""
    from ray import tune

    class ReleaseGroups(tune.Callback):
        def on_trial_complete(self, iteration, trials, trial, **info):
            release(trial_dir(sweep_output, trial.trial_id))

        def on_trial_error(self, iteration, trials, trial, **info):
            release(trial_dir(sweep_output, trial.trial_id))

        def on_trial_recover(self, iteration, trials, trial, **info):
            release(trial_dir(sweep_output, trial.trial_id))

    return ReleaseGroups()
