"""Where a model is read from: ``model.path`` as a local directory, a hub id or a URI copied to node-local disk,
and its parts' ``config.json`` read on the driver without importing diffusers where it can."""

from __future__ import annotations

import json
from pathlib import Path

from rayflux import storage
from rayflux.config import ModelConfig


def resolve_path(cfg: ModelConfig, configs_only: bool = False) -> str:
    """The directory or hub id to load. An empty ``model.path`` means the embedded tiny model, built if missing; a
    URI (``s3://...``) is copied to node-local disk once per node (only its config files when ``configs_only``)."""
    if cfg.path and storage.is_uri(cfg.path):
        from rayflux import model_sync

        return model_sync.local_dir(cfg.path, configs_only)
    if cfg.path:
        return cfg.path
    from rayflux.testing.tiny import ensure_tiny_model

    return str(ensure_tiny_model())


def _looks_local(path: str) -> bool:
    """A path, not a hub id (``org/name``) or URI: absolute, relative with ./ or ../, or home-relative."""
    return path.startswith(("/", "./", "../", "~")) or Path(path).exists()


def config_path(cfg: ModelConfig) -> str:
    """Where this machine reads the model's configs from; a local ``model.path`` that is not here is refused."""
    path = resolve_path(cfg, configs_only=True)
    if _looks_local(path) and not Path(path).expanduser().is_dir():
        raise FileNotFoundError(
            f"model.path={path}: no such directory on this machine; the job reads the model's configs on the driver "
            "(the head node), so a local model.path must exist there too (or use a hub id)"
        )
    return path


def read_config(cfg: ModelConfig, subfolder: str) -> dict:
    """One part's ``config.json``, read here (on the driver). A local ``model.path`` must therefore exist on the
    machine that runs the job's driver as well as on the workers."""
    return _load_config(config_path(cfg), cfg, subfolder)


def _load_config(path: str, cfg: ModelConfig, subfolder: str) -> dict:
    local = Path(path).expanduser() / subfolder / "config.json"
    if local.is_file():  # a directory on this machine: plain JSON, without importing diffusers (and torch) here
        return json.loads(local.read_text())
    from diffusers import AutoencoderKL

    # Any diffusers ConfigMixin can read any subfolder's config.json, from a local dir or the hub cache.
    return dict(AutoencoderKL.load_config(path, **{"subfolder": subfolder, **revision_kw(cfg)}))


def revision_kw(cfg: ModelConfig) -> dict:
    """``from_pretrained`` keyword arguments that pin ``model.revision`` (none when unset)."""
    return {"revision": cfg.revision} if cfg.revision else {}
