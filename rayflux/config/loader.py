"""Building a JobConfig: defaults, then a YAML file, then dotted ``--set`` overrides; and the ``--help`` text.

Each field's docstring (the string literal under it) is the documentation users see in ``--help``; it is read from
the source with ``ast`` so that the code and the help can never disagree.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from functools import cache
from pathlib import Path

import yaml

from rayflux.config.checks import ADAPTER_SPELLINGS, validate
from rayflux.config.job import SECTIONS, JobConfig
from rayflux.config.optimizer import SPELLINGS
from rayflux.config.values import ConfigError, coerce


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of a dataclass to the docstring written under it in the source (inherited fields included)."""
    docs: dict[str, str] = {}
    for base in cls.__mro__[1:]:
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


ALIASES = {
    ("train", "network_dim"): "rank",  # kohya
    ("train", "lora_rank"): "rank",  # SimpleTuner
    ("train", "network_alpha"): "alpha",  # kohya
    ("train", "lora_alpha"): "alpha",  # SimpleTuner
    ("train", "train_batch_size"): "batch_size",
    ("train", "gradient_accumulation_steps"): "gradient_accumulation",
    ("train", "max_train_steps"): "max_steps",
    ("train", "max_train_epochs"): "epochs",  # kohya
    ("train", "num_train_epochs"): "epochs",  # SimpleTuner
    ("train", "lr_warmup_steps"): "warmup_steps",
    ("train", "lr_scheduler_num_cycles"): "lr_cycles",  # kohya
    ("train", "lr_num_cycles"): "lr_cycles",  # SimpleTuner
    ("train", "lr_scheduler_power"): "lr_power",  # kohya
    ("train", "caption_dropout_rate"): "caption_dropout",  # kohya
    ("train", "caption_dropout_probability"): "caption_dropout",  # SimpleTuner
    ("train", "save_every_n_steps"): "checkpoint_every",  # kohya
    ("train", "checkpointing_steps"): "checkpoint_every",  # SimpleTuner
    ("train", "checkpoints_total_limit"): "checkpoints_to_keep",  # SimpleTuner
    ("train", "validation_steps"): "validation_every",  # SimpleTuner
    ("train", "optimizer_type"): "optimizer",  # kohya
    ("train", "torch_compile"): "compile",  # kohya (sd-scripts' --torch_compile)
    ("train", "network_module"): "adapter",  # kohya: networks.lora_flux -> lora (checks.ADAPTER_SPELLINGS)
    ("data", "bucket_reso_steps"): "bucket_step",  # kohya
}
"""kohya (sd-scripts) and SimpleTuner names accepted for keys that mean exactly the same thing here."""

SWITCHES = {
    ("train", "use_ema"): ("ema_decay", 0.995),  # SimpleTuner: its ema_decay defaults to 0.995
}
"""On/off keys of other trainers for a key that holds a number here: ``true`` sets the key to the value given
(unless the key itself is set too: ``use_ema: true`` beside ``ema_decay: 0.999`` keeps 0.999), ``false`` to 0."""


def apply(cfg: JobConfig, updates: dict, prefix: str = "") -> JobConfig:
    """Apply a nested dict of updates (from YAML or ``--set``) to ``cfg`` in place, checking every key."""
    for name, value in updates.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown config section {prefix}{name!r}; expected one of {sorted(SECTIONS)}")
        if not isinstance(value, dict):
            raise ConfigError(f"config section {name!r} must be a mapping")
        section = getattr(cfg, name)
        fields = {f.name: f for f in dataclasses.fields(section)}
        value = _resolve_aliases(name, value)
        for key, raw in value.items():
            if key not in fields:
                raise ConfigError(f"unknown config key {name}.{key}; known keys: {', '.join(sorted(fields))}")
            current = getattr(section, key)
            setattr(section, key, coerce(f"{name}.{key}", raw, current, fields[key].type))
    return cfg


def _resolve_aliases(section: str, values: dict) -> dict:
    """Rename aliased keys to their own names; an alias beside its key (or another alias of it) is an error."""
    out: dict = {}
    said: dict = {}
    switched = {}
    for key, raw in values.items():
        if (section, key) in SWITCHES:
            own, on_value = SWITCHES[(section, key)]
            switched[own] = on_value if coerce(f"{section}.{key}", raw, False, bool) else 0.0
            continue
        own = ALIASES.get((section, key), key)
        if own in out:
            raise ConfigError(f"{section}.{said[own]} and {section}.{key} both set {section}.{own}; keep one")
        out[own], said[own] = raw, key
    for own, value in switched.items():
        if own not in out or not value:  # an explicit value wins over "on"; "off" turns it off
            out[own] = value
    return out


def parse_set(item: str) -> dict:
    """``train.epochs=3`` -> ``{"train": {"epochs": 3}}``; the value is parsed as YAML (so ``[1, 4]`` is a list)."""
    if "=" not in item:
        raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2:
        raise ConfigError(f"--set key must look like section.key, got {key!r}")
    section = SECTIONS[parts[0]] if parts[0] in SECTIONS else None
    default = getattr(section(), ALIASES.get((parts[0], parts[1]), parts[1]), None) if section else None
    # String keys take the text as written: YAML would turn "1:0.4" into 60.4 (sexagesimal) or "off" into False.
    if isinstance(default, str):
        return {parts[0]: {parts[1]: raw}}
    value = yaml.safe_load(raw) if raw.strip() else ""
    return {parts[0]: {parts[1]: value}}


def load(config_file: str | None = None, overrides: list[str] = ()) -> JobConfig:
    """Build a JobConfig from defaults, then an optional YAML file, then ``--set`` overrides in order."""
    cfg = JobConfig()
    if config_file:
        text = Path(config_file).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{config_file}: top level must be a mapping of sections")
        apply(cfg, data)
    for item in overrides:
        apply(cfg, parse_set(item))
    validate(cfg)
    return cfg


def help_text() -> str:
    """Every key with its default and docstring, for ``--help``."""
    lines = ["Config keys (set with --set KEY=VALUE or in a --config YAML file):"]
    defaults = JobConfig()
    for name in SECTIONS:
        cls = SECTIONS[name]
        lines.append(f"\n  {name}: {cls.__doc__}")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, name), f.name)
            lines.append(f"    {name}.{f.name} = {default!r}")
            lines.append(textwrap.fill(docs.get(f.name, ""), 100, initial_indent=" " * 8, subsequent_indent=" " * 8))
    lines.append("\n  Also accepted, with the same meaning (kohya sd-scripts / SimpleTuner names):")
    lines += [f"    {section}.{alias} -> {section}.{own}" for (section, alias), own in ALIASES.items()]
    lines += [
        f"    {section}.{switch}: true -> {section}.{own}={on} (false -> 0)"
        for (section, switch), (own, on) in SWITCHES.items()
    ]
    spellings = ", ".join(f"{alias} -> {own}" for alias, own in SPELLINGS.items())
    lines.append("\n  train.optimizer values also accepted (any case):")
    lines.append(textwrap.fill(spellings, 100, initial_indent=" " * 4, subsequent_indent=" " * 4))
    adapters = ", ".join(f"{alias} -> {own}" for alias, own in ADAPTER_SPELLINGS.items())
    lines.append(f"\n  train.adapter values also accepted: {adapters} (lycoris.kohya: choose dora or lokr)")
    return "\n".join(lines)


def from_dict(d: dict) -> JobConfig:
    """Rebuild a JobConfig from ``JobConfig.to_dict()`` (how the config travels to Ray workers)."""
    return apply(JobConfig(), d)
