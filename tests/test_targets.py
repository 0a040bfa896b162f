"""``train.targets`` (issue 45 item 4): presets, names and globs, excludes and block ranges select the documented
modules; ``plan`` lists them."""

import pytest
import torch

from rayflux import config, families, plan
from rayflux.config import ConfigError
from rayflux.families.flux1 import FLUX1_DEV
from rayflux.families.flux2 import FLUX2_KLEIN_4B
from rayflux.train.adapter import targets

FLUX1 = families.by_name("flux1")


def _flux1_names(double: int = 3, single: int = 3) -> list[str]:
    """FLUX.1's Linear module names for a model of ``double`` + ``single`` blocks (and two outside them)."""
    d = [
        *(f"attn.{m}" for m in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj")),
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
        "norm1.linear",
        "norm1_context.linear",
    ]
    s = ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out", "norm.linear"]
    return [
        "x_embedder",
        *(f"transformer_blocks.{i}.{m}" for i in range(double) for m in d),
        *(f"single_transformer_blocks.{i}.{m}" for i in range(single) for m in s),
        "proj_out",
    ]


def _select(spec: str, names=None) -> list[str]:
    return targets.select(targets.parse(spec), names or _flux1_names(), FLUX1.lora_presets, FLUX1.lora_blocks)


def test_block_ranges_pick_blocks_and_default_to_attention():
    chosen = _select("double 0-1, single 2")
    doubles = {int(n.split(".")[1]) for n in chosen if n.startswith("transformer_blocks.")}
    singles = {int(n.split(".")[1]) for n in chosen if n.startswith("single_")}
    assert doubles == {0, 1} and singles == {2}
    assert chosen == [n for n in _select("attention") if n in chosen]  # the attention preset, no ff or norm
    assert not any("ff." in n or "proj_mlp" in n or "norm" in n for n in chosen)
    assert _select("attention, double all") == [n for n in _select("attention") if n.startswith("transformer_")]


def test_excludes_names_and_globs():
    chosen = _select("attention+ffs, -to_out.0, -single_transformer_blocks.1.*")
    assert not any(n.endswith("to_out.0") or n.startswith("single_transformer_blocks.1.") for n in chosen)
    assert "single_transformer_blocks.0.proj_out" in chosen and "proj_out" not in chosen  # presets stay in blocks
    assert "proj_out" in _select("attention, proj_out")  # an explicit name reaches the whole model
    globbed = _select("transformer_blocks.*.attn.to_q")
    assert globbed == [f"transformer_blocks.{i}.attn.to_q" for i in range(3)]


def test_context_preset_is_the_text_stream():
    chosen = _select("context")
    assert chosen and all(n.startswith("transformer_blocks.") for n in chosen)
    assert {n.split(".", 2)[2] for n in chosen} == {
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    }


@pytest.mark.parametrize(
    "spec, message",
    [
        ("double 5", "double blocks 5 do not exist"),
        ("attention, -nope", "no Linear module matches"),
        ("to_qq", "no Linear module matches"),
    ],
)
def test_selection_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        _select(spec)


@pytest.mark.parametrize("spec", ["double", "double 3-1", "double x", "attention double 1"])
def test_malformed_specs_stop_the_config(spec):
    with pytest.raises(ConfigError, match="train.adapter.targets"):
        config.load(None, [f"train.targets={spec}"])


def test_plan_lists_the_modules_and_parameters_of_the_spec():
    spec = "double 0-9, single all, -to_out.0"
    lines = plan.target_lines(FLUX1_DEV, spec, plan.count_parameters(FLUX1_DEV, spec, 4)[1])
    assert lines[0].startswith(f"  this job's targets='{spec}': {10 * 7 + 38 * 3} modules, ")
    # 7 double-block projections 3072 -> 3072 and 3 single-block ones, rank 4: 4 * (3072 + 3072) each
    assert f"{(10 * 7 + 38 * 3) * 4 * 6144:,} trainable" in lines[0]
    assert lines[1].strip().startswith("double 0-9: attn.to_q, attn.to_k, attn.to_v, attn.add_q_proj")
    assert lines[2].strip() == "single 0-37: attn.to_q, attn.to_k, attn.to_v"
    klein = plan.target_lines(FLUX2_KLEIN_4B, "context", 0)
    assert [line.strip().split(":")[0] for line in klein[1:]] == ["double 0-4"]


def test_pattern_keys_resolve_over_the_trained_modules_later_keys_winning():
    chosen = _select("all")
    pattern = {"double all": 8, "single 1-2": 16, "transformer_blocks.2.*": 2}
    values = targets.pattern_values(pattern, chosen, FLUX1.lora_presets, FLUX1.lora_blocks, "rank_pattern")
    assert values["transformer_blocks.0.ff.net.2"] == 8 and values["transformer_blocks.2.attn.to_q"] == 2
    assert values["single_transformer_blocks.1.proj_mlp"] == 16 and "single_transformer_blocks.0.proj_mlp" not in values
    with pytest.raises(ValueError, match="selects none of the trained modules"):
        targets.pattern_values({"context": 4}, _select("single all"), FLUX1.lora_presets, FLUX1.lora_blocks, "x")


def test_per_block_rank_and_alpha_train_save_and_resume(tiny_model, tmp_path):
    """peft gets each module's rank and alpha; the diffusers file bakes each module's own alpha / rank, and a resume
    restores every module's update."""
    import adapter_values

    from rayflux.train.adapter import lora

    kw = {"rank_pattern": {"single all": 8}, "alpha_pattern": {"double 0": 1.0}}
    source = adapter_values.transformer(tiny_model)
    params = lora.add_lora(source, 4, 4.0, "attention", **kw)
    shapes = {n: p.shape[0] for n, p in source.named_parameters() if ".lora_A." in n}
    assert shapes["single_transformer_blocks.0.attn.to_q.lora_A.default.weight"] == 8
    assert shapes["transformer_blocks.0.attn.to_q.lora_A.default.weight"] == 4
    scales = lora.module_scales(source)
    assert scales["transformer_blocks.0.attn.to_q"] == 0.25 and scales["single_transformer_blocks.0.attn.to_q"] == 0.5
    bare = adapter_values.transformer(tiny_model)
    assert lora.trainable_count(bare, 4, "attention", rank_pattern=kw["rank_pattern"]) == sum(p.numel() for p in params)
    adapter_values.randomise(source, 3)
    path = lora.save_diffusers(source, tmp_path)
    target = adapter_values.transformer(tiny_model)
    lora.add_lora(target, 4, 4.0, "attention", **kw)
    lora.load_into(target, path)
    want, got = lora.delta_weights(source), lora.delta_weights(target)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_kohya_export_refuses_a_fused_layer_of_two_ranks(tiny_model):
    import adapter_values

    from rayflux.train.adapter import kohya, lora

    t = adapter_values.transformer(tiny_model)
    lora.add_lora(t, 4, 4.0, "attention", rank_pattern={"attn.to_q": 8})
    with pytest.raises(ValueError, match="give the parts of a fused layer one rank"):
        kohya.check_adapter(t)


@pytest.mark.parametrize(
    "pattern, message",
    [
        ({"adapter.rank_pattern": {"double 0": 0}}, "positive int"),
        ({"rank_pattern": {"double 0": 2.5}}, "positive int"),
        ({"alpha_pattern": {"double x": 2}}, "no block number"),
        (
            {"adapter.rank_pattern": {"double 0": 8}, "adapter.kind": "lokr", "checkpoint.output_format": "kohya"},
            "lokr",
        ),
    ],
)
def test_bad_patterns_stop_the_config(pattern, message):
    import json

    sets = [f"train.{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in pattern.items()]
    with pytest.raises(ConfigError, match=message):
        config.load(None, sets)
