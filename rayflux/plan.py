"""The memory plan of a training run: parameter counts on the meta device, and what weights, the LoRA with AdamW,
and activations (with and without gradient checkpointing) take on a GPU.

``python -m rayflux plan [--config FILE] [--set KEY=VALUE ...] [--model NAME] [--gpus-per-node N]`` prints it for
the job's settings, reading only the transformer's ``config.json`` from ``model.path`` (FLUX.1-dev's own
configuration when ``model.path`` is empty; a :data:`BUILT_IN` one with ``--model``, e.g. ``flux2-dev``), so it
needs no weights and no GPU. It ends with each ``train.base_sharding`` x ``train.base_dtype`` option's memory per GPU
(:mod:`rayflux.plan_base`).

The activation estimate counts, per token and per block, the tensors autograd keeps for the backward pass, in the
autocast dtype (bf16 on GPU), with ``h`` the hidden width (heads x head dim) and ``m`` the MLP width (ratio x h):

- a double-stream block keeps, for each token in its own stream: the modulated norm output (h), q/k/v (3h), q and k
  after RMS norm and RoPE and the joint concatenation (3h), the attention output (h), the output projection (h), the
  second norm output (h), the MLP's first projection and GELU output (2m) and its second projection (h): 11h + 2m;
- a single-stream block keeps: the norm output (h), q/k/v (3h), q/k after norm and RoPE (2h), the attention output
  (h), the MLP projection and GELU output (2m), their concatenation (h + m) and the output projection (h): 9h + 3m;
- with checkpointing each block keeps only its input (h per token) and one block at a time is recomputed, so the
  peak is (double + single blocks) x h plus the larger block's full set.

FLUX.2's blocks differ in their MLP, a SwiGLU (``linear_in`` to 2m, gated down to m) with ``mlp_ratio`` 3, and in its
single blocks' fused projection (q/k/v and the MLP's input in one Linear of 3h + 2m):

- a FLUX.2 double-stream block keeps 11h + 3m per token (the MLP keeps 2m + m instead of 2m);
- a FLUX.2 single-stream block keeps: the norm output (h), the fused projection (3h + 2m), q/k after norm and RoPE
  (2h), the attention output (h), the SwiGLU output (m), the concatenation (h + m) and the output projection (h):
  9h + 4m.

Attention itself runs through SDPA's fused kernels, which keep no L x L matrix. Weights are counted in the frozen
dtype (bf16 by default on GPU; ``train.base_dtype``, see :mod:`rayflux.plan_base`), the LoRA in fp32 with its
gradient and AdamW's two moments (16 bytes a parameter). Parameters are counted on the family's own transformer,
built on the meta device.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from rayflux import cli, config, plan_base
from rayflux.config.train import checkpointing_setting
from rayflux.families.flux1 import t5_length
from rayflux.train import lora

FLUX1_DEV = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
"""FLUX.1-dev's transformer ``config.json`` (black-forest-labs/FLUX.1-dev, subfolder ``transformer``)."""
FLUX2_DEV = {"_class_name": "Flux2Transformer2DModel", "patch_size": 1, "in_channels": 128, "num_layers": 8,
             "num_single_layers": 48, "attention_head_dim": 128, "num_attention_heads": 48,
             "joint_attention_dim": 15360, "mlp_ratio": 3.0, "axes_dims_rope": [32, 32, 32, 32],
             "guidance_embeds": True}  # fmt: skip
"""FLUX.2 [dev] (about 32B parameters): diffusers' ``Flux2Transformer2DModel`` defaults."""
FLUX2_KLEIN_9B = {**FLUX2_DEV, "num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32,
                  "joint_attention_dim": 12288, "guidance_embeds": False}  # fmt: skip
"""FLUX.2 [klein] 9B (black-forest-labs/FLUX.2-klein-9B, subfolder ``transformer``)."""
FLUX2_KLEIN_4B = {**FLUX2_DEV, "num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24,
                  "joint_attention_dim": 7680, "guidance_embeds": False}  # fmt: skip
"""FLUX.2 [klein] 4B (black-forest-labs/FLUX.2-klein-4B, subfolder ``transformer``)."""
BUILT_IN = {"flux1-dev": (FLUX1_DEV, "FLUX.1-dev"), "flux2-dev": (FLUX2_DEV, "FLUX.2 [dev]"),
            "flux2-klein-9b": (FLUX2_KLEIN_9B, "FLUX.2 [klein] 9B"),
            "flux2-klein-4b": (FLUX2_KLEIN_4B, "FLUX.2 [klein] 4B")}  # fmt: skip
"""``python -m rayflux plan --model NAME``: built-in transformer configs, planned without any file."""
MLP_RATIO = 4
PIXELS_PER_TOKEN = 16
"""VAE downscale (8) times the 2x2 latent packing: one image token per 16x16 pixels."""
GIB = 2**30
LORA_BYTES_PER_PARAM = 16
"""fp32 weight, fp32 gradient and AdamW's two fp32 moments."""


