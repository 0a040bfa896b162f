"""LoRA adapters through peft (``add_adapter``): target presets, saving and loading in diffusers' format, through
the model family's pipeline (the family is the transformer's, see :func:`rayflux.families.of_transformer`).

``train.adapter.kind`` picks the kind: ``lora``, ``dora`` (peft's ``use_dora``: a LoRA plus one magnitude per output row
of each target) or ``lokr`` (peft's ``LoKrConfig``: ``alpha / rank * kron(w1, w2)`` per target). All three are
attached, saved and restored here; LoKr has no diffusers format for users (:mod:`rayflux.config.checks` refuses it),
so its ``pytorch_lora_weights.safetensors`` is the checkpoint's own copy, written and read without diffusers.

Targets resolve to full module names before peft sees them (:mod:`rayflux.train.adapter.targets`). Presets only reach into
the transformer blocks: a bare suffix such as ``proj_out`` would otherwise also catch the model's final projection,
which no FLUX recipe trains. An explicit name keeps peft's rule (a name matches itself or any module ending in
``.name``) over the whole model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rayflux.train.adapter import targets as selection

log = logging.getLogger(__name__)

PRESETS = selection.PRESETS
"""``train.adapter.targets`` presets; each model family says which modules of its blocks they hold
(:attr:`rayflux.families.base.Family.lora_presets`)."""
WEIGHT_NAME = "pytorch_lora_weights.safetensors"
ADAPTER = "default"
METADATA_KEY = "lora_adapter_metadata"
"""Where diffusers keeps the peft config in a LoRA file's safetensors metadata."""


def resolve_targets(transformer, spec: str) -> list[str]:
    """Full names of the Linear modules a ``train.adapter.targets`` spec selects (:mod:`rayflux.train.adapter.targets`: presets,
    names, globs, excludes and block ranges); a spec that selects nothing, or names what does not exist, is an
    error."""
    import torch

    from rayflux import families

    family = families.of_transformer(transformer)
    linear = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
    chosen = selection.select(selection.parse(spec), linear, family.lora_presets, family.lora_blocks)
    if not chosen:
        raise ValueError(f"train.adapter.targets {spec!r} matched no module of the transformer")
    return chosen


def peft_patterns(transformer, chosen: list[str], rank_pattern: dict, alpha_pattern: dict) -> dict:
    """peft's ``rank_pattern`` and ``alpha_pattern`` for ``train.adapter.rank_pattern``/``alpha_pattern`` (target spec ->
    value) over the trained modules ``chosen``: one entry per module, its full name escaped (peft reads keys as
    regular expressions matched at a ``.`` boundary, so a full name selects exactly that module)."""
    import re

    from rayflux import families

    family = families.of_transformer(transformer)
    out = {}
    for what, pattern, kind_of in (("rank_pattern", rank_pattern, int), ("alpha_pattern", alpha_pattern, float)):
        if pattern:
            values = selection.pattern_values(pattern, chosen, family.lora_presets, family.lora_blocks, what)
            out[what] = {re.escape(n): kind_of(v) for n, v in values.items()}
    return out


def patterns_of(t) -> dict:
    """:func:`add_lora`'s ``rank_pattern``/``alpha_pattern`` from the job's ``train`` section."""
    return {"rank_pattern": t.adapter.rank_pattern, "alpha_pattern": t.adapter.alpha_pattern}


def adapter_config(
    adapter: str, rank: int, alpha: float, targets: list[str], dropout: float = 0.0, patterns: dict | None = None
):
    """peft's config for ``train.adapter`` over the full module names ``targets`` (``patterns``: peft's
    ``rank_pattern``/``alpha_pattern``, :func:`peft_patterns`)."""
    if adapter == "lokr":
        from peft import LoKrConfig

        # peft's defaults are LyCORIS's: w1 whole and zero at init (no change at step 0), w2 a rank-r product when
        # rank < half its larger side, else whole. No input dropout exists for LoKr (checks refuse lora_dropout).
        return LoKrConfig(r=rank, alpha=alpha, target_modules=targets)
    from peft import LoraConfig

    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        init_lora_weights="gaussian",
        use_dora=adapter == "dora",
        target_modules=targets,
        **(patterns or {}),
    )


