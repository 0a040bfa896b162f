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

from rayflux.config.identity import OLD_KEY, is_section
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
    ("train", "loraplus_lr_ratio"): "optim.lora_plus_ratio",  # kohya's network_args name for LoRA+
    ("train", "network_dim"): "adapter.rank",  # kohya
    ("train", "lora_rank"): "adapter.rank",  # SimpleTuner
    ("train", "network_alpha"): "adapter.alpha",  # kohya
    ("train", "lora_alpha"): "adapter.alpha",  # SimpleTuner
    ("train", "train_batch_size"): "batch_size",
    ("train", "gradient_accumulation_steps"): "gradient_accumulation",
    ("train", "max_train_steps"): "max_steps",
    ("train", "max_train_epochs"): "epochs",  # kohya
    ("train", "num_train_epochs"): "epochs",  # SimpleTuner
    ("train", "lr_warmup_steps"): "optim.warmup_steps",
    ("train", "lr_scheduler_num_cycles"): "optim.lr_cycles",  # kohya
    ("train", "lr_num_cycles"): "optim.lr_cycles",  # SimpleTuner
    ("train", "lr_scheduler_power"): "optim.lr_power",  # kohya
    ("train", "caption_dropout_rate"): "flow.caption_dropout",  # kohya
    ("train", "caption_dropout_probability"): "flow.caption_dropout",  # SimpleTuner
    ("train", "save_every_n_steps"): "checkpoint.every",  # kohya
    ("train", "checkpointing_steps"): "checkpoint.every",  # SimpleTuner
    ("train", "checkpoints_total_limit"): "checkpoint.keep",  # SimpleTuner
    ("train", "validation_steps"): "validation.every",  # SimpleTuner
    ("train", "optimizer_type"): "optim.name",  # kohya
    ("train", "torch_compile"): "compile",  # kohya (sd-scripts' --torch_compile)
    ("train", "network_module"): "adapter.kind",  # kohya: networks.lora_flux -> lora (checks.ADAPTER_SPELLINGS)
    ("data", "bucket_reso_steps"): "bucket_step",  # kohya
}
"""kohya (sd-scripts) and SimpleTuner names accepted for keys that mean exactly the same thing here (the target is
the key's path in its section: ``adapter.rank`` is ``train.adapter.rank``)."""

SWITCHES = {
    ("train", "use_ema"): ("optim.ema_decay", 0.995),  # SimpleTuner: its ema_decay defaults to 0.995
}
"""On/off keys of other trainers for a key that holds a number here: ``true`` sets the key to the value given
(unless the key itself is set too: ``use_ema: true`` beside ``ema_decay: 0.999`` keeps 0.999), ``false`` to 0."""


