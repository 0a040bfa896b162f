"""What each config field is part of: the cache key, the run's identity, or neither.

Every field of every config section declares it beside its docstring, as dataclass field metadata
(``field(default=..., metadata=CACHED)``); the cache key (:func:`rayflux.cache.keys.cache_key`), a dataset's cache
identity (:func:`rayflux.datasets.cache_identity`) and the run identity (:func:`rayflux.job.run_identity`) are taken
from these declarations, never from key lists kept elsewhere. A field that declares nothing fails a test
(``tests/test_config.py``).
"""

from __future__ import annotations

import copy
import dataclasses
from types import MappingProxyType

IDENTITY = "identity"
"""The metadata key."""

CACHED = MappingProxyType({IDENTITY: "cache"})
"""Decides what the cache holds (how a tensor is made, which images): part of the cache key and of the run identity.
A change builds a new cache."""
CAPTIONS = MappingProxyType({IDENTITY: "captions"})
"""Decides which captions a generation holds, not how anything is encoded: part of the run identity, not of the
cache key (a change re-encodes only the captions that changed, incrementally)."""
TRAINED = MappingProxyType({IDENTITY: "run"})
"""Decides what is trained: part of the run identity only."""
UNTRACKED = MappingProxyType({IDENTITY: "none"})
"""Resources, feed tuning, run length and what is written beside the weights: may change between reruns of the
same run without changing what is being trained or cached."""

SECTION = MappingProxyType({IDENTITY: "section"})
"""A sub-section (``train.optim``): a dataclass whose own fields declare their identities. Its fields count as
fields of the section that holds it, under their old names (:func:`moved`)."""

KINDS = ("cache", "captions", "run", "none", "section")

OLD_KEY = "old_key"
"""The metadata key naming the field's key before it moved (into a sub-section, or to a clearer name)."""


def moved(kind: MappingProxyType, old: str) -> MappingProxyType:
    """``kind``'s declaration, plus the key the field had in its top-level section before it moved or was renamed
    (``train.optim.name`` was ``train.optimizer``). The loader takes the old key as an alias; the identities hash the
    field under the old key, so that moving a field changes no cache key or run identity."""
    return MappingProxyType({**kind, OLD_KEY: old})


ADDED = "added"
"""The metadata key marking a field added after identities were recorded (:func:`added`)."""


def added(kind: MappingProxyType) -> MappingProxyType:
    """``kind``'s declaration for a field added after caches, runs and fingerprints were first recorded: while it
    holds its default it is left out of every hash (:func:`values`), so adding it changes none of them; a value set
    enters them as any other field's. (Issue 45's technique keys, off by default.)"""
    return MappingProxyType({**kind, ADDED: True})


def _at_default(f: dataclasses.Field, value) -> bool:
    """Whether an :func:`added` field holds its default (so it says nothing)."""
    if not f.metadata.get(ADDED):
        return False
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return value == default


def kind(f: dataclasses.Field) -> str | None:
    """The identity a field declares, or None when it declares nothing."""
    return f.metadata.get(IDENTITY)


def is_section(f: dataclasses.Field) -> bool:
    """Whether the field holds a sub-section rather than a value."""
    return kind(f) == "section"


def old_key(f: dataclasses.Field, path: str = "") -> str:
    """The key a field is hashed under: its old key when it moved, else its dotted path in its top-level section."""
    return f.metadata.get(OLD_KEY) or f"{path}{f.name}"


def names(cls, *kinds: str) -> list[str]:
    """The fields of config dataclass ``cls`` (an instance or a class) that declare one of ``kinds``."""
    return [f.name for f in dataclasses.fields(cls) if kind(f) in kinds]


def values(obj, *kinds: str, path: str = "") -> dict:
    """``{key: value}`` of the fields of ``obj`` that declare one of ``kinds`` (values as ``asdict`` gives them), its
    sub-sections' fields included, each under :func:`old_key`."""
    out = {}
    for f in dataclasses.fields(obj):
        if is_section(f):
            out.update(values(getattr(obj, f.name), *kinds, path=f"{path}{f.name}."))
        elif kind(f) in kinds and not _at_default(f, getattr(obj, f.name)):
            out[old_key(f, path)] = _plain(getattr(obj, f.name))
    return out


def flat(obj) -> dict:
    """Every field of config section ``obj`` as one flat ``{key: value}``, sub-sections included, each under
    :func:`old_key`: the section as it was before sub-sections existed, for fingerprints that must not change."""
    return values(obj, *KINDS)


def _plain(value):
    """A field's value as ``dataclasses.asdict`` gives it (lists and dicts copied, dataclasses as dicts)."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
