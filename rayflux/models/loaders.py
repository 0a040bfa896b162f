"""The model's parts loaded through the family's ``from_pretrained`` calls, and its transformer on the meta device."""

from __future__ import annotations

from rayflux.config import ModelConfig
from rayflux.models.facts import family
from rayflux.models.location import resolve_path, revision_kw


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
