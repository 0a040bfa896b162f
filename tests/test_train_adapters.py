"""DoRA and LoKr (``train.adapter.kind``): the diffusers DoRA file in the FLUX.1 pipeline, the kohya/LyCORIS files
checked against ComfyUI's loading rules, what is refused before training, the plan's counts and exact resume.

ComfyUI's rules, as its ``comfy/lora.py`` and ``comfy/weight_adapter/`` read them: a key's module is
``lora_unet_`` + a module of BFL's FLUX with ``.`` as ``_`` (``double_blocks_0_img_attn_qkv``), or, through
``comfy.utils.flux_to_diffusers``, ``lycoris_`` + a diffusers module (its rows of the fused BFL weight). A LoRA
module has ``lora_up.weight``, ``lora_down.weight`` and ``alpha`` (strength ``alpha / down.shape[0]``), a DoRA one
also ``dora_scale``, whose first dimension equal to the weight's selects the output-axis decomposition (a 1-D one
would broadcast wrongly: ComfyUI issue 12938). A LoKr module has ``lokr_w1`` or ``lokr_w1_a``/``_b`` and ``lokr_w2``
or ``lokr_w2_a``/``_b``; ``alpha / rank`` applies only to a factored one, and ``kron(w1, w2)`` must reshape to the
weight.
"""

from __future__ import annotations

import adapter_values
import comfy_flux2
import numpy as np
import pytest
import torch
import train_data
from pipeline_support import render

from rayflux import config, families, plan
from rayflux.families.flux1 import FLUX1_DEV
from rayflux.train.adapter import kohya, lora, lora_files
from rayflux.train.resume import checkpoint
from rayflux.train.trainer import LoraTrainer