def kind(transformer) -> str:
    """``lora``, ``dora`` or ``lokr``: the adapter attached to ``transformer``."""
    config = transformer.peft_config[ADAPTER]
    if not hasattr(config, "lora_alpha"):
        return "lokr"
    return "dora" if config.use_dora else "lora"


def add_lora(
    transformer,
    rank: int,
    alpha: float,
    targets: str,
    dropout: float = 0.0,
    adapter: str = "lora",
    *,
    rank_pattern: dict | None = None,
    alpha_pattern: dict | None = None,
) -> list:
    """Freeze the transformer, attach the adapter (``train.adapter``; ``train.adapter.rank_pattern``/``alpha_pattern``: other
    ranks and alphas for some of the targets), and return its trainable parameters (kept in fp32)."""
    import torch

    chosen = resolve_targets(transformer, targets)
    patterns = peft_patterns(transformer, chosen, rank_pattern or {}, alpha_pattern or {})
    transformer.requires_grad_(False)
    transformer.add_adapter(adapter_config(adapter, rank, alpha, chosen, dropout, patterns))
    params = [p for p in transformer.parameters() if p.requires_grad]
    for p in params:
        # Adapter weights train in fp32 even when the frozen base is bf16: tiny updates survive rounding.
        p.data = p.data.to(torch.float32)
    return params


