"""The base model, read from a diffusers-format directory or hub id through ``from_pretrained`` only.

Every model takes this one path; only ``model.path`` differs. What differs between FLUX.1 and FLUX.2 is the
model's family (:mod:`rayflux.families`), chosen from its ``model_index.json``. One concept a module:

- :mod:`~rayflux.models.location`: where the model is read from, and its parts' configs;
- :mod:`~rayflux.models.facts`: its family, facts and identity from those configs alone;
- :mod:`~rayflux.models.precision`: the dtypes its parts run in;
- :mod:`~rayflux.models.devices`: the device this process computes on;
- :mod:`~rayflux.models.loaders`: its parts loaded, or its transformer on the meta device;
- :mod:`~rayflux.models.render_model`: the model validation renders use, and the job's warning about the model.

The names below are the package's surface (``models.model_facts(cfg)``), so a caller need not know which module
holds what.
"""

from rayflux.families.base import Family, ModelFacts
from rayflux.models.devices import choose_device, default_device
from rayflux.models.facts import check_family, family, model_facts, shift_config
from rayflux.models.loaders import load_text_encoders, load_transformer, load_vae, meta_transformer
from rayflux.models.location import read_config, resolve_path, revision_kw
from rayflux.models.precision import cpu_has_fast_bf16, torch_dtype, vae_dtype
from rayflux.models.render_model import check_validation_model, render_model, training_warning

__all__ = [
    "Family",
    "ModelFacts",
    "check_family",
    "check_validation_model",
    "choose_device",
    "cpu_has_fast_bf16",
    "default_device",
    "family",
    "load_text_encoders",
    "load_transformer",
    "load_vae",
    "meta_transformer",
    "model_facts",
    "read_config",
    "render_model",
    "resolve_path",
    "revision_kw",
    "shift_config",
    "torch_dtype",
    "training_warning",
    "vae_dtype",
]
