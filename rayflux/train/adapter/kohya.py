"""diffusers/peft LoRA -> kohya (sd-scripts, ComfyUI) ``lora_unet_*`` keys, by the model family's key map (FLUX.1
and FLUX.2 share the scheme; their tables are in :mod:`rayflux.families`).

kohya names modules after Black Forest Labs' original FLUX code, which fuses layers diffusers keeps apart:
``img_attn.qkv`` is ``to_q, to_k, to_v`` stacked along the output, and a single block's ``linear1`` is
``to_q, to_k, to_v, proj_mlp``. A fused LoRA is written the way sd-scripts writes its split-qkv LoRAs: ``lora_down``
stacks every part's ``A`` (a zero block for an untrained part) and ``lora_up`` is block-diagonal in the parts' ``B``.
Then ``up @ down`` is exactly the parts' updates stacked, and diffusers' loader recognises the block-diagonal form
and splits it back into per-part LoRAs of the original rank.

``alpha / rank`` is baked into ``lora_up`` and each ``alpha`` is written equal to its rank (strength 1), so a
loader that ignores ``alpha`` still gets the right strength.

DoRA (``train.adapter.kind=dora``) adds LyCORIS's ``dora_scale`` per kohya module: peft's magnitudes, one per output
row, as an ``(out, 1)`` column (the output-axis form ComfyUI's ``weight_decompose`` tells apart by its first
dimension; a 1-D vector would broadcast wrongly there). A row's magnitude only scales that row, so a fused layer's
is its parts' magnitudes stacked, and an untrained part's rows get their base weight's norms (no change).

LoKr (``train.adapter.kind=lokr``) writes LyCORIS's ``lokr_w1`` and ``lokr_w2`` (or ``lokr_w2_a``/``lokr_w2_b``) with
``alpha / rank`` baked into ``lokr_w1`` and ``alpha`` equal to the rank (ComfyUI and diffusers scale a factored
``w2`` by ``alpha / rank`` and a whole one not at all). A Kronecker product cannot be stacked with another, so no
fused kohya layer can hold a LoKr per part: every module keeps its diffusers name under LyCORIS's prefix
(``lycoris_transformer_blocks_0_attn_to_q``, the form LyCORIS writes for a diffusers model, e.g. SimpleTuner's),
which ComfyUI maps for FLUX onto the module's rows of its fused weight and diffusers' FLUX.2 pipelines load.

Only the blocks' layers have kohya names here. diffusers 0.42 drops a kohya file's ``final_layer`` keys when it
loads one, so a LoRA on the model's outer layers (``proj_out``, ``norm_out.linear``, the embedders) would not survive
the round trip; such targets are refused up front with ``output_format=kohya``.
"""

from __future__ import annotations

import torch

PREFIX = "lora_unet_"
LYCORIS_PREFIX = "lycoris_"
KOHYA_NAME = "pytorch_lora_weights_kohya.safetensors"


def locate(module: str, blocks: dict) -> tuple[str, int | None, int, list[str]]:
    """(kohya name, part, parts, sibling modules in part order) of a diffusers module name, by a family's key map
    (:attr:`rayflux.families.base.Family.kohya_blocks`); KeyError if unmapped."""
    for prefix, (table, kohya_block) in blocks.items():
        if module.startswith(prefix):
            index, inner = module[len(prefix) :].split(".", 1)
            name, part, parts = table[inner]
            siblings = sorted((k for k, v in table.items() if v[0] == name), key=lambda k: table[k][1] or 0)
            return f"{kohya_block}_{index}_{name}", part, parts, [f"{prefix}{index}.{s}" for s in siblings]
    raise KeyError(module)


def check_targets(modules: list[str], blocks: dict) -> None:
    """Fail before training, not at export, when a targeted module has no kohya name in the key map ``blocks``."""
    unmapped = []
    for m in modules:
        try:
            locate(m, blocks)
        except (KeyError, ValueError):
            unmapped.append(m)
    if unmapped:
        raise ValueError(
            f"train.checkpoint.output_format=kohya: no kohya name for {unmapped[:5]}; use diffusers or other targets"
        )


def check_adapter(transformer) -> None:
    """:func:`check_targets` on the modules the adapter of ``transformer`` is attached to, by its family's key map,
    and one rank per fused layer."""
    from rayflux.families import of_transformer
    from rayflux.train.adapter.lora import adapted_modules, lora_state_dict

    modules, blocks = adapted_modules(transformer), of_transformer(transformer).kohya_blocks
    check_targets(modules, blocks)
    downs = {k: v for k, v in lora_state_dict(transformer).items() if k.endswith(".lora_A.weight")}
    for m in modules:
        name, _, _, siblings = locate(m, blocks)
        _check_fused_ranks(downs, name, siblings)


def _scale_of(scale: float | dict[str, float], module: str) -> float:
    return scale[module] if isinstance(scale, dict) else scale


def _check_fused_ranks(state: dict, name: str, siblings: list[str]) -> None:
    """The parts of one fused kohya layer are one LoRA there, of one rank: per-module ranks must agree on them."""
    ranks = {s: state[f"{s}.lora_A.weight"].shape[0] for s in siblings if f"{s}.lora_A.weight" in state}
    if len(set(ranks.values())) > 1:
        raise ValueError(
            f"train.checkpoint.output_format=kohya: {name} fuses {', '.join(ranks)} into one layer, but train.adapter.rank_pattern gives "
            f"them ranks {sorted(set(ranks.values()))}: give the parts of a fused layer one rank"
        )


