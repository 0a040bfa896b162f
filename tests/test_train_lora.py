"""LoRA targets, the diffusers and kohya output formats, and starting from an existing LoRA file."""

import adapter_values
import numpy as np
import pytest
import torch
from pipeline_support import render

from rayflux import config
from rayflux.families.flux1 import Flux1
from rayflux.train.adapter import kohya, lora, lora_files

# Everything kohya can name, except a single block's q/k/v/mlp: diffusers 0.42 splits a kohya ``linear1`` with
# FLUX.1's real widths (3072, 12288) hard-coded, which the tiny model does not have. test_fused_kohya_layers_*
# covers ``linear1`` with exact arithmetic instead.
LOADABLE = (
    "transformer_blocks.0.attn.to_q,transformer_blocks.0.attn.to_k,transformer_blocks.0.attn.to_v,to_out.0,"
    "add_q_proj,add_k_proj,add_v_proj,to_add_out,ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2,"
    "norm1.linear,norm1_context.linear,norm.linear,single_transformer_blocks.0.proj_out"
)


def test_presets_stay_inside_the_blocks(tiny_model):
    t = adapter_values.transformer(tiny_model)
    attention = lora.resolve_targets(t, "attention")
    assert "single_transformer_blocks.0.attn.to_q" in attention and "transformer_blocks.0.attn.to_add_out" in attention
    ffs = lora.resolve_targets(t, "attention+ffs")
    assert "single_transformer_blocks.0.proj_out" in ffs and "proj_out" not in ffs
    everything = lora.resolve_targets(t, "all")
    assert set(ffs) < set(everything) and "transformer_blocks.0.norm1.linear" in everything
    assert all(n.startswith(Flux1.lora_blocks) for n in everything)


def test_explicit_list_matches_like_peft_and_rejects_unknown_names(tiny_model):
    t = adapter_values.transformer(tiny_model)
    assert lora.resolve_targets(t, "proj_out, x_embedder") == [
        "x_embedder",
        "single_transformer_blocks.0.proj_out",
        "proj_out",
    ]
    with pytest.raises(ValueError, match="to_qq"):
        lora.resolve_targets(t, "to_q,to_qq")


def test_kohya_refuses_layers_it_cannot_name(tiny_model):
    kohya.check_targets(lora.resolve_targets(adapter_values.transformer(tiny_model), "all"), Flux1.kohya_blocks)
    with pytest.raises(ValueError, match="x_embedder"):
        kohya.check_targets(["transformer_blocks.0.attn.to_q", "x_embedder"], Flux1.kohya_blocks)


def test_diffusers_and_kohya_files_give_the_same_images(tiny_model, tmp_path):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_model)
    base = render(pipe)
    lora.add_lora(pipe.transformer, rank=4, alpha=8.0, targets=LOADABLE)  # alpha != rank: the scale must travel
    adapter_values.randomise(pipe.transformer, 1)
    trained = render(pipe)
    assert np.abs(trained - base).max() > 0.05
    lora.save_diffusers(pipe.transformer, tmp_path)
    kohya.save(pipe.transformer, tmp_path, lora.scale(pipe.transformer))

    from safetensors import safe_open

    with safe_open(str(tmp_path / kohya.KOHYA_NAME), "pt") as f:
        assert all(k.startswith("lora_unet_") for k in f.keys())
    with safe_open(str(tmp_path / lora.WEIGHT_NAME), "pt") as f:
        assert all(k.startswith("transformer.") for k in f.keys())

    images = {}
    for name in (lora.WEIGHT_NAME, kohya.KOHYA_NAME):
        fresh = FluxPipeline.from_pretrained(tiny_model)
        fresh.load_lora_weights(str(tmp_path), weight_name=name)
        images[name] = render(fresh)
    np.testing.assert_allclose(images[lora.WEIGHT_NAME], images[kohya.KOHYA_NAME], atol=1e-5)
    np.testing.assert_allclose(images[lora.WEIGHT_NAME], trained, atol=1e-5)


def _strip_metadata(path) -> None:
    """Rewrite a safetensors file with no metadata at all, as some tools and hubs pass LoRAs around."""
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(path)), str(path))