def leaves(cls: type, prefix: str = ""):
    """``(path, field, owner class)`` of every key of a section, its sub-sections' keys as dotted paths, in order."""
    for f in dataclasses.fields(cls):
        if is_section(f):
            yield from leaves(f.default_factory, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, cls


@cache
def old_keys() -> dict[tuple[str, str], str]:
    """``(section, old key) -> path`` of every field that moved into a sub-section or was renamed (its metadata names
    its old key, :func:`rayflux.config.identity.moved`): configs written before the split still load."""
    return {
        (name, f.metadata[OLD_KEY]): path
        for name, cls in SECTIONS.items()
        for path, f, _ in leaves(cls)
        if f.metadata.get(OLD_KEY, path) != path
    }


def canonical_key(section: str, key: str) -> str:
    """A key's path in its section: aliases and old keys resolved (``learning_rate`` -> ``optim.learning_rate``)."""
    return ALIASES.get((section, key)) or old_keys().get((section, key)) or key


def old_key(section: str, path: str) -> str:
    """The key ``path`` of ``section`` had before the split (itself when it did not move), for hashes kept stable."""
    return next((old for (s, old), p in old_keys().items() if s == section and p == path), path)


def apply(cfg: JobConfig, updates: dict, prefix: str = "") -> JobConfig:
    """Apply a nested dict of updates (from YAML or ``--set``) to ``cfg`` in place, checking every key."""
    for name, value in updates.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown config section {prefix}{name!r}; expected one of {sorted(SECTIONS)}")
        if not isinstance(value, dict):
            raise ConfigError(f"config section {name!r} must be a mapping")
        section = getattr(cfg, name)
        for path, raw in _resolve_aliases(name, _flatten(section, value)).items():
            _set(name, section, path, raw)
    return cfg


def _flatten(obj, values: dict, prefix: str = "") -> dict:
    """A section's mapping with its sub-sections' mappings as dotted keys (``{optim: {lr: 1}}`` -> ``{optim.lr: 1}``).
    A sub-section's name given a value that is not a mapping is an old key of the same name (``train.adapter``)."""
    subs = {f.name for f in dataclasses.fields(obj) if is_section(f)}
    out: dict = {}
    for key, raw in values.items():
        if key in subs and isinstance(raw, dict):
            out.update(_flatten(getattr(obj, key), raw, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = raw
    return out


def _set(name: str, section, path: str, raw) -> None:
    """Set ``path`` (dotted within ``section``) to ``raw`` coerced to the field's type."""
    *parents, leaf = path.split(".")
    obj = section
    for part in parents:
        obj = _sub(obj, part)
    fields = {f.name: f for f in dataclasses.fields(obj) if not is_section(f)} if obj is not None else {}
    if leaf not in fields:
        known = ", ".join(p for p, _, _ in leaves(type(section)))
        raise ConfigError(f"unknown config key {name}.{path}; known keys: {known}")
    setattr(obj, leaf, coerce(f"{name}.{path}", raw, getattr(obj, leaf), fields[leaf].type))


def _sub(obj, name: str):
    """Sub-section ``name`` of ``obj``; None when there is none (or ``obj`` is None)."""
    if obj is None or not any(f.name == name and is_section(f) for f in dataclasses.fields(obj)):
        return None
    return getattr(obj, name)


def _resolve_aliases(section: str, values: dict) -> dict:
    """Rename aliased and old keys to their paths; an alias beside its key (or another alias of it) is an error."""
    out: dict = {}
    said: dict = {}
    switched = {}
    for key, raw in values.items():
        if (section, key) in SWITCHES:
            own, on_value = SWITCHES[(section, key)]
            switched[own] = on_value if coerce(f"{section}.{key}", raw, False, bool) else 0.0
            continue
        own = canonical_key(section, key)
        if own in out:
            raise ConfigError(f"{section}.{said[own]} and {section}.{key} both set {section}.{own}; keep one")
        out[own], said[own] = raw, key
    for own, value in switched.items():
        if own not in out or not value:  # an explicit value wins over "on"; "off" turns it off
            out[own] = value
    return out


def parse_set(item: str) -> dict:
    """``train.epochs=3`` -> ``{"train": {"epochs": 3}}``, ``train.optim.lr_power=2`` -> ``{"train":
    {"optim.lr_power": 2}}``; the value is parsed as YAML (so ``[1, 4]`` is a list)."""
    if "=" not in item:
        raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
    key, raw = item.split("=", 1)
    section, _, path = key.strip().partition(".")
    if not section or not path or "" in path.split("."):
        raise ConfigError(f"--set key must look like section.key, got {key!r}")
    default = _default(section, canonical_key(section, path))
    # String keys take the text as written: YAML would turn "1:0.4" into 60.4 (sexagesimal) or "off" into False.
    if isinstance(default, str):
        return {section: {path: raw}}
    value = yaml.safe_load(raw) if raw.strip() else ""
    return {section: {path: value}}


def _default(section: str, path: str):
    """The default of key ``path`` of ``section``; None when there is no such key (``apply`` then names it)."""
    obj = SECTIONS[section]() if section in SECTIONS else None
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


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
    """Every key with its default and docstring, grouped by section and sub-section, for ``--help``."""
    lines = ["Config keys (set with --set KEY=VALUE or in a --config YAML file):"]
    for name, cls in SECTIONS.items():
        lines += _section_help(name, cls, getattr(JobConfig(), name))
    lines.append("\n  Also accepted, with the same meaning (kohya sd-scripts / SimpleTuner names):")
    lines += [f"    {section}.{alias} -> {section}.{own}" for (section, alias), own in ALIASES.items()]
    lines += [
        f"    {section}.{switch}: true -> {section}.{own}={on} (false -> 0)"
        for (section, switch), (own, on) in SWITCHES.items()
    ]
    lines.append("\n  Keys from before the sections, still accepted:")
    lines += [f"    {section}.{old} -> {section}.{path}" for (section, old), path in old_keys().items()]
    spellings = ", ".join(f"{alias} -> {own}" for alias, own in SPELLINGS.items())
    lines.append("\n  train.optim.name values also accepted (any case):")
    lines.append(textwrap.fill(spellings, 100, initial_indent=" " * 4, subsequent_indent=" " * 4))
    adapters = ", ".join(f"{alias} -> {own}" for alias, own in ADAPTER_SPELLINGS.items())
    lines.append(f"\n  train.adapter.kind values also accepted: {adapters} (lycoris.kohya: choose dora or lokr)")
    return "\n".join(lines)


def _section_help(name: str, cls: type, defaults) -> list[str]:
    """One section's keys (``name``: its dotted name), then each of its sub-sections under its own heading."""
    lines = [f"\n  {name}: {cls.__doc__.splitlines()[0]}"]
    docs, subs = field_docs(cls), []
    for f in dataclasses.fields(cls):
        if is_section(f):
            subs.append(f)
            continue
        lines.append(f"    {name}.{f.name} = {getattr(defaults, f.name)!r}")
        lines.append(textwrap.fill(docs.get(f.name, ""), 100, initial_indent=" " * 8, subsequent_indent=" " * 8))
    for f in subs:
        lines += _section_help(f"{name}.{f.name}", f.default_factory, getattr(defaults, f.name))
    return lines


def from_dict(d: dict) -> JobConfig:
    """Rebuild a JobConfig from ``JobConfig.to_dict()`` (how the config travels to Ray workers)."""
    return apply(JobConfig(), d)
