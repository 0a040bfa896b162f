"""The ``sweep:`` section of a sweep file: the search space over ``train.*`` keys and how Tune runs the trials.

The rest of the file is an ordinary job config; every trial is that job with the space's settings applied.
"""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rayflux.config import ConfigError, JobConfig, TrainConfig, apply, field_docs, parse_set, validate
from rayflux.config.loader import canonical_key, leaves

KINDS = ("grid", "choice", "loguniform", "uniform")
"""How a space key's values are given: ``{grid: [...]}`` (every value, times ``num_samples``), ``{choice: [...]}``
(one drawn per sample), ``{loguniform: [low, high]}`` or ``{uniform: [low, high]}``."""


@dataclass
class SweepConfig:
    """The sweep: which ``train.*`` settings vary, how many trials run and how they are compared."""

    space: dict = field(default_factory=dict)
    """``train.<key>: {grid|choice|loguniform|uniform: [...]}`` per varied setting (Tune's search-space syntax)."""
    num_samples: int = 1
    """Tune's meaning: repeats of the grid; the samples drawn from random (choice, loguniform, uniform) keys."""
    max_concurrent: int = 2
    """Trials that train at once. Each trial's workers are ``train.workers.num_workers`` with ``train.workers.cpus_per_worker``."""
    metric: str = "eval_loss"
    """The number trials are compared (and stopped) by, lowest best: ``eval_loss`` needs ``data.eval_samples``."""
    scheduler: str = "asha"
    """``asha`` (stop trials whose metric lags at its rungs; reports come at every ``train.eval.every`` step) or
    ``fifo`` (every trial runs to its end)."""
    grace_period: int = 0
    """ASHA: steps every trial trains before it may be stopped (0: ``train.eval.every``, else 1)."""
    reduction_factor: int = 2
    """ASHA: a rung keeps the best 1/reduction_factor of the trials that reached it."""
    trial_cpus: float = 0.01
    """CPUs reserved by each trial's Tune function itself (it only waits on the trainer, whose workers reserve
    their own), so that ``max_concurrent`` small trials fit a small machine."""


@dataclass
class SweepFile:
    """A parsed sweep file: the sweep section and the base job every trial starts from."""

    sweep: SweepConfig
    job: JobConfig


def load(config_file: str, overrides: list[str] = ()) -> SweepFile:
    """Read ``config_file``: its ``sweep:`` section, then the job sections with ``--set`` overrides applied."""
    data = yaml.safe_load(Path(config_file).read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{config_file}: top level must be a mapping of sections")
    raw = data.pop("sweep", None)
    if raw is None:
        raise ConfigError(f"{config_file}: no sweep: section (see rayflux sweep --help)")
    job = JobConfig()
    apply(job, data)
    for item in overrides:
        apply(job, parse_set(item))
    validate(job)
    sweep = parse(raw)
    check(sweep, job)
    return SweepFile(sweep, job)


def parse(raw) -> SweepConfig:
    """The ``sweep:`` mapping as a :class:`SweepConfig`; unknown keys and malformed space entries are refused."""
    if not isinstance(raw, dict):
        raise ConfigError("sweep: must be a mapping")
    known = {f.name: f for f in dataclasses.fields(SweepConfig)}
    cfg = SweepConfig()
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"unknown sweep key sweep.{key}; known keys: {', '.join(known)}")
        if key == "space":
            setattr(cfg, key, _space(value))
            continue
        kind = {"int": int, "float": float, "str": str}[str(known[key].type)]
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f"sweep.{key} must be a {kind.__name__}, got {value!r}")
        try:
            setattr(cfg, key, kind(value))
        except ValueError:
            raise ConfigError(f"sweep.{key} must be a {kind.__name__}, got {value!r}") from None
    return cfg


def _space(raw) -> dict:
    """``{train.key: {kind: values}}`` with aliases and old keys resolved to their paths (``train.learning_rate`` ->
    ``train.optim.learning_rate``); anything else is refused."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError("sweep.space must map train.<key> to {grid|choice|loguniform|uniform: [...]}")
    fields = {path for path, _, _ in leaves(TrainConfig)}
    out = {}
    for key, spec in raw.items():
        section, _, name = str(key).partition(".")
        name = canonical_key(section, name)
        if section != "train" or name not in fields:
            raise ConfigError(
                f"sweep.space key {key!r} is not a train.* setting; a sweep varies only train keys "
                "(the cache is shared by every trial)"
            )
        if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
            raise ConfigError(
                f"sweep.space.{key} must be one of {{grid|choice|loguniform|uniform: [...]}}, got {spec!r}"
            )
        kind, values = next(iter(spec.items()))
        if not isinstance(values, list) or not values:
            raise ConfigError(f"sweep.space.{key}.{kind} needs a non-empty list, got {values!r}")
        if kind in ("loguniform", "uniform") and (len(values) != 2 or not all(_number(v) for v in values)):
            raise ConfigError(f"sweep.space.{key}.{kind} needs [low, high], got {values!r}")
        out[f"train.{name}"] = {kind: values}
    return out


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check(sweep: SweepConfig, job: JobConfig) -> None:
    """Refuse a sweep that cannot run as asked, before any work: every grid/choice value must make a valid job."""
    if sweep.num_samples < 1 or sweep.max_concurrent < 1:
        raise ConfigError("sweep.num_samples and sweep.max_concurrent must be at least 1")
    if sweep.scheduler not in ("asha", "fifo"):
        raise ConfigError(f"sweep.scheduler must be asha or fifo, got {sweep.scheduler!r}")
    if sweep.reduction_factor < 2:
        raise ConfigError("sweep.reduction_factor must be at least 2")
    if sweep.metric == "eval_loss" and job.data.eval_samples <= 0:
        raise ConfigError("sweep.metric eval_loss needs data.eval_samples > 0 (samples held out for the eval loss)")
    if job.cache.refresh != "never":
        # A refreshed cache builds and retires generations during training: trials would retire each other's data.
        raise ConfigError("a sweep trains every trial on one cache generation: set cache.refresh to never")
    for key, spec in sweep.space.items():
        kind, values = next(iter(spec.items()))
        for value in values if kind in ("grid", "choice") else values[:2]:
            trial_job(job, {key: value}, "")


def trial_job(base: JobConfig, settings: dict, output_dir: str) -> JobConfig:
    """The job of one trial: ``base`` with ``settings`` (``train.key -> value``) and its own run directory."""
    cfg = apply(JobConfig(), base.to_dict())
    for key, value in settings.items():
        section, name = key.split(".", 1)
        apply(cfg, {section: {name: value}})
    if output_dir:
        cfg.run.output_dir = output_dir
    validate(cfg)
    return cfg


def tune_space(sweep: SweepConfig) -> dict:
    """Tune's ``param_space``: one flat entry per varied key."""
    from ray import tune

    make = {
        "grid": tune.grid_search,
        "choice": tune.choice,
        "loguniform": lambda v: tune.loguniform(*v),
        "uniform": lambda v: tune.uniform(*v),
    }
    return {key: make[kind](values) for key, spec in sweep.space.items() for kind, values in spec.items()}


def help_text() -> str:
    """The sweep section's keys with their defaults and docstrings."""
    lines = ["Sweep keys (the sweep: section of the --config file):"]
    docs, defaults = field_docs(SweepConfig), SweepConfig()
    for f in dataclasses.fields(SweepConfig):
        lines.append(f"    sweep.{f.name} = {getattr(defaults, f.name)!r}")
        lines.append(textwrap.fill(docs.get(f.name, ""), 100, initial_indent=" " * 8, subsequent_indent=" " * 8))
    return "\n".join(lines)