def test_diffusers_file_keeps_its_strength_without_metadata(tiny_model, tmp_path):
    """alpha != rank: a loader that finds no adapter metadata (strength 1) still renders the trained model."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_model)
    lora.add_lora(pipe.transformer, rank=4, alpha=8.0, targets=LOADABLE)
    adapter_values.randomise(pipe.transformer, 4)
    trained = render(pipe)
    path = lora.save_diffusers(pipe.transformer, tmp_path)
    _strip_metadata(path)
    fresh = FluxPipeline.from_pretrained(tiny_model)
    fresh.load_lora_weights(str(tmp_path), weight_name=lora.WEIGHT_NAME)
    np.testing.assert_allclose(render(fresh), trained, atol=1e-5)


def test_resume_restores_the_trained_update_from_a_baked_file(tiny_model, tmp_path):
    source = adapter_values.transformer(tiny_model)
    lora.add_lora(source, rank=4, alpha=2.0, targets="attention")
    adapter_values.randomise(source, 5)
    path = lora.save_diffusers(source, tmp_path)
    target = adapter_values.transformer(tiny_model)
    lora.add_lora(target, rank=4, alpha=2.0, targets="attention")
    lora.load_into(target, path)
    want, got = lora.delta_weights(source), lora.delta_weights(target)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_fused_kohya_layers_hold_each_parts_update(tiny_model):
    """``up @ down`` of a fused kohya layer equals its diffusers parts' ``scale * B @ A`` stacked in order."""
    t = adapter_values.transformer(tiny_model)
    lora.add_lora(t, rank=2, alpha=3.0, targets="attention")  # single blocks: q, k, v trained, proj_mlp not
    adapter_values.randomise(t, 2)
    deltas = lora.delta_weights(t)
    state = lora.lora_state_dict(t)
    out_features = {n: m.out_features for n, m in t.named_modules() if isinstance(m, torch.nn.Linear)}
    k = kohya.from_peft(state, lora.scale(t), out_features, Flux1.kohya_blocks)

    def fused(name):
        key = kohya.PREFIX + name
        assert float(k[f"{key}.alpha"]) == k[f"{key}.lora_down.weight"].shape[0]  # strength 1: scale is baked in
        return k[f"{key}.lora_up.weight"] @ k[f"{key}.lora_down.weight"]

    s = "single_transformer_blocks.0."
    linear1 = fused("single_blocks_0_linear1")
    want = torch.cat([deltas[s + "attn.to_q"], deltas[s + "attn.to_k"], deltas[s + "attn.to_v"], torch.zeros(128, 32)])
    torch.testing.assert_close(linear1, want)
    d = "transformer_blocks.0.attn."
    qkv = fused("double_blocks_0_txt_attn_qkv")
    want = torch.cat([deltas[d + "add_q_proj"], deltas[d + "add_k_proj"], deltas[d + "add_v_proj"]])
    torch.testing.assert_close(qkv, want)
    torch.testing.assert_close(fused("double_blocks_0_img_attn_proj"), deltas[d + "to_out.0"])


@pytest.mark.parametrize("fmt", ["diffusers", "kohya"])
def test_init_from_an_existing_lora_file(tiny_model, tmp_path, fmt):
    source = adapter_values.transformer(tiny_model)
    lora.add_lora(source, rank=4, alpha=8.0, targets=LOADABLE)
    adapter_values.randomise(source, 3)
    path = lora.save_diffusers(source, tmp_path)
    if fmt == "kohya":
        path = kohya.save(source, tmp_path, lora.scale(source))

    target = adapter_values.transformer(tiny_model)
    lora.add_lora(target, rank=4, alpha=2.0, targets=LOADABLE)  # another alpha: the file's strength is kept
    assert lora.init_from_file(target, str(path)) == len(LOADABLE.split(","))
    want, got = lora.delta_weights(source), lora.delta_weights(target)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_init_refuses_a_lora_of_another_rank(tiny_model, tmp_path):
    source = adapter_values.transformer(tiny_model)
    lora.add_lora(source, rank=8, alpha=8.0, targets="attention")
    path = lora.save_diffusers(source, tmp_path)
    target = adapter_values.transformer(tiny_model)
    lora.add_lora(target, rank=4, alpha=4.0, targets="attention")
    with pytest.raises(ValueError, match="train.adapter.rank"):
        lora.init_from_file(target, str(path))


def test_kohya_step_file_is_named_and_carries_training_metadata(tiny_model, tmp_path):
    """The exported kohya file keeps its tensors (strength included, alpha != rank) and gains sd-scripts' keys."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from diffusers import FluxPipeline
    from safetensors import safe_open

    pipe = FluxPipeline.from_pretrained(tiny_model)
    lora.add_lora(pipe.transformer, rank=4, alpha=8.0, targets=LOADABLE)
    adapter_values.randomise(pipe.transformer, 6)
    trained = render(pipe)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    kohya.save(pipe.transformer, ckpt, lora.scale(pipe.transformer))
    text = tmp_path / "text.parquet"
    pq.write_table(pa.table({"caption": ["ohwx, a dog, grass", "ohwx, a cat", None]}), text)
    cfg = config.load(
        None,
        [
            f"model.path={tiny_model}",
            "train.checkpoint.output_format=kohya",
            "train.adapter.rank=4",
            "train.adapter.alpha=8",
            "train.checkpoint.output_name=my-lora",
            "train.epochs=3",
        ],
    )
    path = lora_files.keep_step(str(ckpt), cfg, str(tmp_path / "run"), {"step": 500, "epoch": 1}, [str(text)])
    assert path == str(tmp_path / "run" / "lora" / "my-lora-step00000500.safetensors")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("4", "8.0")
    assert (meta["ss_steps"], meta["ss_epoch"], meta["ss_num_epochs"]) == ("500", "2", "3")
    assert meta["ss_resolution"] == "(512, 512)" and meta["modelspec.resolution"] == "512x512"
    assert json.loads(meta["ss_tag_frequency"]) == {"my-lora": {"ohwx": 2, "a dog": 1, "grass": 1, "a cat": 1}}
    fresh = FluxPipeline.from_pretrained(tiny_model)
    fresh.load_lora_weights(str(tmp_path / "run" / "lora"), weight_name="my-lora-step00000500.safetensors")
    np.testing.assert_allclose(render(fresh), trained, atol=1e-5)


def test_output_name_must_be_a_file_name():
    with pytest.raises(config.ConfigError, match="output_name"):
        config.load(None, ["train.checkpoint.output_name=a/b"])
