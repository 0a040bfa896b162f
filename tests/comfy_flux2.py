"""ComfyUI's view of a FLUX.2 ([klein], [dev]) kohya/LyCORIS file: BFL's FLUX.2 block weights and the diffusers
module names ComfyUI maps onto them (``tests/test_train_adapters.py`` holds FLUX.1's and the rules they share).

BFL's FLUX.2 blocks (``flux2``'s model code): a double block's ``img_attn.qkv`` (3h x h), ``img_attn.proj``,
``img_mlp.0`` (a SwiGLU's fused gate and value, 2m x h) and ``img_mlp.2`` (h x m), the same for ``txt_``; no
per-block modulation (FLUX.2 shares it across blocks); a single block's ``linear1`` (q, k, v and the MLP's 2m in one,
3h + 2m rows) and ``linear2`` (the attention and MLP outputs' projection, h x (h + m)). ComfyUI's
``comfy.utils.flux_to_diffusers`` maps, for FLUX.2's diffusers names (its entries marked "Flux 2" and
"LyCoris LoKr"): ``attn.to_q/k/v`` and ``add_q/k/v_proj`` to their rows of the qkv weights (as for FLUX.1),
``to_out.0``/``to_add_out`` to the projections, ``ff.linear_in``/``linear_out`` (and ``ff_context``'s) to the MLPs,
and a single block's ``attn.to_qkv_mlp_proj`` and ``attn.to_out`` to ``linear1`` and ``linear2`` whole.
``comfy/lora.py`` prefixes each with ``lycoris_`` (``.`` as ``_``), besides ``lora_unet_`` + every BFL weight.
"""

from __future__ import annotations

QKV = {"attn.to_q": ("img", 0), "attn.to_k": ("img", 1), "attn.to_v": ("img", 2)}
QKV.update({"attn.add_q_proj": ("txt", 0), "attn.add_k_proj": ("txt", 1), "attn.add_v_proj": ("txt", 2)})
DOUBLE_WHOLE = {
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.linear_in": "img_mlp.0",
    "ff.linear_out": "img_mlp.2",
    "ff_context.linear_in": "txt_mlp.0",
    "ff_context.linear_out": "txt_mlp.2",
}
SINGLE_WHOLE = {"attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2"}


def widths(tc: dict) -> tuple[int, int]:
    h = tc["num_attention_heads"] * tc["attention_head_dim"]
    return h, int(tc.get("mlp_ratio", 3.0) * h)


def bfl_weights(tc: dict) -> dict[str, tuple[int, int]]:
    """BFL's FLUX.2 Linear weights in the blocks and their (out, in) shapes, from the config alone."""
    h, m = widths(tc)
    shapes = {}
    for i in range(tc["num_layers"]):
        for s in ("img", "txt"):
            shapes[f"double_blocks.{i}.{s}_attn.qkv"] = (3 * h, h)
            shapes[f"double_blocks.{i}.{s}_attn.proj"] = (h, h)
            shapes[f"double_blocks.{i}.{s}_mlp.0"] = (2 * m, h)
            shapes[f"double_blocks.{i}.{s}_mlp.2"] = (h, m)
    for i in range(tc["num_single_layers"]):
        shapes[f"single_blocks.{i}.linear1"] = (3 * h + 2 * m, h)
        shapes[f"single_blocks.{i}.linear2"] = (h, h + m)
    return shapes


def comfy_targets(tc: dict) -> dict[str, tuple[str, int, int]]:
    """ComfyUI's module key -> (BFL weight, first row, rows) for a FLUX.2 model."""
    bfl = bfl_weights(tc)
    h, _ = widths(tc)
    out = {f"lora_unet_{k.replace('.', '_')}": (k, 0, o) for k, (o, _) in bfl.items()}
    for i in range(tc["num_layers"]):
        for inner, (stream, part) in QKV.items():
            out[f"lycoris_transformer_blocks_{i}_{inner.replace('.', '_')}"] = (
                f"double_blocks.{i}.{stream}_attn.qkv",
                part * h,
                h,
            )
        for inner, name in DOUBLE_WHOLE.items():
            weight = f"double_blocks.{i}.{name}"
            out[f"lycoris_transformer_blocks_{i}_{inner.replace('.', '_')}"] = (weight, 0, bfl[weight][0])
    for i in range(tc["num_single_layers"]):
        for inner, name in SINGLE_WHOLE.items():
            weight = f"single_blocks.{i}.{name}"
            out[f"lycoris_single_transformer_blocks_{i}_{inner.replace('.', '_')}"] = (weight, 0, bfl[weight][0])
    return out
