"""What a model directory (or hub id) says it is: its ``model_index.json``, the pipeline class it names and the
pipeline's own settings (FLUX.2 [klein]'s ``is_distilled``).

Its own module so that a family (FLUX.2 picks its pipeline by it) and the registry in :mod:`rayflux.families` both
import it, without the registry and a family importing each other.
"""

from __future__ import annotations

import json
from pathlib import Path


def pipeline_config(path: str, revision: str = "") -> dict:
    """A model's ``model_index.json`` (local directory or hub id); ``{}`` for a local directory without one."""
    root = Path(path)
    if root.is_dir():
        index = root / "model_index.json"
        return json.loads(index.read_text()) if index.is_file() else {}
    from diffusers import DiffusionPipeline

    return dict(DiffusionPipeline.load_config(path, **({"revision": revision} if revision else {})))


def class_name(path: str, revision: str = "") -> str:
    """``_class_name`` of a model's ``model_index.json`` (local directory or hub id); ``"?"`` when it has none."""
    root = Path(path)
    if root.is_dir() and not (root / "model_index.json").is_file():
        return "no model_index.json"
    return pipeline_config(path, revision).get("_class_name", "?")
