"""The kohya export at FLUX.1's real widths: one double and one single block (24 heads x 128, joint attention 4096,
pooled 768, MLP ratio 4) with seeded random weights, a LoRA on every preset target including the single block's
fused ``linear1``, loaded back with ``FluxPipeline.load_lora_weights``.

diffusers' kohya reader splits ``linear1`` with FLUX.1's widths (3072, 3072, 3072, 12288) hard-coded, so only a
model of these widths exercises it. The transformer is about 0.55B parameters (2.2 GB in fp32); renders use a
16-token image and 8 text tokens with one inference step, so they take seconds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rayflux import families, models
from rayflux.families.flux1 import FLUX1_DEV
from rayflux.train.adapter import kohya, lora

# FLUX.1-dev's widths (the memory plan's copy of its config), with one block of each kind. in_channels follows the
# tiny VAE, and out_channels defaults to it.
REAL_WIDTHS = {
    **{k: v for k, v in FLUX1_DEV.items() if k not in ("in_channels", "out_channels")},
    "num_layers": 1,
    "num_single_layers": 1,
}


def _render(pipe, prompt: torch.Tensor, pooled: torch.Tensor) -> np.ndarray:
    return pipe(
        prompt_embeds=prompt,
        pooled_prompt_embeds=pooled,
        height=64,
        width=64,
        num_inference_steps=1,
        guidance_scale=3.5,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
    ).images[0]


# Per-block rank and alpha (train.rank_pattern/alpha_pattern): each module's own alpha / rank is baked into its file
# tensors, and both loaders read each module's rank from its shapes.
PER_BLOCK = {"rank_pattern": {"single 0": 8}, "alpha_pattern": {"double 0": 16.0}}


@pytest.mark.parametrize("patterns", [{}, PER_BLOCK], ids=["one_rank", "per_block_rank"])
def test_a_kohya_file_at_real_widths_renders_like_the_diffusers_file(tiny_model, tmp_path, patterns):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    vae = AutoencoderKL.from_pretrained(tiny_model, subfolder="vae")
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(in_channels=4 * vae.config.latent_channels, **REAL_WIDTHS)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_model, subfolder="scheduler"),
        vae=vae,
        transformer=transformer,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
    )
    pipe.set_progress_bar_config(disable=True)
    g = torch.Generator().manual_seed(1)
    prompt, pooled = torch.randn(1, 8, 4096, generator=g), torch.randn(1, 768, generator=g)
    base = _render(pipe, prompt, pooled)

    targets = lora.resolve_targets(transformer, "all")  # every preset's targets are a subset of these
    assert "single_transformer_blocks.0.proj_mlp" in targets and "single_transformer_blocks.0.attn.to_q" in targets
    lora.add_lora(transformer, rank=4, alpha=8.0, targets="all", **patterns)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    trained = _render(pipe, prompt, pooled)
    assert np.abs(trained - base).max() > 0.01  # the LoRA changes the image, so the comparison below means something
    lora.save_diffusers(transformer, tmp_path)
    written = load_file(kohya.save(transformer, tmp_path, lora.scale(transformer)))
    single_rank = 8 if patterns else 4
    assert written["lora_unet_single_blocks_0_linear1.lora_down.weight"].shape[0] == 4 * single_rank  # q, k, v, mlp
    assert written["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape[0] == 3 * 4
    transformer.delete_adapters(lora.ADAPTER)
    np.testing.assert_allclose(_render(pipe, prompt, pooled), base, atol=1e-6)

    images = {}
    for name in (lora.WEIGHT_NAME, kohya.KOHYA_NAME):
        pipe.load_lora_weights(str(tmp_path), weight_name=name)
        images[name] = _render(pipe, prompt, pooled)
        pipe.unload_lora_weights()
    np.testing.assert_allclose(images[kohya.KOHYA_NAME], images[lora.WEIGHT_NAME], atol=1e-4)
    np.testing.assert_allclose(images[lora.WEIGHT_NAME], trained, atol=1e-4)


@pytest.mark.parametrize("model", sorted(families.BUILT_IN))
def test_every_preset_passes_the_trainers_kohya_check_at_real_widths(model):
    """The check the trainer runs with ``train.checkpoint.output_format=kohya``, on each family's real transformer built as
    ``plan`` builds it (meta device): every preset's modules have kohya names. At these widths every preset targets
    20 modules or more, where peft shortens ``target_modules`` to suffixes that name no module (``to_q``)."""
    tc, _ = families.BUILT_IN[model]
    for preset in lora.PRESETS:
        meta = models.meta_transformer(tc)
        targets = lora.resolve_targets(meta, preset)
        with torch.device("meta"):
            lora.add_lora(meta, 16, 16, preset)
        assert lora.adapted_modules(meta) == sorted(targets), preset
        kohya.check_adapter(meta)
    meta = models.meta_transformer(tc)
    with torch.device("meta"):
        lora.add_lora(meta, 16, 16, "x_embedder,to_q")  # the model's input layer has no kohya name
    with pytest.raises(ValueError, match=r"no kohya name for \['x_embedder'\]"):
        kohya.check_adapter(meta)