FLUX1_DEV_TEXT_TOKENS = t5_length(guidance=True)
"""Text tokens per sample of the built-in FLUX.1-dev configuration."""


def text_tokens(cfg: config.JobConfig) -> int:
    """Text tokens per sample: the padded length the model's family encodes every caption to (FLUX.1 [dev]: 512 T5
    tokens, [schnell]: 256; FLUX.2: 512), or FLUX.1-dev's when ``model.path`` is empty."""
    if not cfg.model.path:
        return FLUX1_DEV_TEXT_TOKENS
    from rayflux.models import model_facts

    return model_facts(cfg.model).text_length


def tokens(pixels: int, text: int) -> int:
    """Sequence length of a square ``pixels`` image: image tokens plus ``text`` tokens."""
    return (pixels // PIXELS_PER_TOKEN) ** 2 + text


def transformer_class(tc: dict) -> str:
    """The diffusers class of a transformer config (its ``_class_name``; FLUX.1's when it names none), checked
    against the model families' transformers."""
    from rayflux import families

    name = tc.get("_class_name", "FluxTransformer2DModel")
    known = {f.transformer_class for f in families.FAMILIES.values()}
    if name not in known:
        raise ValueError(f"{name} is not the transformer of a supported family: {families.supported()}")
    return name


def is_flux2(tc: dict) -> bool:
    return transformer_class(tc) == "Flux2Transformer2DModel"


def default_text_tokens(tc: dict) -> int:
    """The text length the family's pipeline pads to, from the transformer config alone (no ``model.path``)."""
    from rayflux.families.flux2 import TEXT_LENGTH

    return TEXT_LENGTH if is_flux2(tc) else t5_length(bool(tc.get("guidance_embeds")))


def _widths(tc: dict) -> tuple[int, int]:
    h = tc["num_attention_heads"] * tc["attention_head_dim"]
    return h, int(tc.get("mlp_ratio", MLP_RATIO) * h)


def per_token_elements(tc: dict, checkpointing: bool) -> int:
    """Activation elements kept per token for one sample, summed over all blocks (see the module docstring)."""
    h, m = _widths(tc)
    double, single = (11 * h + 3 * m, 9 * h + 4 * m) if is_flux2(tc) else (11 * h + 2 * m, 9 * h + 3 * m)
    if checkpointing:
        return (tc["num_layers"] + tc["num_single_layers"]) * h + max(double, single)
    return tc["num_layers"] * double + tc["num_single_layers"] * single


@dataclass(frozen=True)
class Estimate:
    """Bytes of one training process's GPU memory."""

    weights: int
    lora_optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.lora_optimizer + self.activations


def estimate(tc: dict, weight_bytes: int, trainable: int, pixels: int, batch: int, checkpointing: bool,
             activation_bytes: int = 2, text: int = FLUX1_DEV_TEXT_TOKENS) -> Estimate:  # fmt: skip
    """Memory of one process: ``weight_bytes`` of frozen base on its GPU
    (:func:`rayflux.plan_base.per_gpu_weight_bytes`), ``trainable`` LoRA parameters, and ``text`` text tokens per
    sample (:func:`text_tokens`)."""
    acts = batch * tokens(pixels, text) * per_token_elements(tc, checkpointing) * activation_bytes
    return Estimate(int(weight_bytes), trainable * LORA_BYTES_PER_PARAM, acts)


def meta_transformer(tc: dict, dtype=None):
    """The family's own transformer for config ``tc`` on the meta device: shapes, no memory, no weights. With
    ``dtype``, held as ``from_pretrained(torch_dtype=dtype)`` holds it: the modules the class keeps in float32
    (``_keep_in_fp32_modules``) stay float32."""
    import diffusers
    import torch

    with torch.device("meta"):
        model = getattr(diffusers, transformer_class(tc)).from_config(dict(tc))
    if dtype is not None:
        torch.nn.Module.to(model, dtype)
        keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
        for name, module in model.named_modules():
            if keep & set(name.split(".")):
                module.float()
    return model


def count_parameters(tc: dict, targets: str, rank: int) -> tuple[int, int]:
    """(all transformer parameters, trainable LoRA parameters) of ``targets`` at ``rank``, on the meta device."""
    import torch

    model = meta_transformer(tc)
    base = sum(p.numel() for p in model.parameters())
    with torch.device("meta"):
        lora.add_lora(model, rank, rank, targets)
    return base, sum(p.numel() for p in model.parameters() if p.requires_grad)


def base_counts(tc: dict) -> plan_base.BaseCounts:
    """What the base_dtype and base_sharding options need to know of the frozen transformer (meta device)."""
    from rayflux.train import base_weights

    return base_weights.counts(meta_transformer(tc))


def transformer_config(cfg: config.JobConfig, model: str = "") -> tuple[dict, str]:
    """The transformer's config (from ``model.path``'s config.json alone, or the built-in ``model``) and a name."""
    if model:
        tc, name = BUILT_IN[model]
        return dict(tc), f"{name} (built-in config)"
    if not cfg.model.path:
        return dict(FLUX1_DEV), "FLUX.1-dev (built-in config)"
    from rayflux.models import read_config

    return read_config(cfg.model, "transformer"), cfg.model.path


def gradient_checkpointing(setting, on_gpu: bool, pixels: int, need_without: int, device_bytes: int) -> bool:
    """``train.gradient_checkpointing``: True/False as set; ``auto`` turns it on for GPU runs at 768 px or more, or
    when the estimate without it exceeds 90% of the device's memory."""
    if setting != "auto":
        return bool(setting)
    return on_gpu and (pixels >= 768 or (device_bytes > 0 and need_without > 0.9 * device_bytes))


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def report(cfg: config.JobConfig, model: str = "", workers_per_node: int = 8) -> list[str]:
    """The plan's lines: parameters per preset, memory at 512 and 1024 px, batch 1-4, then per GPU for each
    base_sharding x base_dtype option. ``model``: a :data:`BUILT_IN` config instead of the job's model."""

    tc, name = transformer_config(cfg, model)
    t = cfg.train
    text = default_text_tokens(tc) if model else text_tokens(cfg)
    float_bytes = 4 if cfg.model.dtype == "float32" else 2
    lines = [f"model: {name}; {tc['num_layers']} double + {tc['num_single_layers']} single blocks, "
             f"width {_widths(tc)[0]}, {text} text tokens; LoRA rank {t.rank}"]  # fmt: skip
    counts = {}
    for preset in lora.PRESETS:
        counts[preset] = count_parameters(tc, preset, t.rank)
        total, trainable = counts[preset]
        lines.append(f"  targets={preset}: {trainable:,} trainable of {total:,} ({100 * trainable / total:.3f}%)")
    job_targets = t.targets if t.targets in counts else None
    trainable = (counts[job_targets] if job_targets else count_parameters(tc, t.targets, t.rank))[1]
    base = base_counts(tc)
    weights = int(plan_base.per_gpu_weight_bytes(base, t.base_dtype, "none", 1, float_bytes))  # the whole base
    lines.append(f"memory per GPU process (GiB) for targets={t.targets}, base_dtype={t.base_dtype}: weights "
                 f"{_gib(weights)}, LoRA + AdamW {_gib(trainable * LORA_BYTES_PER_PARAM)}")  # fmt: skip
    lines.append("  px    batch  activations (no ckpt / ckpt)  total (no ckpt / ckpt)")
    for px in (512, 1024):
        for batch in (1, 2, 3, 4):
            off, on = (estimate(tc, weights, trainable, px, batch, c, text=text) for c in (False, True))
            lines.append(f"  {px:<5} {batch:<6} {_gib(off.activations):>8} / {_gib(on.activations):<8}"
                         f"             {_gib(off.total):>8} / {_gib(on.total)}")  # fmt: skip
    job = estimate(tc, weights, trainable, cfg.data.resolution, t.batch_size, False, text=text)
    ckpt = gradient_checkpointing(checkpointing_setting(t.gradient_checkpointing), True, cfg.data.resolution,
                                  job.total, 80 * 10**9)  # fmt: skip

    def activations(px: int, batch: int, checkpointing: bool) -> int:
        return estimate(tc, 0, 0, px, batch, checkpointing, text=text).activations

    lines += plan_base.option_lines(base, trainable * LORA_BYTES_PER_PARAM, activations, workers_per_node,
                                    float_bytes)  # fmt: skip
    lines.append(f"this job on an 80 GB GPU: {cfg.data.resolution} px, batch {t.batch_size}, gradient checkpointing "
                 f"{'on' if ckpt else 'off'} ({t.gradient_checkpointing}), base_dtype {t.base_dtype}, "
                 f"base_sharding {t.base_sharding}")  # fmt: skip
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m rayflux plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--config", metavar="FILE", help="the job's YAML file")
    cli.add_set_arg(p)
    p.add_argument("--model", choices=sorted(BUILT_IN), default="",
                   help="plan a built-in transformer config instead of the job's model.path")  # fmt: skip
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                   help="workers a node shards the base over with base_sharding=node (default 8)")  # fmt: skip
    args = p.parse_args(argv)
    cfg = cli.load_config(args.config, args.set)
    if cfg is None:
        return 2
    print("\n".join(report(cfg, args.model, args.gpus_per_node)))
    return 0