def from_peft(
    state: dict,
    scale: float | dict[str, float],
    out_features: dict[str, int],
    blocks: dict,
    row_norms: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Convert peft's tensors (strength ``scale``, or one per module name) to kohya keys by the family key map ``blocks``: LoRA's
    ``<module>.lora_A.weight``/``lora_B`` (DoRA's also ``lora_magnitude_vector``), or LoKr's ``lokr_*``.

    ``out_features`` gives every sibling's output size, so an untrained part of a fused layer gets zero rows of the
    right height; for DoRA, ``row_norms`` gives such a part's base row norms (its magnitudes).
    """
    if any(".lokr_" in k for k in state):
        return _lokr(state, scale, blocks)
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    groups: dict[str, list] = {}
    for m in modules:
        name, part, parts, siblings = locate(m, blocks)
        groups.setdefault(name, [parts, siblings])
    out: dict[str, torch.Tensor] = {}
    for name, (parts, siblings) in groups.items():
        _check_fused_ranks(state, name, siblings)
        present = [s for s in siblings if f"{s}.lora_A.weight" in state]
        a0 = state[f"{present[0]}.lora_A.weight"]
        rank, in_features = a0.shape
        downs, ups = [], []
        for i, s in enumerate(siblings):
            a = state.get(f"{s}.lora_A.weight", torch.zeros_like(a0))
            b = state.get(f"{s}.lora_B.weight")
            b = torch.zeros(out_features[s], rank, dtype=a0.dtype) if b is None else b * _scale_of(scale, s)
            up = torch.zeros(b.shape[0], rank * parts, dtype=b.dtype)
            up[:, i * rank : (i + 1) * rank] = b
            downs.append(a)
            ups.append(up)
        key = PREFIX + name
        out[f"{key}.lora_down.weight"] = torch.cat(downs, dim=0).contiguous()
        out[f"{key}.lora_up.weight"] = torch.cat(ups, dim=0).contiguous()
        out[f"{key}.alpha"] = torch.tensor(float(rank * parts))
        if f"{present[0]}.lora_magnitude_vector" in state:
            mags = [state.get(f"{s}.lora_magnitude_vector", None) for s in siblings]
            mags = [(row_norms or {})[s] if m is None else m for s, m in zip(siblings, mags)]
            out[f"{key}.dora_scale"] = torch.cat(mags).to(a0.dtype).reshape(-1, 1).contiguous()
    return out


def _lokr(state: dict, scale: float, blocks: dict) -> dict[str, torch.Tensor]:
    """LoKr tensors under LyCORIS's key names (see the module docstring): scale baked into ``lokr_w1``."""
    out: dict[str, torch.Tensor] = {}
    for m in sorted({k.rsplit(".lokr_", 1)[0] for k in state}):
        locate(m, blocks)  # only the blocks' layers, as for LoRA (check_targets refused the rest before training)
        key = LYCORIS_PREFIX + m.replace(".", "_")
        rank = None
        for k, v in state.items():
            if k.rsplit(".lokr_", 1)[0] != m:
                continue
            suffix = "lokr_" + k.rsplit(".lokr_", 1)[1]
            if suffix == "lokr_w1_a":  # never with peft's default decompose_both=False; w1 is the baked factor
                raise ValueError(f"{m}: a factored lokr_w1 is not supported for the kohya export")
            out[f"{key}.{suffix}"] = (v * scale if suffix == "lokr_w1" else v).contiguous()
            if suffix == "lokr_w2_b":
                rank = v.shape[0]
        if rank is not None:  # ComfyUI scales a factored w2 by alpha / rank: 1 here, as the scale is in w1
            out[f"{key}.alpha"] = torch.tensor(float(rank))
    return out


def save(transformer, directory, scale: float) -> str:
    """Write the adapter of ``transformer`` as kohya keys into ``directory/KOHYA_NAME``. Returns the path."""
    import os

    from safetensors.torch import save_file

    from rayflux.families import of_transformer
    from rayflux.train.adapter.lora import ADAPTER, adapted_modules, lora_state_dict, module_scales

    blocks = of_transformer(transformer).kohya_blocks
    state = {k: v.detach().float().cpu() for k, v in lora_state_dict(transformer).items()}
    modules = set(adapted_modules(transformer))
    siblings = {s for m in modules for s in locate(m, blocks)[3]}
    out_features = {s: _base(transformer.get_submodule(s)).out_features for s in siblings}
    norms = {}
    if any(k.endswith(".lora_magnitude_vector") for k in state):  # DoRA: untrained parts keep their row norms
        norms = {
            s: _base(transformer.get_submodule(s)).weight.detach().float().norm(dim=1).cpu() for s in siblings - modules
        }
    config = transformer.peft_config[ADAPTER]
    if getattr(config, "rank_pattern", None) or getattr(config, "alpha_pattern", None):
        scale = module_scales(transformer)  # train.adapter.rank_pattern/alpha_pattern: each module its own alpha / rank
    path = os.path.join(str(directory), KOHYA_NAME)
    save_file(from_peft(state, scale, out_features, blocks, norms), path, metadata={"format": "pt"})
    return path


def _base(module):
    return getattr(module, "base_layer", module)
