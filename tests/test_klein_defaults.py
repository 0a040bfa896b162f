"""FLUX.2 [klein] right by default: a step-distilled model path draws a warning naming its base checkpoint
(``model.allow_distilled`` silences it), and validation renders can use a second model (``train.validation.model``:
train on base, preview on the distilled model, with its own 4 steps and no guidance). The klein LoKr's ComfyUI keys
are checked in ``tests/test_train_adapters.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayflux import config, models
from rayflux.families.flux2 import FLUX2_KLEIN_4B, FLUX2_KLEIN_9B, klein_base
from rayflux.train.observe import validation


def test_a_distilled_klein_warns_naming_its_base(tiny_flux2_klein, tiny_flux2_klein_distilled):
    distilled = config.load(None, [f"model.path={tiny_flux2_klein_distilled}"])
    warning = models.training_warning(distilled.model)
    assert "is_distilled: true" in warning and "FLUX.2-klein-base-4B" in warning and "model.allow_distilled" in warning
    assert f"train.validation.model={tiny_flux2_klein_distilled}" in warning
    distilled.model.allow_distilled = True
    assert models.training_warning(distilled.model) == ""
    assert models.training_warning(config.load(None, [f"model.path={tiny_flux2_klein}"]).model) == ""
    assert models.training_warning(config.load(None, []).model) == ""  # FLUX.1: nothing to say


def test_the_warning_names_the_base_of_the_models_size():
    assert klein_base(FLUX2_KLEIN_4B) == "black-forest-labs/FLUX.2-klein-base-4B"
    assert klein_base(FLUX2_KLEIN_9B) == "black-forest-labs/FLUX.2-klein-base-9B"


def test_a_validation_model_of_another_shape_is_refused(tiny_model, tiny_flux2_klein, tiny_flux2_klein_distilled):
    fine = config.load(None, [f"model.path={tiny_flux2_klein}", f"train.validation.model={tiny_flux2_klein_distilled}"])
    models.check_validation_model(fine)
    other = config.load(None, [f"model.path={tiny_flux2_klein}", f"train.validation.model={tiny_model}"])
    with pytest.raises(config.ConfigError, match="train.validation.model"):
        models.check_validation_model(other)


def test_renders_preview_on_the_validation_model(tiny_flux2_klein, tiny_flux2_klein_distilled):
    """Trained on [klein] base, rendered with ``train.validation.model`` = the distilled [klein] (given here by the
    issue's name, ``train.validation_model``): the render is the distilled model's own (no guidance), not base's
    (classifier-free guidance 4); 4 steps each, to keep it short."""
    common = ["data.resolution=64", 'train.validation.prompts=["a red circle"]', "train.validation.inference_steps=4"]
    on_base = config.load(None, [f"model.path={tiny_flux2_klein}", *common])
    preview = config.load(
        None, [f"model.path={tiny_flux2_klein}", f"train.validation_model={tiny_flux2_klein_distilled}", *common]
    )
    on_distilled = config.load(None, [f"model.path={tiny_flux2_klein_distilled}", *common])
    transformer = models.load_transformer(on_base.model, "cpu", torch.float32)
    images = [
        np.asarray(validation.render(transformer, c, "cpu", torch.float32)[0], np.float32)
        for c in (preview, on_distilled, on_base)
    ]
    np.testing.assert_array_equal(images[0], images[1])
    assert np.abs(images[0] - images[2]).max() > 1.0