# Everything FLUX.1's diffusers kohya reader splits at the tiny widths (see tests/test_train_lora.py's LOADABLE).
LOADABLE = (
    "transformer_blocks.0.attn.to_q,transformer_blocks.0.attn.to_k,transformer_blocks.0.attn.to_v,to_out.0,"
    "add_q_proj,add_k_proj,add_v_proj,to_add_out,ff.net.0.proj,ff.net.2,norm1.linear,"
    "single_transformer_blocks.0.proj_out"
)
LORA_SUFFIXES = {"lora_up.weight", "lora_down.weight", "alpha", "dora_scale"}
LOKR_SUFFIXES = {"lokr_w1", "lokr_w2", "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "alpha"}


def _flux2(tc: dict) -> bool:
    return families.of_transformer_config(tc).name == "flux2"


def bfl_weights(tc: dict) -> dict[str, tuple[int, int]]:
    """BFL's FLUX.1 Linear weights in the blocks and their (out, in) shapes, from the model's config alone (written
    from BFL's ``flux/modules/layers.py``, not from rayflux's key map); FLUX.2's from :mod:`comfy_flux2`."""
    if _flux2(tc):
        return comfy_flux2.bfl_weights(tc)
    h = tc["num_attention_heads"] * tc["attention_head_dim"]
    m = 4 * h
    shapes = {}
    for i in range(tc["num_layers"]):
        for s in ("img", "txt"):
            shapes.update(
                {
                    f"double_blocks.{i}.{s}_attn.qkv": (3 * h, h),
                    f"double_blocks.{i}.{s}_attn.proj": (h, h),
                    f"double_blocks.{i}.{s}_mlp.0": (m, h),
                    f"double_blocks.{i}.{s}_mlp.2": (h, m),
                    f"double_blocks.{i}.{s}_mod.lin": (6 * h, h),
                }
            )
    for i in range(tc["num_single_layers"]):
        shapes.update(
            {
                f"single_blocks.{i}.linear1": (3 * h + m, h),
                f"single_blocks.{i}.linear2": (h, h + m),
                f"single_blocks.{i}.modulation.lin": (3 * h, h),
            }
        )
    return shapes


FUSED = {
    "attn.to_q": 0,
    "attn.to_k": 1,
    "attn.to_v": 2,
    "attn.add_q_proj": 0,
    "attn.add_k_proj": 1,
    "attn.add_v_proj": 2,
    "proj_mlp": 3,
}
"""flux_to_diffusers: a diffusers module that is a part of a fused BFL weight, and its place in q, k, v(, mlp)."""
WHOLE = {
    "attn.to_out.0": "img_attn.proj",
    "attn.to_add_out": "txt_attn.proj",
    "ff.net.0.proj": "img_mlp.0",
    "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0",
    "ff_context.net.2": "txt_mlp.2",
    "norm1.linear": "img_mod.lin",
    "norm1_context.linear": "txt_mod.lin",
    "proj_out": "linear2",
    "norm.linear": "modulation.lin",
}


def comfy_targets(tc: dict) -> dict[str, tuple[str, int, int]]:
    """ComfyUI's module key -> (BFL weight, first row, rows): ``lora_unet_*`` whole weights and ``lycoris_*``
    diffusers modules at their rows of the BFL weight (FLUX.2: :mod:`comfy_flux2`)."""
    if _flux2(tc):
        return comfy_flux2.comfy_targets(tc)
    bfl = bfl_weights(tc)
    h = tc["num_attention_heads"] * tc["attention_head_dim"]
    out = {f"lora_unet_{k.replace('.', '_')}": (k, 0, o) for k, (o, _) in bfl.items()}
    for kind, n in (("transformer_blocks", tc["num_layers"]), ("single_transformer_blocks", tc["num_single_layers"])):
        block = "double_blocks" if kind == "transformer_blocks" else "single_blocks"
        for i in range(n):
            for inner, part in FUSED.items():
                if kind == "transformer_blocks" and inner != "proj_mlp":
                    weight, rows = f"{block}.{i}.{'txt' if 'add_' in inner else 'img'}_attn.qkv", h
                elif kind != "transformer_blocks" and inner in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"):
                    weight, rows = f"{block}.{i}.linear1", 4 * h if inner == "proj_mlp" else h
                else:
                    continue
                out[f"lycoris_{kind}_{i}_{inner.replace('.', '_')}"] = (weight, part * h, rows)
            for inner, name in WHOLE.items():
                if f"{block}.{i}.{name}" in bfl:
                    out[f"lycoris_{kind}_{i}_{inner.replace('.', '_')}"] = (
                        f"{block}.{i}.{name}",
                        0,
                        bfl[f"{block}.{i}.{name}"][0],
                    )
    return out


def check_comfy_keys(state: dict, tc: dict) -> dict[str, tuple[str, int, int]]:
    """Every key of a kohya/LyCORIS file is one ComfyUI loads, with shapes its adapters accept for that weight.
    Returns the modules found, as :func:`comfy_targets` maps them."""
    targets, bfl = comfy_targets(tc), bfl_weights(tc)
    modules: dict[str, set] = {}
    for key in state:
        module, suffix = key.split(".", 1)
        assert module in targets, key
        modules.setdefault(module, set()).add(suffix)
    for module, suffixes in modules.items():
        weight, _, rows = targets[module]
        cols = bfl[weight][1]
        t = {s: state[f"{module}.{s}"] for s in suffixes}
        if "lora_up.weight" in t:
            assert suffixes <= LORA_SUFFIXES and {"lora_up.weight", "lora_down.weight", "alpha"} <= suffixes, module
            up, down = t["lora_up.weight"], t["lora_down.weight"]
            assert (up.shape[0], down.shape[1], up.shape[1]) == (rows, cols, down.shape[0]), module
            if "dora_scale" in t:  # 2-D, on the output axis: ComfyUI compares its first dimension with the weight's
                assert tuple(t["dora_scale"].shape) == (rows, 1), module
        else:
            assert suffixes <= LOKR_SUFFIXES, module
            w1 = t["lokr_w1"] if "lokr_w1" in t else t["lokr_w1_a"] @ t["lokr_w1_b"]
            w2 = t["lokr_w2"] if "lokr_w2" in t else t["lokr_w2_a"] @ t["lokr_w2_b"]
            assert (w1.shape[0] * w2.shape[0], w1.shape[1] * w2.shape[1]) == (rows, cols), module
            assert ("alpha" in t) == ("lokr_w2_b" in t or "lokr_w1_b" in t), module
    return {m: targets[m] for m in modules}


def comfy_apply(state: dict, tc: dict, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The BFL weights after ComfyUI's patches at strength 1 (``comfy/weight_adapter/lora.py`` and ``lokr.py``
    arithmetic; DoRA by its definition, ``m * (W + dW) / ||W + dW||`` per output row: ComfyUI divides by the base
    row norm ``||W||`` instead, ComfyUI pull request 15458)."""
    weights = {k: v.clone() for k, v in base.items()}
    for module, (weight, row, rows) in check_comfy_keys(state, tc).items():
        w = weights[weight][row : row + rows]
        get = lambda s: state.get(f"{module}.{s}")  # noqa: E731
        if get("lora_up.weight") is not None:
            up, down = get("lora_up.weight"), get("lora_down.weight")
            diff = (up @ down) * (get("alpha").item() / down.shape[0])
            if get("dora_scale") is not None:
                calc = w + diff
                w.copy_(calc * (get("dora_scale") / calc.norm(dim=1, keepdim=True)))
            else:
                w += diff
        else:
            w1 = get("lokr_w1") if get("lokr_w1") is not None else get("lokr_w1_a") @ get("lokr_w1_b")
            factored = get("lokr_w2") is None
            w2 = get("lokr_w2_a") @ get("lokr_w2_b") if factored else get("lokr_w2")
            alpha = get("alpha").item() / get("lokr_w2_b").shape[0] if factored and get("alpha") is not None else 1.0
            w += torch.kron(w1, w2) * alpha
    return weights


def _bfl_base(transformer, tc: dict) -> dict[str, torch.Tensor]:
    """BFL's block weights of ``transformer``, assembled by ComfyUI's own row map (each diffusers module's current
    weight: the base, or with :func:`_merge` done, the trained one)."""
    out = {k: torch.zeros(o, i) for k, (o, i) in bfl_weights(tc).items()}
    for key, (weight, row, rows) in comfy_targets(tc).items():
        if key.startswith("lycoris_"):
            module = _module(transformer, key)
            out[weight][row : row + rows] = getattr(module, "base_layer", module).weight.detach()
    return out


def _module(transformer, lycoris_key: str):
    """The diffusers module a ``lycoris_`` key names (``_`` is ambiguous: match against the real names)."""
    return {f"lycoris_{n.replace('.', '_')}": m for n, m in transformer.named_modules()}[lycoris_key]


def _merge(transformer) -> None:
    """peft's own merge of the adapter into every adapted base weight (DoRA's decomposition included)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in transformer.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()


