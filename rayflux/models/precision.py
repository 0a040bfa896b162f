"""The dtypes a model's parts run in: ``model.dtype`` and ``model.vae_dtype``, with ``auto`` decided by the device."""

from __future__ import annotations

from rayflux.config import ModelConfig


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
