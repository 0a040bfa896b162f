"""What the job knows of a model from its configs alone: its family, its facts and their identity (weight file
names and sizes), and its scheduler's shift constants."""

from __future__ import annotations

from pathlib import Path

from rayflux import storage
from rayflux.config import ModelConfig
from rayflux.families.base import Family, ModelFacts
from rayflux.models.location import config_path, read_config, resolve_path, revision_kw


def weight_files(path: str, subfolders: list[str]) -> list:
    """Names and sizes of weight files (local or in object storage); cheap, and changes whenever they are replaced."""
    if storage.is_uri(path):
        import pyarrow.fs as pafs

        fs, inner = storage.resolve(path)
        return sorted(
            [sub, i.base_name, i.size]
            for sub in subfolders
            for i in fs.get_file_info(pafs.FileSelector(f"{inner}/{sub}", allow_not_found=True))
            if i.base_name.endswith(".safetensors")
        )
    root = Path(path)
    if not root.is_dir():
        return []
    sig = []
    for sub in subfolders:
        for f in sorted((root / sub).glob("*.safetensors")):
            sig.append([sub, f.name, f.stat().st_size, int(f.stat().st_mtime)])
    return sig


def check_family(path: str, revision: str = "") -> Family:
    """The family of a model (``model_index.json``'s ``_class_name``). A model of another family, or a local
    directory missing one of its family's parts, is refused in one line naming its class, the supported families
    and the missing part."""
    from rayflux import families

    found = families.class_name(path, revision)
    family = families.FAMILIES.get(found)
    root = Path(path)
    missing = [p for p in family.parts if not (root / p).exists()] if family and root.is_dir() else []
    if family and not missing:
        return family
    gap = f"; missing {', '.join(missing)}" if missing else ""
    raise ValueError(f"model.path {path} holds {found}, not a supported family: {families.supported()}{gap}")


def family(cfg: ModelConfig) -> Family:
    """The model's family, from its ``model_index.json`` (an object-store model's config files are copied first)."""
    return check_family(config_path(cfg), cfg.revision)


def model_facts(cfg: ModelConfig) -> ModelFacts:
    path = cfg.path if storage.is_uri(cfg.path) else resolve_path(cfg)
    fam = family(cfg)
    configs = {s: read_config(cfg, s) for s in fam.config_parts}
    identity = {
        "weights": weight_files(path, list(fam.encoder_parts)),
        "path": path if not Path(path).is_dir() else "",
        "revision": cfg.revision,
    }
    return fam.facts(configs, identity, cfg.text_tokens)


SHIFT_KEYS = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
"""The ``scheduler_config.json`` fields of FLUX's resolution-dependent shift (read by
:func:`rayflux.train.flow.flux_mu`)."""


def shift_config(cfg: ModelConfig) -> dict:
    """The model's own ``flux_shift`` constants from its ``scheduler/scheduler_config.json`` (the fields of
    :data:`SHIFT_KEYS` that it sets), and ``num_steps``, its pipeline's default denoising steps (``flux2_shift``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    path, kw = resolve_path(cfg), revision_kw(cfg)
    config = FlowMatchEulerDiscreteScheduler.load_config(path, **{"subfolder": "scheduler", **kw})
    # FLUX.2's μ also depends on the steps its pipeline denoises in (flux2_shift).
    return {**{k: config[k] for k in SHIFT_KEYS if k in config}, "num_steps": family(cfg).inference_steps(path, kw)}
