"""Model families by ``model_index.json`` class: the one place that knows which model a directory holds.

See :mod:`rayflux.families.base` for the interface; each family is one module (:mod:`.flux1`, :mod:`.flux2`,
:mod:`.kontext`).
"""

from __future__ import annotations

import json
from pathlib import Path

from rayflux.families.base import Family, ModelFacts, TextTensor
from rayflux.families.flux1 import Flux1
from rayflux.families.flux2 import Flux2
from rayflux.families.kontext import Kontext

__all__ = ["Family", "ModelFacts", "TextTensor", "FAMILIES", "by_name", "for_class", "class_name", "supported", "of_transformer"]

# A loaded transformer names its family by class; FLUX.1 comes before Kontext, which shares its transformer.
_ALL: tuple[Family, ...] = (Flux1(), Flux2(), Kontext())
FAMILIES: dict[str, Family] = {cls: f for f in _ALL for cls in f.pipelines}
"""``model_index.json`` ``_class_name`` -> its family."""


def by_name(name: str) -> Family:
    """The family recorded in :attr:`ModelFacts.family`."""
    for f in _ALL:
        if f.name == name:
            return f
    raise KeyError(f"unknown model family {name!r}; known: {', '.join(f.name for f in _ALL)}")


def supported() -> str:
    """The trainable classes with what users call them, for error messages."""
    return ", ".join(f"{cls} ({what})" for f in _ALL for cls, what in f.pipelines.items())


def class_name(path: str, revision: str = "") -> str:
    """``_class_name`` of a model's ``model_index.json`` (local directory or hub id); ``"?"`` when it has none."""
    root = Path(path)
    if root.is_dir():
        index = root / "model_index.json"
        return json.loads(index.read_text()).get("_class_name", "?") if index.is_file() else "no model_index.json"
    from diffusers import DiffusionPipeline

    config = DiffusionPipeline.load_config(path, **({"revision": revision} if revision else {}))
    return config.get("_class_name", "?")


def for_class(name: str) -> Family:
    """The family of a ``model_index.json`` class; a clear error naming the supported ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"{name} is not a supported family: {supported()}")
    return FAMILIES[name]


def of_transformer(transformer) -> Family:
    """The family of a loaded transformer (peft-wrapped or DDP-wrapped ones included), by its class."""
    model = getattr(transformer, "module", transformer)
    names = {c.__name__ for c in type(model).__mro__}
    for f in _ALL:
        if f.transformer_class in names:
            return f
    raise ValueError(f"{type(model).__name__} is not the transformer of a supported family: {supported()}")