@pytest.mark.parametrize("adapter", ["dora", "lokr"])
def test_kohya_files_carry_comfyui_keys_that_rebuild_the_trained_weights(tiny_model, tmp_path, adapter):
    """Tiny FLUX.1, every preset target of ``all``, alpha != rank: ComfyUI's arithmetic on the file's keys gives
    the weights peft's merge of the trained adapter gives, for every block weight (untouched ones included)."""
    from safetensors.torch import load_file

    t = adapter_values.transformer(tiny_model)
    tc = dict(t.config)
    base = _bfl_base(t, tc)
    lora.add_lora(t, rank=2, alpha=6.0, targets="attention", adapter=adapter)  # single blocks: proj_mlp untrained
    adapter_values.randomise(t, 3)
    path = kohya.save(t, tmp_path, lora.scale(t))
    state = load_file(path)
    if adapter == "lokr":
        assert all(k.startswith("lycoris_") for k in state) and any(k.endswith(".lokr_w2_a") for k in state)
    else:
        assert "lora_unet_single_blocks_0_linear1.dora_scale" in state
    got = comfy_apply(state, tc, base)
    _merge(t)
    want = _bfl_base(t, tc)
    assert any(not torch.allclose(want[k], base[k]) for k in base)  # the adapter changes weights: the check bites
    for k in base:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("adapter", ["dora", "lokr"])
