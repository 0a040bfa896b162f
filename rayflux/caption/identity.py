"""Who made a caption: the captioner's identity, a hash of its model and every setting that changes its words.

A caption is kept under the image's content hash and this identity, so a rerun with the same captioner reuses it
and another model, prompt, token limit or dtype captions again. ``caption.prefix`` is not part of it (it is added
when the cache reads a caption), nor are batch size and placement.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from rayflux.config.caption import CaptionConfig

IDENTITY_VERSION = 1
"""Bumped when the captioner's code changes what it generates for the same settings (its chat prompt, decoding)."""
_MODEL_FILES = ("config.json", "generation_config.json", "preprocessor_config.json", "processor_config.json")


@dataclass(frozen=True)
class Captioner:
    """A resolved captioner: where its model is, and the identity its captions are kept under."""

    model: str
    """The model directory or hub id the actors load (the tiny captioner's directory when ``caption.model`` is
    empty)."""
    prompt: str
    max_new_tokens: int
    dtype: str
    id: str
    """16 hex digits: :func:`captioner_id` of the above."""


def resolve_model(c: CaptionConfig) -> str:
    """``caption.model``, or the tiny random captioner built locally when it is empty."""
    if c.model:
        return c.model
    from rayflux.testing.tiny_vlm import ensure_tiny_vlm

    return str(ensure_tiny_vlm())


def model_identity(model: str) -> dict:
    """What identifies a model: for a local directory its configs' bytes and its weight files' names and sizes
    (a re-trained model in the same folder captions again); for a hub id the id itself."""
    if not os.path.isdir(model):
        return {"hub": model}
    configs = {}
    for name in _MODEL_FILES:
        path = os.path.join(model, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                configs[name] = hashlib.sha256(f.read()).hexdigest()
    weights = {
        name: os.path.getsize(os.path.join(model, name))
        for name in sorted(os.listdir(model))
        if name.endswith((".safetensors", ".bin"))
    }
    return {"configs": configs, "weights": weights}


def captioner(c: CaptionConfig, dtype: str) -> Captioner:
    """The job's captioner; ``dtype`` is ``caption.dtype`` with ``auto`` resolved for this cluster."""
    model = resolve_model(c)
    ident = {
        "version": IDENTITY_VERSION,
        "model": model_identity(model),
        "prompt": c.prompt,
        "max_new_tokens": c.max_new_tokens,
        "dtype": dtype,
    }
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return Captioner(model=model, prompt=c.prompt, max_new_tokens=c.max_new_tokens, dtype=dtype, id=digest)
