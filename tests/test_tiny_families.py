"""The tiny FLUX.2 [klein], FLUX.2 [dev] and Kontext directories load through ``from_pretrained`` like the real
models and render end to end on CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

STEPS = dict(height=64, width=64, num_inference_steps=2, output_type="np", max_sequence_length=32)


def _reference(seed: int) -> Image.Image:
    return Image.fromarray((np.random.default_rng(seed).random((64, 64, 3)) * 255).astype(np.uint8))


def _check_render(images):
    assert images.shape == (1, 64, 64, 3)
    assert np.isfinite(images).all()


def test_klein_loads_and_renders(tiny_flux2_klein):
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3ForCausalLM

    assert json.loads((tiny_flux2_klein / "model_index.json").read_text())["_class_name"] == "Flux2KleinPipeline"
    pipe = Flux2KleinPipeline.from_pretrained(tiny_flux2_klein)
    assert isinstance(pipe.text_encoder, Qwen3ForCausalLM)
    # Deeper than the pipeline's highest default layer (27), so the real defaults run unchanged.
    assert pipe.text_encoder.config.num_hidden_layers > 27
    assert not pipe.transformer.config.guidance_embeds
    # Batch-norm statistics a trained VAE would have, not a fresh layer's identity.
    assert pipe.vae.bn.running_mean.abs().sum() > 0 and not torch.allclose(pipe.vae.bn.running_var, torch.ones(1))
    # Default guidance (4.0) on a base model: the classifier-free branch runs too.
    _check_render(pipe(prompt="a red circle", generator=torch.Generator().manual_seed(0), **STEPS).images)
    out = pipe(prompt="a red circle", image=[_reference(1)], generator=torch.Generator().manual_seed(0), **STEPS)
    _check_render(out.images)


def test_klein_chat_template_turns_thinking_off(tiny_flux2_klein):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_flux2_klein / "tokenizer")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "a red circle"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert text == "<|im_start|>user\na red circle<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # The template's markers are single special tokens, not spelled out in bytes.
    assert tok.convert_tokens_to_ids("<|im_start|>") in tok(text)["input_ids"]


def test_dev_loads_and_renders(tiny_flux2_dev):
    from diffusers import Flux2Pipeline
    from diffusers.pipelines.flux2.pipeline_flux2 import format_input
    from transformers import Mistral3ForConditionalGeneration

    assert json.loads((tiny_flux2_dev / "model_index.json").read_text())["_class_name"] == "Flux2Pipeline"
    pipe = Flux2Pipeline.from_pretrained(tiny_flux2_dev)
    assert isinstance(pipe.text_encoder, Mistral3ForConditionalGeneration)
    assert pipe.text_encoder.config.text_config.num_hidden_layers > 30
    assert pipe.transformer.config.guidance_embeds
    text = pipe.tokenizer.apply_chat_template(format_input(["a red circle"]), tokenize=False)[0]
    assert text.startswith("<s>[SYSTEM_PROMPT]") and text.endswith("[INST]a red circle[/INST]")
    _check_render(pipe(prompt="a red circle", generator=torch.Generator().manual_seed(0), **STEPS).images)
    out = pipe(prompt="a red circle", image=[_reference(2)], generator=torch.Generator().manual_seed(0), **STEPS)
    _check_render(out.images)


def test_kontext_loads_and_edits(tiny_kontext, tiny_model):
    from diffusers import FluxKontextPipeline

    assert json.loads((tiny_kontext / "model_index.json").read_text())["_class_name"] == "FluxKontextPipeline"
    pipe = FluxKontextPipeline.from_pretrained(tiny_kontext)
    # The tiny FLUX.1's own weights under Kontext's pipeline class.
    flux1 = json.loads((tiny_model / "transformer" / "config.json").read_text())
    assert pipe.transformer.config.in_channels == flux1["in_channels"]
    edit = dict(STEPS, max_area=64 * 64, _auto_resize=False)
    out = pipe(image=_reference(3), prompt="make it red", generator=torch.Generator().manual_seed(0), **edit)
    _check_render(out.images)


def test_ensure_reuses_a_current_directory_and_refuses_a_foreign_one(tmp_path):
    from rayflux.testing.tiny_flux2 import TinyFlux2Spec, ensure_tiny_flux2_klein

    spec = TinyFlux2Spec(text_layers=28)
    path = ensure_tiny_flux2_klein(tmp_path / "klein", spec)
    stamp = (path / "transformer" / "config.json").stat().st_mtime_ns
    assert ensure_tiny_flux2_klein(tmp_path / "klein", spec) == path
    assert (path / "transformer" / "config.json").stat().st_mtime_ns == stamp
    (tmp_path / "mine").mkdir()
    with pytest.raises(FileExistsError, match="not a rayflux tiny model"):
        ensure_tiny_flux2_klein(tmp_path / "mine", spec)