def test_kohya_keys_at_real_widths_on_the_meta_device(adapter):
    """FLUX.1-dev's real transformer on the meta device, every preset: ComfyUI's key names and shapes for every
    adapted module (LoKr's factorisation, DoRA's fused magnitudes depend on the widths)."""
    from rayflux.families.flux1 import Flux1
    from rayflux.models import meta_transformer

    for preset in lora.PRESETS:
        meta = meta_transformer(FLUX1_DEV)
        targets = lora.resolve_targets(meta, preset)
        with torch.device("meta"):
            lora.add_lora(meta, 16, 16, preset, adapter=adapter)
        assert lora.adapted_modules(meta) == sorted(targets)
        kohya.check_adapter(meta)
        state = lora.lora_state_dict(meta)
        modules = set(lora.adapted_modules(meta))
        siblings = {s for m in modules for s in kohya.locate(m, Flux1.kohya_blocks)[3]}
        out_features = {
            s: meta.get_submodule(s).out_features if s not in modules else meta.get_submodule(s).base_layer.out_features
            for s in siblings
        }
        norms = {s: torch.empty(out_features[s], device="meta") for s in siblings - modules}
        with torch.device("meta"):  # the fused layers' zero blocks too
            converted = kohya.from_peft(state, 1.0, out_features, Flux1.kohya_blocks, norms)
        found = check_comfy_keys(converted, FLUX1_DEV)
        assert len(found) == (
            len(targets) if adapter == "lokr" else len({kohya.locate(m, Flux1.kohya_blocks)[0] for m in targets})
        ), preset


def test_dora_diffusers_file_loads_in_the_pipeline_and_renders_the_trained_model(tiny_model, tmp_path):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_model)
    pipe.set_progress_bar_config(disable=True)
    base = render(pipe)
    lora.add_lora(pipe.transformer, rank=4, alpha=8.0, targets=LOADABLE, adapter="dora")
    adapter_values.randomise(pipe.transformer, 5)
    trained = render(pipe)
    assert np.abs(trained - base).max() > 0.01
    lora.save_diffusers(pipe.transformer, tmp_path)
    fresh = FluxPipeline.from_pretrained(tiny_model)
    fresh.set_progress_bar_config(disable=True)
    fresh.load_lora_weights(str(tmp_path))
    np.testing.assert_allclose(render(fresh), trained, atol=1e-5)


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        (["train.adapter.kind=lokr"], "no diffusers format"),
        (
            ["train.adapter.kind=lokr", "train.checkpoint.output_format=kohya", "train.adapter.lora_dropout=0.1"],
            "no input dropout",
        ),
        (
            [
                "train.adapter.kind=lokr",
                "train.checkpoint.output_format=kohya",
                "train.adapter.init_lora=a.safetensors",
            ],
            "cannot hold",
        ),
        (["train.adapter.kind=dora", "train.workers.base_fsdp=node"], "base_fsdp"),
        (["train.adapter.kind=loha"], "train.adapter.kind must be one of lora, dora, lokr"),
        (["train.network_module=lycoris.kohya"], "say which LyCORIS algorithm"),  # dora or lokr: its args say
    ],
)
def test_combinations_that_cannot_be_used_are_refused_before_training(settings, reason):
    with pytest.raises(config.ConfigError, match=reason):
        config.load(None, settings)


def test_kohyas_network_module_names_the_adapter():
    assert config.load(None, ["train.network_module=networks.lora_flux"]).train.adapter.kind == "lora"
    assert config.load(None, ["train.network_module=dora"]).train.adapter.kind == "dora"
    assert "train.network_module -> train.adapter.kind" in config.help_text()


def test_plan_counts_dora_and_lokr_parameters():
    """plan counts peft's modules attached on the meta device; the trainer's bare count agrees."""
    from rayflux.models import meta_transformer

    lora_count = plan.count_parameters(FLUX1_DEV, "attention", 16)[1]
    dora = plan.count_parameters(FLUX1_DEV, "attention", 16, "dora")[1]
    h = 3072
    assert dora - lora_count == 19 * 8 * h + 38 * 3 * h  # one magnitude per output row of every target
    lokr = plan.count_parameters(FLUX1_DEV, "attention", 16, "lokr")[1]
    # 3072 = 48 x 64 each way: w1 48x48 whole, w2 64x64 as 64x16 @ 16x64 (16 < 64 / 2).
    assert lokr == (19 * 8 + 38 * 3) * (48 * 48 + 16 * (64 + 64))
    meta = meta_transformer(FLUX1_DEV)
    for adapter, count in (("dora", dora), ("lokr", lokr)):
        assert lora.trainable_count(meta, 16, "attention", adapter) == count
    for adapter in ("dora", "lokr"):
        counts = {p: plan.count_parameters(FLUX1_DEV, p, 16, adapter)[1] for p in ("attention+ffs", "all")}
        assert counts == {p: lora.trainable_count(meta, 16, p, adapter) for p in counts}