def adapted_modules(transformer) -> list[str]:
    """Full names of the modules the adapter is attached to, sorted.

    Not ``peft_config[ADAPTER].target_modules``: from 20 targets on, peft replaces that list with the shortest
    suffixes that still select the same modules (``to_q``, ``10.attn.to_out``), which name no module on their own.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    return sorted(
        n
        for n, m in transformer.named_modules()
        if isinstance(m, BaseTunerLayer) and any(ADAPTER in getattr(m, a) for a in m.adapter_layer_names)
    )


def trainable_count(
    transformer, rank: int, targets: str, adapter: str = "lora", rank_pattern: dict | None = None
) -> int:
    """The parameters :func:`add_lora` would attach at ``rank``, without attaching them: the memory plan of a model
    that must stay bare (e.g. before it is sharded). Per targeted Linear: ``rank x (in + out)`` for LoRA, plus
    ``out`` magnitudes for DoRA; for LoKr, peft's own factorisation (:func:`lokr_count`). ``rank_pattern``:
    ``train.adapter.rank_pattern``, other ranks for some targets."""
    from rayflux import families

    modules = dict(transformer.named_modules())
    chosen = resolve_targets(transformer, targets)
    family = families.of_transformer(transformer)
    ranks = selection.pattern_values(
        rank_pattern or {}, chosen, family.lora_presets, family.lora_blocks, "rank_pattern"
    )
    total = 0
    for name in chosen:
        rank = int(ranks.get(name, rank))
        n_in, n_out = modules[name].in_features, modules[name].out_features
        if adapter == "lokr":
            total += lokr_count(n_in, n_out, rank)
        else:
            total += rank * (n_in + n_out) + (n_out if adapter == "dora" else 0)
    return total


def lokr_count(n_in: int, n_out: int, rank: int) -> int:
    """LoKr parameters peft attaches to an ``n_in -> n_out`` Linear by default: a whole ``w1`` of the small factors
    and ``w2`` of the large ones, whole or as a rank-``rank`` product (peft's ``LoKrLayer.update_layer``)."""
    from peft.tuners.lokr.layer import factorization

    (out_l, out_k), (in_m, in_n) = factorization(n_out), factorization(n_in)
    w2 = out_k * in_n if rank >= max(out_k, in_n) / 2 else rank * (out_k + in_n)
    return out_l * in_m + w2


def lora_state_dict(transformer) -> dict:
    """The adapter's weights with peft's names (``<module>.lora_A.weight`` / ``lora_B``), no ``transformer.``."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(transformer)


def scale(transformer) -> float:
    """The adapter's ``alpha / rank``: how much of ``B @ A`` (LoKr: of ``kron(w1, w2)``) is added to each targeted
    weight."""
    config = transformer.peft_config[ADAPTER]
    return getattr(config, "lora_alpha", getattr(config, "alpha", None)) / config.r


def module_scales(transformer) -> dict[str, float]:
    """``{module name: alpha / rank}`` of each adapted LoRA/DoRA module (peft's ``scaling``): one value for all unless
    ``train.adapter.rank_pattern``/``alpha_pattern`` set some."""
    from peft.tuners.lora import LoraLayer

    return {
        name: float(module.scaling[ADAPTER])
        for name, module in transformer.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A
    }


def _baked(state: dict, scales: dict[str, float], factor: float = 1.0, invert: bool = False) -> dict:
    """``state`` with each ``lora_B`` times its module's scale (``invert``: divided by it), times ``factor``."""
    out = {}
    for k, v in state.items():
        if ".lora_B." in k:
            s = scales[k.removeprefix("transformer.").rsplit(".lora_B.", 1)[0]]
            v = v * (factor / s if invert else factor * s)
        out[k] = v
    return out


def save_diffusers(transformer, directory: str | Path) -> Path:
    """Write ``pytorch_lora_weights.safetensors`` with ``transformer.*`` keys via the family pipeline's
    ``save_lora_weights``.

    ``alpha / rank`` is baked into every ``lora_B`` and the metadata says ``lora_alpha == r``: a loader that reads the
    peft metadata, one that finds none (stripped, or a ComfyUI-style loader that defaults to strength 1) and one
    that assumes ``alpha == rank`` all load the trained strength. (diffusers refuses a file with both ``.alpha``
    tensors and adapter metadata, so per-module alpha tensors are no option.) :func:`load_into` undoes the baking.
    """
    from rayflux import families

    config = transformer.peft_config[ADAPTER].to_dict()
    config["target_modules"] = sorted(config["target_modules"])  # a set in peft; metadata must be JSON
    if kind(transformer) == "lokr":
        return _save_lokr(transformer, config, Path(directory))
    config["lora_alpha"] = config["r"]
    # Per-module ranks keep their rank as alpha too: every module's baked strength is 1.
    keys = {**config.get("alpha_pattern", {}), **config.get("rank_pattern", {})}
    config["alpha_pattern"] = {k: config.get("rank_pattern", {}).get(k, config["r"]) for k in keys}
    state = _baked(lora_state_dict(transformer), module_scales(transformer))
    pipeline = families.of_transformer(transformer).pipeline_class()
    pipeline.save_lora_weights(str(directory), transformer_lora_layers=state, transformer_lora_adapter_metadata=config)
    return Path(directory) / WEIGHT_NAME


def _save_lokr(transformer, config: dict, directory: Path) -> Path:
    """LoKr's checkpoint copy: peft's tensors under ``transformer.*`` and its config, unbaked (diffusers loads no
    LoKr, and :func:`load_into` copies them back as they are)."""
    from safetensors.torch import save_file

    config = {k: (v if not isinstance(v, set) else sorted(v)) for k, v in config.items()}
    state = {f"transformer.{k}": v.detach().contiguous() for k, v in lora_state_dict(transformer).items()}
    path = directory / WEIGHT_NAME
    save_file(state, str(path), metadata={"format": "pt", METADATA_KEY: json.dumps(config, default=str)})
    return path


def file_scale(path: str | Path) -> float:
    """The strength a diffusers-format file's tensors are meant at: metadata ``lora_alpha / r``, else 1."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    adapter = json.loads(meta.get(METADATA_KEY, "{}"))  # diffusers prefixes every field with "transformer."
    alpha, r = adapter.get("transformer.lora_alpha"), adapter.get("transformer.r")
    return alpha / r if alpha and r else 1.0


def set_state(transformer, state: dict, source: str) -> None:
    """Copy ``state`` (peft names, no ``transformer.``) into the adapter; a shape or key that does not fit it is a
    one-line error naming ``source``."""
    from peft.utils import set_peft_model_state_dict

    try:
        result = set_peft_model_state_dict(transformer, state, adapter_name=ADAPTER)
    except RuntimeError as exc:  # size mismatch: another rank, or a fused layout this adapter cannot hold
        raise ValueError(
            f"{source}: LoRA shapes do not fit the adapter (train.adapter.rank, train.adapter.targets): {exc}"
        ) from None
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"{source}: LoRA keys do not match the adapter, e.g. {unexpected[:3]}")


def load_into(transformer, path: str | Path) -> None:
    """Restore a file written by :func:`save_diffusers` into the same adapter (checkpoint resume).

    The file's strength (baked, or a pre-baking file's own alpha/rank) is rescaled to this adapter's ``alpha / rank``.
    """
    from safetensors.torch import load_file

    loaded = {k.removeprefix("transformer."): v for k, v in load_file(str(path)).items()}
    set_state(transformer, _baked(loaded, module_scales(transformer), file_scale(path), invert=True), str(path))


def init_from_file(transformer, path: str) -> int:
    """Start the adapter from an existing LoRA file (diffusers or kohya keys; local path or URI). A DoRA adapter needs
    a DoRA file in diffusers' format (diffusers drops a kohya file's ``dora_scale``).

    diffusers' own converter reads the file. Its strength (metadata alpha/rank, else 1, which is also what the
    kohya converter bakes in) is rescaled to this adapter's ``alpha / rank``, so the starting model is exactly the
    file's. Modules the file lacks keep their fresh init. Returns how many modules were loaded.
    """
    import tempfile

    from rayflux import families, storage

    family = families.of_transformer(transformer)

    with tempfile.TemporaryDirectory(prefix="rayflux-init-lora-") as tmp:
        local = path
        if storage.is_uri(path):
            local = str(Path(tmp) / Path(path).name)
            Path(local).write_bytes(storage.read_bytes(path))
        # Folder and file name apart: older diffusers insist on a weight_name for a local file when offline.
        out = family.pipeline_class().lora_state_dict(
            str(Path(local).parent), weight_name=Path(local).name, return_lora_metadata=True, **family.lora_read_kwargs
        )
        state, metadata = out[0], out[-1]
    meta = metadata or {}  # diffusers flattens it to "transformer.<LoraConfig field>"
    alpha, r = meta.get("transformer.lora_alpha"), meta.get("transformer.r")
    if meta.get("transformer.alpha_pattern") or meta.get("transformer.rank_pattern"):
        raise ValueError(f"{path}: per-module alpha or rank patterns are not supported for train.adapter.init_lora")
    file_scale = alpha / r if alpha and r else 1.0
    factor = file_scale / scale(transformer)
    ours = {
        k.removeprefix("transformer."): (v * factor if ".lora_B." in k else v)
        for k, v in state.items()
        if k.startswith("transformer.")
    }
    if kind(transformer) == "dora" and not any(k.endswith(".lora_magnitude_vector") for k in ours):
        # Its magnitudes would stay the base's norms: the start would not be the file's model.
        raise ValueError(f"{path}: a DoRA starts only from a DoRA file (diffusers format, with magnitudes)")
    set_state(transformer, ours, path)
    loaded = len({k.split(".lora_")[0] for k in ours})
    log.info("initialised %d LoRA modules from %s", loaded, path)
    return loaded


def delta_weights(transformer) -> dict:
    """``{module name: scale * B @ A}``: what the adapter adds to each targeted weight (for comparisons)."""
    from peft.tuners.lora import LoraLayer

    return {
        name: module.get_delta_weight(ADAPTER).detach()
        for name, module in transformer.named_modules()
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A
    }
