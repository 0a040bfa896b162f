"""The model-family registry: a model directory's ``model_index.json`` class picks its family, and nothing else."""

import json
import shutil

import pytest

from rayflux import families, models
from rayflux.config import ModelConfig


def test_every_flux_pipeline_class_has_one_family():
    assert families.for_class("FluxPipeline").name == "flux1"
    assert families.for_class("Flux2KleinPipeline").name == "flux2"
    assert families.for_class("Flux2Pipeline").name == "flux2"
    with pytest.raises(ValueError, match="StableDiffusionPipeline is not a supported family: FluxPipeline"):
        families.for_class("StableDiffusionPipeline")


def test_the_tiny_model_is_flux1_with_its_named_text_tensors(tiny_model):
    cfg = ModelConfig(path=str(tiny_model))
    facts = models.model_facts(cfg)
    assert models.family(cfg).name == facts.family == "flux1"
    assert [(t.name, t.dims, t.length) for t in facts.text] == [
        ("t5", ("t5_len", "t5_dim"), 512),
        ("clip_pooled", ("clip_dim",), 0),
    ]
    assert (facts.pack, facts.alignment, facts.architecture) == (2, 16, "flux-1-dev")
    transformer = models.load_transformer(cfg, "cpu", None)
    assert families.of_transformer(transformer) is models.family(cfg)


def test_another_class_or_a_missing_part_is_refused_in_one_line(tiny_model, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusion3Pipeline"}))
    with pytest.raises(
        ValueError, match="holds StableDiffusion3Pipeline, not a supported family: .*Flux2KleinPipeline"
    ):
        models.model_facts(ModelConfig(path=str(other)))
    (other / "model_index.json").write_text(json.dumps(index))
    shutil.rmtree(other / "tokenizer_2")
    with pytest.raises(ValueError, match="holds FluxPipeline.*; missing tokenizer_2"):
        models.model_facts(ModelConfig(path=str(other)))


def test_kontext_is_flux1_math_under_its_own_pipeline(tiny_kontext, tiny_model):
    from diffusers import FluxKontextPipeline

    cfg = ModelConfig(path=str(tiny_kontext))
    family, facts = models.family(cfg), models.model_facts(cfg)
    assert (family.name, facts.architecture, family.pipeline_class()) == (
        "kontext",
        "flux-1-kontext-dev",
        FluxKontextPipeline,
    )
    flux1 = models.model_facts(ModelConfig(path=str(tiny_model)))
    assert (facts.text, facts.latent_channels, facts.pack) == (flux1.text, flux1.latent_channels, flux1.pack)
