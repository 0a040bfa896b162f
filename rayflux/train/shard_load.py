"""Load a sharded frozen transformer: each worker reads only its own rows of each weight from the safetensors files.

The model is built on the meta device from its ``config.json`` (no memory), sharded by
:func:`rayflux.train.sharding.shard`, given empty local shards on the worker's device, and then filled tensor by
tensor through ``safe_open(...).get_slice``: a worker never holds a whole weight it does not keep, let alone the whole
model. The files are the ones ``from_pretrained`` would read: ``model.path``'s local directory (an object-store
path is first copied to node-local disk once per node, :mod:`rayflux.model_sync`) or the hub cache.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rayflux import models
from rayflux.config import ModelConfig
from rayflux.train import sharding

SUBFOLDER = "transformer"


def meta_transformer(cfg: ModelConfig, dtype):
    """The model's transformer built from its ``config.json`` on the meta device, in ``dtype``: shapes, no weights
    (:func:`rayflux.models.meta_transformer`, the same model the memory plan counts)."""
    return models.meta_transformer(models.read_config(cfg, SUBFOLDER), dtype)


def weights_dir(cfg: ModelConfig) -> Path:
    """The local directory holding the transformer's safetensors files (a hub id resolves to its cached snapshot)."""
    path = models.resolve_path(cfg)
    local = Path(path).expanduser()
    if not (local / SUBFOLDER).is_dir():
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(path, allow_patterns=[f"{SUBFOLDER}/*"], **models.revision_kw(cfg)))
    return local / SUBFOLDER


def tensor_files(folder: Path) -> dict[str, Path]:
    """``{tensor name: file}`` from the sharded checkpoint's index, else from every ``*.safetensors`` file."""
    from safetensors import safe_open

    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        weight_map = json.loads(index[0].read_text())["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no safetensors files to load the sharded base from")
    out = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            out.update({name: file for name in f.keys()})
    return out


def load(cfg: ModelConfig, device, dtype, mesh, meta=None) -> torch.nn.Module:
    """The transformer sharded over ``mesh``, each rank holding only its rows of every parameter. ``meta``: the
    :func:`meta_transformer` this worker already built (``train.workers.base_fsdp=auto`` counts it first), used in place."""
    transformer = meta if meta is not None else meta_transformer(cfg, dtype)
    sharding.shard(transformer, mesh)
    transformer.to_empty(device=device)
    fill(transformer, tensor_files(weights_dir(cfg)), mesh)
    return transformer


def fill(transformer, files: dict[str, Path], mesh) -> None:
    """Copy this rank's rows of every parameter (and every buffer, whole) from ``files``."""
    from safetensors import safe_open

    shards, index = mesh.size(-1), mesh.get_local_rank(mesh.ndim - 1)
    targets = dict(transformer.named_parameters())
    targets.update(transformer.named_buffers())
    missing = sorted(set(targets) - set(files))
    if missing:
        raise ValueError(f"the transformer's weights lack {len(missing)} tensors, e.g. {missing[:3]}")
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(str(file), "pt") as f:
                for name in names:
                    target = targets[name]
                    local = target.to_local() if hasattr(target, "to_local") else target
                    if local is target or target.dim() == 0:  # a buffer (or a scalar) is held whole
                        local.copy_(f.get_tensor(name))
                        continue
                    start, stop = sharding.shard_rows(target.shape[0], shards, index)
                    if local.shape[0] != stop - start:
                        raise RuntimeError(f"{name}: local shard has {local.shape[0]} rows, expected {stop - start}")
                    if stop > start:
                        local.copy_(f.get_slice(name)[start:stop])
