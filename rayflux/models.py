"""Load a model's parts from a diffusers-format directory or hub id, through ``from_pretrained`` only.

Every model takes this one path; only ``model.path`` differs. What differs between FLUX.1 and FLUX.2 is the
model's family (:mod:`rayflux.families`), chosen from its ``model_index.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from rayflux import storage
from rayflux.config import ModelConfig
from rayflux.families.base import Family, ModelFacts

__all__ = ["ModelFacts", "Family"]


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


def _kwargs(cfg: ModelConfig, subfolder: str) -> dict:
    kw: dict = {"subfolder": subfolder}
    if cfg.revision:
        kw["revision"] = cfg.revision
    return kw


def torch_dtype(name: str, device: str):
    """Map ``model.dtype`` to a torch dtype; ``auto`` is bf16 on GPU and fp32 on CPU (CPU bf16 matmuls are slow)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, name)


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU computes bf16 natively (x86 AVX512-BF16 or AMX), where oneDNN's bf16 convolutions run about
    twice as fast as fp32. torch exposes the check only under private names, so a torch without them answers no."""
    import torch

    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def vae_dtype(cfg: ModelConfig, device: str, fast_bf16: bool | None = None):
    """The VAE's dtype in the cache stage: ``model.vae_dtype``, else ``model.dtype``; ``auto`` is bf16 on GPU and, on
    CPU, bf16 where the CPU computes it natively (``fast_bf16``; detected when None), else fp32. bf16 is what FLUX's
    trainers encode with on GPUs: its latents differ from fp32's by about 2% (relative L2, measured on FLUX.1's VAE),
    and on such a CPU the encode takes half the time."""
    import torch

    name = cfg.vae_dtype or cfg.dtype
    if name != "auto" or device.startswith("cuda"):
        return torch_dtype(name, device)
    if fast_bf16 is None:
        fast_bf16 = cpu_has_fast_bf16()
    return torch.bfloat16 if fast_bf16 else torch.float32


def choose_device(cuda_available: bool, in_ray_worker: bool, ray_gpu_ids: list) -> str:
    """cuda only where this process holds a GPU. A Ray worker that reserved no GPU still sees the node's GPUs (Ray
    2.60 leaves ``CUDA_VISIBLE_DEVICES`` alone for it), so there only Ray's GPU ids count."""
    if not cuda_available:
        return "cpu"
    if in_ray_worker:
        return "cuda" if ray_gpu_ids else "cpu"
    return "cuda"


def default_device() -> str:
    """The device for this process: see :func:`choose_device`."""
    import torch

    in_worker, gpu_ids = False, []
    try:
        import ray

        if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
            in_worker, gpu_ids = True, list(ray.get_gpu_ids())
    except ImportError:
        pass
    return choose_device(torch.cuda.is_available(), in_worker, gpu_ids)


def _load_config(path: str, cfg: ModelConfig, subfolder: str) -> dict:
    local = Path(path).expanduser() / subfolder / "config.json"
    if local.is_file():  # a directory on this machine: plain JSON, without importing diffusers (and torch) here
        return json.loads(local.read_text())
    from diffusers import AutoencoderKL

    # Any diffusers ConfigMixin can read any subfolder's config.json, from a local dir or the hub cache.
    return dict(AutoencoderKL.load_config(path, **_kwargs(cfg, subfolder)))


def _looks_local(path: str) -> bool:
    """A path, not a hub id (``org/name``) or URI: absolute, relative with ./ or ../, or home-relative."""
    return path.startswith(("/", "./", "../", "~")) or Path(path).exists()


def read_config(cfg: ModelConfig, subfolder: str) -> dict:
    """One part's ``config.json``, read here (on the driver). A local ``model.path`` must therefore exist on the
    machine that runs the job's driver as well as on the workers."""
    return _load_config(_config_path(cfg), cfg, subfolder)


def _config_path(cfg: ModelConfig) -> str:
    """Where this machine reads the model's configs from; a local ``model.path`` that is not here is refused."""
    path = resolve_path(cfg, configs_only=True)
    if _looks_local(path) and not Path(path).expanduser().is_dir():
        raise FileNotFoundError(
            f"model.path={path}: no such directory on this machine; the job reads the model's configs on the driver "
            "(the head node), so a local model.path must exist there too (or use a hub id)"
        )
    return path


def _weights_signature(path: str, subfolders: list[str]) -> list:
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
    return check_family(_config_path(cfg), cfg.revision)


def model_facts(cfg: ModelConfig) -> ModelFacts:
    path = cfg.path if storage.is_uri(cfg.path) else resolve_path(cfg)
    fam = family(cfg)
    configs = {s: read_config(cfg, s) for s in fam.config_parts}
    identity = {
        "weights": _weights_signature(path, list(fam.encoder_parts)),
        "path": path if not Path(path).is_dir() else "",
        "revision": cfg.revision,
    }
    return fam.facts(configs, identity, cfg.text_tokens)


def shift_config(cfg: ModelConfig) -> dict:
    """The model's own ``flux_shift`` constants from its ``scheduler/scheduler_config.json`` (the fields of
    :data:`rayflux.train.flow.SHIFT_KEYS` that it sets)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from rayflux.train.flow import SHIFT_KEYS

    config = FlowMatchEulerDiscreteScheduler.load_config(resolve_path(cfg), **_kwargs(cfg, "scheduler"))
    return {k: config[k] for k in SHIFT_KEYS if k in config}


def revision_kw(cfg: ModelConfig) -> dict:
    """``from_pretrained`` keyword arguments that pin ``model.revision`` (none when unset)."""
    return {"revision": cfg.revision} if cfg.revision else {}


def load_vae(cfg: ModelConfig, device: str, dtype):
    return family(cfg).load_vae(resolve_path(cfg), revision_kw(cfg), device, dtype)


def load_text_encoders(cfg: ModelConfig, device: str, dtype):
    """The family's text encoders with their tokenizers. Only the cache stage's text actors ever call this."""
    return family(cfg).load_text_encoders(resolve_path(cfg), revision_kw(cfg), device, dtype)


def load_transformer(cfg: ModelConfig, device: str, dtype, extra: dict | None = None):
    """The denoising transformer; ``extra``: more ``from_pretrained`` arguments (``train.base_dtype=nf4``'s
    quantization config)."""
    return family(cfg).load_transformer(resolve_path(cfg), {**revision_kw(cfg), **(extra or {})}, device, dtype)


def meta_transformer(tc: dict, dtype=None):
    """The family's own transformer for config ``tc`` on the meta device: shapes, no memory, no weights (what the
    memory plan counts and a sharded base is built from). With ``dtype``, held as ``from_pretrained(torch_dtype=
    dtype)`` holds it: the modules the class keeps in float32 (``_keep_in_fp32_modules``) stay float32."""
    import diffusers
    import torch

    from rayflux import families

    with torch.device("meta"):
        model = getattr(diffusers, families.of_transformer_config(tc).transformer_class).from_config(dict(tc))
    if dtype is not None:
        torch.nn.Module.to(model, dtype)
        keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
        for name, module in model.named_modules():
            if keep & set(name.split(".")):
                module.float()
    return model
