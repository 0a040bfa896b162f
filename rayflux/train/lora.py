"""LoRA adapters through peft (``add_adapter``), and saving/loading in diffusers' format."""

from __future__ import annotations

from pathlib import Path

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
FFS = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"]
PRESETS = {
    "attention": ATTENTION,
    "attention+ffs": ATTENTION + FFS,
    # Every linear layer of the blocks, including modulation (norm) projections.
    "all": ATTENTION + FFS + ["norm1.linear", "norm1_context.linear", "norm.linear"],
}
WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def target_modules(spec: str) -> list[str]:
    """A preset name or a comma-separated list of module names."""
    if spec in PRESETS:
        return list(PRESETS[spec])
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ValueError(f"train.targets {spec!r} names no modules; presets: {', '.join(PRESETS)}")
    return names


def add_lora(transformer, rank: int, alpha: float, targets: str, dropout: float = 0.0) -> list:
    """Freeze the transformer, attach a LoRA adapter, and return its trainable parameters (kept in fp32)."""
    import torch
    from peft import LoraConfig

    transformer.requires_grad_(False)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        init_lora_weights="gaussian",
        target_modules=target_modules(targets),
    )
    transformer.add_adapter(config)
    params = [p for p in transformer.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"train.targets {targets!r} matched no module of the transformer")
    for p in params:
        # Adapter weights train in fp32 even when the frozen base is bf16: tiny updates survive rounding.
        p.data = p.data.to(torch.float32)
    return params


def lora_state_dict(transformer) -> dict:
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(transformer)


def save_diffusers(transformer, directory: str | Path) -> Path:
    """Write ``pytorch_lora_weights.safetensors`` with ``transformer.*`` keys via ``FluxPipeline.save_lora_weights``."""
    from diffusers import FluxPipeline

    FluxPipeline.save_lora_weights(str(directory), transformer_lora_layers=lora_state_dict(transformer))
    return Path(directory) / WEIGHT_NAME


def load_into(transformer, path: str | Path) -> None:
    """Load a diffusers-format LoRA file into an adapter already attached with :func:`add_lora`."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(path))
    state = {k.removeprefix("transformer."): v for k, v in state.items()}
    result = set_peft_model_state_dict(transformer, state)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"{path}: LoRA keys do not match the adapter, e.g. {unexpected[:3]}")