@pytest.mark.parametrize("adapter", ["dora", "lokr"])
def test_the_kept_kohya_file_names_lycoris_and_keeps_the_tensors(tiny_model, tmp_path, adapter):
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file

    t = adapter_values.transformer(tiny_model)
    lora.add_lora(t, rank=2, alpha=4.0, targets="attention", adapter=adapter)
    adapter_values.randomise(t, 4)
    written = load_file(kohya.save(t, tmp_path, lora.scale(t)))
    cfg = config.load(
        None,
        [
            f"model.path={tiny_model}",
            f"train.adapter.kind={adapter}",
            "train.checkpoint.output_format=kohya",
            "train.checkpoint.output_name=mine",
        ],
    )
    path = lora_files.keep_step(str(tmp_path), cfg, str(tmp_path / "run"), {"step": 3, "epoch": 0})
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert meta["ss_network_module"] == "lycoris.kohya"
    assert json.loads(meta["ss_network_args"])["algo"] == {"dora": "lora", "lokr": "lokr"}[adapter]
    kept = load_file(path)
    assert kept.keys() == written.keys() and all(torch.equal(kept[k], written[k]) for k in kept)


@pytest.mark.parametrize("adapter", ["dora", "lokr"])
def test_resume_continues_exactly(tiny_model, tmp_path, adapter):
    """4 steps straight == 2 steps, checkpoint, a fresh trainer restored from it, 2 more steps."""
    cfg = train_data.job(
        tiny_model,
        f"train.adapter.kind={adapter}",
        "train.checkpoint.output_format=kohya",
        "train.adapter.targets=all",
        "train.optim.learning_rate=0.01",
        "train.gradient_accumulation=2",
    )
    groups = train_data.groups(train_data.items(8), 2)

    def fresh():
        return LoraTrainer(cfg, "cpu", total_steps=4, empty=train_data.empty_caption())

    def weights(trainer):
        return {k: v.detach().clone() for k, v in lora.lora_state_dict(trainer.transformer).items()}

    straight = fresh()
    for g in groups:
        straight.train_step(g)
    first = fresh()
    start = weights(first)
    for g in groups[:2]:
        first.train_step(g)
    checkpoint.save(str(tmp_path), first, 0, checkpoint.Progress(step=2, batches_done=4, world_size=1), "kohya")
    assert (tmp_path / kohya.KOHYA_NAME).exists()
    del first
    resumed = fresh()
    checkpoint.restore(str(tmp_path), resumed, 0, world_size=1)
    for g in groups[2:]:
        resumed.train_step(g)
    want, got = weights(straight), weights(resumed)
    assert any(not torch.equal(want[k], start[k]) for k in want)  # training moved the adapter
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-7)


def test_dora_starts_from_a_dora_file_exactly_and_refuses_a_plain_lora(tiny_model, tmp_path):
    source = adapter_values.transformer(tiny_model)
    lora.add_lora(source, rank=4, alpha=8.0, targets="attention", adapter="dora")
    adapter_values.randomise(source, 7)
    path = lora.save_diffusers(source, tmp_path / "dora")
    target = adapter_values.transformer(tiny_model)
    lora.add_lora(target, rank=4, alpha=2.0, targets="attention", adapter="dora")  # another alpha: strength kept
    lora.init_from_file(target, str(path))
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(0))
    for name in ("transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_v"):
        a, b = source.get_submodule(name), target.get_submodule(name)
        torch.testing.assert_close(b(x), a(x), rtol=1e-5, atol=1e-6)
    plain = adapter_values.transformer(tiny_model)
    lora.add_lora(plain, rank=4, alpha=8.0, targets="attention")
    plain_path = lora.save_diffusers(plain, tmp_path / "lora")
    fresh = adapter_values.transformer(tiny_model)
    lora.add_lora(fresh, rank=4, alpha=8.0, targets="attention", adapter="dora")
    with pytest.raises(ValueError, match="DoRA starts only from a DoRA file"):
        lora.init_from_file(fresh, str(plain_path))


