"""What a model directory (or hub id) says it is: the pipeline class named in its ``model_index.json``.

Its own module so that a family (FLUX.2 picks its pipeline by it) and the registry in :mod:`rayflux.families` both
import it, without the registry and a family importing each other.
"""

from __future__ import annotations

import json
from pathlib import Path


def class_name(path: str, revision: str = "") -> str:
    """``_class_name`` of a model's ``model_index.json`` (local directory or hub id); ``"?"`` when it has none."""
    root = Path(path)
    if root.is_dir():
        index = root / "model_index.json"
        return json.loads(index.read_text()).get("_class_name", "?") if index.is_file() else "no model_index.json"
    from diffusers import DiffusionPipeline

    config = DiffusionPipeline.load_config(path, **({"revision": revision} if revision else {}))
    return config.get("_class_name", "?")
