"""Load FLUX parts from a diffusers-format directory or hub id, through ``from_pretrained`` only.

The embedded tiny model, FLUX.1-dev and FLUX.1-schnell all take this one path; only ``model.path`` differs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
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


@dataclass(frozen=True)
class ModelFacts:
    """What the rest of the job needs to know about a model, read from its config files alone (no weights)."""

    vae_scale_factor: int
    latent_channels: int
    shift_factor: float
    scaling_factor: float
    guidance_embeds: bool
    t5_max_length: int
    identity: str
    """Hash of the VAE and text-encoder configs and weight file sizes/names (or the hub revision): part of the
    cache key, so a different encoder never reuses old latents."""

    @property
    def alignment(self) -> int:
        """Pixel sides must be multiples of this: VAE downscale times the 2x2 latent packing."""
        return 2 * self.vae_scale_factor


def _load_config(path: str, cfg: ModelConfig, subfolder: str) -> dict:
    from diffusers import AutoencoderKL

    # Any diffusers ConfigMixin can read any subfolder's config.json, from a local dir or the hub cache.
    return dict(AutoencoderKL.load_config(path, **_kwargs(cfg, subfolder)))


def _looks_local(path: str) -> bool:
    """A path, not a hub id (``org/name``) or URI: absolute, relative with ./ or ../, or home-relative."""
    return path.startswith(("/", "./", "../", "~")) or Path(path).exists()


def read_config(cfg: ModelConfig, subfolder: str) -> dict:
    """One part's ``config.json``, read here (on the driver). A local ``model.path`` must therefore exist on the
    machine that runs the job's driver as well as on the workers."""
    path = resolve_path(cfg, configs_only=True)
    if _looks_local(path) and not Path(path).expanduser().is_dir():
        raise FileNotFoundError(
            f"model.path={path}: no such directory on this machine; the job reads the model's configs on the driver "
            "(the head node), so a local model.path must exist there too (or use a hub id)"
        )
    return _load_config(path, cfg, subfolder)


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


FAMILIES = {"FluxPipeline": "FLUX.1 [dev] / [schnell]"}
"""``model_index.json`` classes the job can train, with what users call them."""
PARTS = ("transformer/config.json", "vae/config.json", "text_encoder/config.json", "text_encoder_2/config.json",
         "tokenizer", "tokenizer_2", "scheduler/scheduler_config.json")  # fmt: skip


def check_family(path: str) -> None:
    """Refuse a local model directory of another family, or one missing a part, in one line that names the class
    in its ``model_index.json``, the supported families and the missing part. (Hub ids are checked by the hub.)"""
    root = Path(path)
    if not root.is_dir():
        return
    index = root / "model_index.json"
    found = json.loads(index.read_text()).get("_class_name", "?") if index.is_file() else "no model_index.json"
    missing = [p for p in PARTS if not (root / p).exists()]
    if found in FAMILIES and not missing:
        return
    supported = ", ".join(f"{k} ({v})" for k, v in FAMILIES.items())
    gap = f"; missing {', '.join(missing)}" if missing else ""
    raise ValueError(f"model.path {path} holds {found}, not a supported family: {supported}{gap}")


def model_facts(cfg: ModelConfig) -> ModelFacts:
    path = cfg.path if storage.is_uri(cfg.path) else resolve_path(cfg)
    check_family(path)
    vae, transformer, clip, t5 = (read_config(cfg, s) for s in ("vae", "transformer", "text_encoder", "text_encoder_2"))
    # FLUX.1-schnell was distilled with 256 T5 tokens and dev with 512; guidance_embeds tells them apart.
    guidance = bool(transformer.get("guidance_embeds", False))
    t5_len = 512 if guidance else 256
    blob = json.dumps(
        {
            "vae": {k: v for k, v in vae.items() if not k.startswith("_")},
            "clip": {k: v for k, v in clip.items() if not k.startswith("_")},
            "t5": {k: v for k, v in t5.items() if not k.startswith("_")},
            "weights": _weights_signature(path, ["vae", "text_encoder", "text_encoder_2"]),
            "path": path if not Path(path).is_dir() else "",
            "revision": cfg.revision,
            "t5_len": t5_len,
        },
        sort_keys=True,
        default=str,
    )
    return ModelFacts(
        vae_scale_factor=2 ** (len(vae["block_out_channels"]) - 1),
        latent_channels=int(vae["latent_channels"]),
        shift_factor=float(vae.get("shift_factor") or 0.0),
        scaling_factor=float(vae["scaling_factor"]),
        guidance_embeds=guidance,
        t5_max_length=t5_len,
        identity=hashlib.sha256(blob.encode()).hexdigest()[:16],
    )


def shift_config(cfg: ModelConfig) -> dict:
    """The model's own ``flux_shift`` constants from its ``scheduler/scheduler_config.json`` (the fields of
    :data:`rayflux.train.flow.SHIFT_KEYS` that it sets)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from rayflux.train.flow import SHIFT_KEYS

    config = FlowMatchEulerDiscreteScheduler.load_config(resolve_path(cfg), **_kwargs(cfg, "scheduler"))
    return {k: config[k] for k in SHIFT_KEYS if k in config}


def load_vae(cfg: ModelConfig, device: str, dtype):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(resolve_path(cfg), torch_dtype=dtype, **_kwargs(cfg, "vae"))
    return vae.to(device).eval().requires_grad_(False)


def load_text_encoders(cfg: ModelConfig, device: str, dtype):
    """CLIP-L and T5-XXL with their tokenizers. Only the cache stage's text actors ever call this."""
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

    path = resolve_path(cfg)
    clip_tok = CLIPTokenizer.from_pretrained(path, **_kwargs(cfg, "tokenizer"))
    t5_tok = T5TokenizerFast.from_pretrained(path, **_kwargs(cfg, "tokenizer_2"))
    clip = CLIPTextModel.from_pretrained(path, dtype=dtype, **_kwargs(cfg, "text_encoder"))
    t5 = T5EncoderModel.from_pretrained(path, dtype=dtype, **_kwargs(cfg, "text_encoder_2"))
    clip = clip.to(device).eval().requires_grad_(False)
    t5 = t5.to(device).eval().requires_grad_(False)
    return clip_tok, clip, t5_tok, t5


def load_transformer(cfg: ModelConfig, device: str, dtype):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(resolve_path(cfg), torch_dtype=dtype, **_kwargs(cfg, "transformer"))
    return model.to(device)