def test_a_lokr_file_loads_in_diffusers_flux2_pipeline_and_renders_the_trained_model(tiny_flux2_klein, tmp_path):
    """diffusers' FLUX.2 pipelines read LyCORIS LoKr keys (``lycoris_transformer_blocks_0_attn_to_q.lokr_w1``): the
    exported file, loaded there, renders what the trained adapter renders (FLUX.2's own single-block layers)."""
    from diffusers import DiffusionPipeline

    def pipe():
        p = DiffusionPipeline.from_pretrained(str(tiny_flux2_klein))
        p.set_progress_bar_config(disable=True)
        return p

    def draw(p):
        return p(
            prompt="a red circle",
            height=64,
            width=64,
            num_inference_steps=2,
            guidance_scale=1.0,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
        ).images[0]

    trained_pipe = pipe()
    base = draw(trained_pipe)
    lora.add_lora(trained_pipe.transformer, rank=2, alpha=6.0, targets="all", adapter="lokr")
    adapter_values.randomise(trained_pipe.transformer, 9)
    trained = draw(trained_pipe)
    assert np.abs(trained - base).max() > 0.01
    kohya.save(trained_pipe.transformer, tmp_path, lora.scale(trained_pipe.transformer))
    loaded = pipe()
    loaded.load_lora_weights(str(tmp_path), weight_name=kohya.KOHYA_NAME)
    np.testing.assert_allclose(draw(loaded), trained, atol=1e-5)


def test_help_documents_the_adapter_with_kohyas_names():
    text = config.help_text()
    entry = text[text.index("train.adapter.kind = 'lora'") :].split("\n    train.", 1)[0]
    assert all(word in entry for word in ("dora", "lokr", "lycoris.kohya", "algo=lokr", "networks.lora"))


def test_a_klein_lokr_file_carries_comfyui_keys_that_rebuild_the_trained_weights(tiny_flux2_klein, tmp_path):
    """Tiny FLUX.2 [klein], every preset target (the single blocks' fused ``to_qkv_mlp_proj`` and their output
    projection ``to_out`` included): every key of the LyCORIS file is one ComfyUI maps for FLUX.2, and its LoKr
    arithmetic on them gives the weights peft's merge of the trained adapter gives, for every BFL block weight."""
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import load_file

    t = Flux2Transformer2DModel.from_pretrained(str(tiny_flux2_klein), subfolder="transformer")
    tc = dict(t.config)
    base = _bfl_base(t, tc)
    lora.add_lora(t, rank=2, alpha=6.0, targets="all", adapter="lokr")
    adapter_values.randomise(t, 4)
    state = load_file(kohya.save(t, tmp_path, lora.scale(t)))
    assert all(k.startswith("lycoris_") for k in state)
    assert "lycoris_single_transformer_blocks_0_attn_to_out.lokr_w1" in state
    assert len(check_comfy_keys(state, tc)) == len(lora.adapted_modules(t))
    got = comfy_apply(state, tc, base)
    _merge(t)
    want = _bfl_base(t, tc)
    assert all(not torch.allclose(want[k], base[k]) for k in base)  # "all" adapts every block weight
    for k in base:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.parametrize("name", ["flux2-klein-4b", "flux2-klein-9b"])
def test_klein_lokr_keys_at_real_widths_on_the_meta_device(name):
    """FLUX.2 [klein] 4B and 9B at their real widths on the meta device, every preset: each that trains the single
    blocks holds their output projection (``attn.to_out``, BFL's ``linear2``, which the klein fix trains; ``context``
    trains only the double blocks' text stream, by its meaning), and every LoKr module of the
    export is a key ComfyUI maps for FLUX.2, with shapes its LoKr arithmetic accepts (the factorisation depends on
    the widths)."""
    from rayflux.families.flux2 import Flux2
    from rayflux.models import meta_transformer

    tc = Flux2.built_in_configs[name][0]
    for preset in lora.PRESETS:
        meta = meta_transformer(tc)
        targets = lora.resolve_targets(meta, preset)
        if preset == "context":
            assert not any(t.startswith("single_transformer_blocks.") for t in targets), targets
        else:
            assert "single_transformer_blocks.0.attn.to_out" in targets, preset
        with torch.device("meta"):
            lora.add_lora(meta, 16, 16, preset, adapter="lokr")
        kohya.check_adapter(meta)
        with torch.device("meta"):
            converted = kohya.from_peft(lora.lora_state_dict(meta), 1.0, {}, Flux2.kohya_blocks)
        assert len(check_comfy_keys(converted, tc)) == len(targets), preset
