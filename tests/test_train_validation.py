"""Validation renders load the text encoders once per run and draw what a plain ``FluxPipeline`` draws."""

from __future__ import annotations

import numpy as np
import torch

from rayflux import config, memory, models
from rayflux.train import validation

PROMPTS = ["a red circle", "a blue square on green"]


def test_text_encoders_load_once_and_renders_match_the_full_pipeline(tiny_model):
    from diffusers import FluxPipeline

    cfg = config.load(None, [f"model.path={tiny_model}", "data.resolution=64", "train.validation_inference_steps=2",
                             f"train.validation_prompts={PROMPTS}"])  # fmt: skip
    transformer = models.load_transformer(cfg.model, "cpu", torch.float32)
    before, alive = validation.text_encoder_loads, memory.live_encoders()
    first = validation.render(transformer, cfg, "cpu", torch.float32)
    second = validation.render(transformer, cfg, "cpu", torch.float32)
    assert validation.text_encoder_loads == before + 1
    assert memory.live_encoders() == alive  # text encoders dropped after encoding, the VAE after each render

    pipe = FluxPipeline.from_pretrained(str(tiny_model), transformer=transformer, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    facts = models.model_facts(cfg.model)
    for i, prompt in enumerate(PROMPTS):
        full = pipe(prompt, height=64, width=64, num_inference_steps=2, guidance_scale=cfg.train.validation_guidance,
                    max_sequence_length=facts.text_length, generator=torch.Generator().manual_seed(i)).images[0]
        np.testing.assert_array_equal(np.asarray(first[i]), np.asarray(full))
        np.testing.assert_array_equal(np.asarray(second[i]), np.asarray(full))
