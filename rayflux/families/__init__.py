"""Model families by ``model_index.json`` class: the one place that knows which model a directory holds.

See :mod:`rayflux.families.base` for the interface; each family is one module (:mod:`.flux1`, :mod:`.flux2`,
:mod:`.kontext`).
"""

from __future__ import annotations

from rayflux.families.base import Family, ModelFacts, TextTensor
from rayflux.families.flux1 import Flux1
from rayflux.families.flux2 import Flux2
from rayflux.families.kontext import Kontext
from rayflux.families.model_index import class_name

__all__ = [
    "Family",
    "ModelFacts",
    "TextTensor",
    "FAMILIES",
    "by_name",
    "for_class",
    "class_name",
    "supported",
    "of_transformer",
    "of_transformer_config",
    "BUILT_IN",
    "DEFAULT_BUILT_IN",
    "ENCODER_CLASSES",
]

# A loaded transformer names its family by class; FLUX.1 comes before Kontext, which shares its transformer.
_ALL: tuple[Family, ...] = (Flux1(), Flux2(), Kontext())
FAMILIES: dict[str, Family] = {cls: f for f in _ALL for cls in f.pipelines}
"""``model_index.json`` ``_class_name`` -> its family."""
BUILT_IN: dict[str, tuple[dict, str]] = {name: known for f in _ALL for name, known in f.built_in_configs.items()}
"""``python -m rayflux plan --model NAME``: every family's built-in transformer configs, with what users call them."""
DEFAULT_BUILT_IN = "flux1-dev"
"""What ``plan`` counts for a job whose ``model.path`` is empty (the embedded tiny model is no model to plan)."""
ENCODER_CLASSES: dict[str, tuple[str, ...]] = {
    package: tuple(sorted({c for f in _ALL for c in f.encoder_classes.get(package, ())}))
    for package in sorted({p for f in _ALL for p in f.encoder_classes})
}
"""Every family's encoder classes by package (see :attr:`Family.encoder_classes`)."""


def by_name(name: str) -> Family:
    """The family recorded in :attr:`ModelFacts.family`."""
    for f in _ALL:
        if f.name == name:
            return f
    raise KeyError(f"unknown model family {name!r}; known: {', '.join(f.name for f in _ALL)}")


def supported() -> str:
    """The trainable classes with what users call them, for error messages."""
    return ", ".join(f"{cls} ({what})" for f in _ALL for cls, what in f.pipelines.items())


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


def of_transformer_config(config: dict) -> Family:
    """The family of a transformer ``config.json`` by its ``_class_name`` (FLUX.1's class when it names none)."""
    name = config.get("_class_name", "FluxTransformer2DModel")
    for f in _ALL:
        if f.transformer_class == name:
            return f
    raise ValueError(f"{name} is not the transformer of a supported family: {supported()}")
