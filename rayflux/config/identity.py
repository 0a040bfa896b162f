"""What each config field is part of: the cache key, the run's identity, or neither.

Every field of every config section declares it beside its docstring, as dataclass field metadata
(``field(default=..., metadata=CACHED)``); the cache key (:func:`rayflux.cache.keys.cache_key`), a dataset's cache
identity (:func:`rayflux.datasets.cache_identity`) and the run identity (:func:`rayflux.job.run_identity`) are taken
from these declarations, never from key lists kept elsewhere. A field that declares nothing fails a test
(``tests/test_config.py``).
"""

from __future__ import annotations

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

KINDS = ("cache", "captions", "run", "none")


def kind(f: dataclasses.Field) -> str | None:
    """The identity a field declares, or None when it declares nothing."""
    return f.metadata.get(IDENTITY)


def names(cls, *kinds: str) -> list[str]:
    """The fields of config dataclass ``cls`` (an instance or a class) that declare one of ``kinds``."""
    return [f.name for f in dataclasses.fields(cls) if kind(f) in kinds]


def values(obj, *kinds: str) -> dict:
    """``{field: value}`` of the fields of ``obj`` that declare one of ``kinds`` (values as ``asdict`` gives them)."""
    d = dataclasses.asdict(obj)
    return {n: d[n] for n in names(obj, *kinds)}
