"""Validation renders load the text encoders once per run and draw what a plain ``FluxPipeline`` draws."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rayflux import config, memory, models
from rayflux.train.observe import validation

PROMPTS = ["a red circle", "a blue square on green"]


def test_text_encoders_load_once_and_renders_match_the_full_pipeline(tiny_model, tmp_path):
    import shutil

    from diffusers import FluxPipeline

    model = shutil.copytree(tiny_model, tmp_path / "model")
    cfg = config.load(
        None,
        [
            f"model.path={model}",
            "data.resolution=64",
            "train.validation.inference_steps=2",
            f"train.validation.prompts={PROMPTS}",
        ],
    )
    transformer = models.load_transformer(cfg.model, "cpu", torch.float32)
    alive = memory.live_encoders()
    first = validation.render(transformer, cfg, "cpu", torch.float32)
    # The text encoders' weights are gone: a second render that loaded them again would fail.
    for weights in [*model.glob("text_encoder/*.safetensors"), *model.glob("text_encoder_2/*.safetensors")]:
        weights.unlink()
    second = validation.render(transformer, cfg, "cpu", torch.float32)
    assert memory.live_encoders() == alive  # text encoders dropped after encoding, the VAE after each render

    pipe = FluxPipeline.from_pretrained(str(tiny_model), transformer=transformer, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    facts = models.model_facts(cfg.model)
    assert cfg.train.validation.guidance == 0  # FLUX.1 renders with its own 3.5
    for i, prompt in enumerate(PROMPTS):
        full = pipe(
            prompt,
            height=64,
            width=64,
            num_inference_steps=2,
            guidance_scale=3.5,
            max_sequence_length=facts.text_length,
            generator=torch.Generator().manual_seed(i),
        ).images[0]
        np.testing.assert_array_equal(np.asarray(first[i]), np.asarray(full))
        np.testing.assert_array_equal(np.asarray(second[i]), np.asarray(full))


def test_reference_images_are_decoded_as_the_cache_decodes_them_and_read_once(tmp_path):
    from PIL import Image

    from rayflux.cache.decode import decode

    upright = np.zeros((48, 32, 3), np.uint8)  # 32 wide, 48 tall: red over blue
    upright[:24] = (255, 0, 0)
    upright[24:] = (0, 0, 255)
    rotated = tmp_path / "phone.png"  # stored on its side, upright only through EXIF orientation 6
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90).save(rotated, exif=exif.tobytes())
    clear = tmp_path / "clear.png"  # fully transparent: the cache composites it onto white
    Image.new("RGBA", (40, 40), (0, 0, 0, 0)).save(clear)
    cfg = config.load(
        None,
        [
            "data.resolution=32",
            'train.validation.prompts=["make it green"]',
            f'train.validation.references=[["{rotated}", "{clear}"]]',
        ],
    )

    size = validation.image_size(cfg)
    phone, white = (np.asarray(img) for img in validation._references(cfg, size)[0])
    cached = decode(rotated.read_bytes(), cfg.data.max_image_pixels)
    assert cached.size == (32, 48)  # the cache's decoder turns it upright
    assert phone.shape == (size, size, 3)
    assert (phone[0] == (255, 0, 0)).all() and (phone[-1] == (0, 0, 255)).all()  # upright: red on top, as cached
    assert (white == 255).all()
    rotated.unlink()
    clear.unlink()
    again = validation._references(cfg, size)[0]  # a later render: nothing read again
    np.testing.assert_array_equal(np.asarray(again[0]), phone)


def test_the_render_actor_goes_where_the_cluster_has_room():
    from rayflux.train.observe import renderer

    def choose(use_gpu, gpus, *sets):
        cfg = config.load(None, ["train.workers.num_workers=2", *sets])
        resources, _ = renderer.choose_resources(cfg, use_gpu, {"CPU": 16, "GPU": gpus})
        return resources, renderer.gpu_share(resources)

    assert choose(False, 0) == ({"CPU": 0.5}, 0.0)  # a CPU cluster: a CPU share, workers keep their GPUs (none)
    assert choose(True, 2, "cache.accelerator_type=L4") == ({"CPU": 1, "GPU": 1, "accelerator_type:L4": 0.001}, 0.0)
    assert choose(True, 3) == ({"CPU": 1, "GPU": 1}, 0.0)  # a spare GPU beside the 2 workers'
    assert choose(True, 2) == ({"CPU": 1, "GPU": 0.25}, 0.25)  # no room: a quarter of each training GPU
    assert choose(True, 2, 'train.validation.resources={"CPU": 0.5}') == ({"CPU": 0.5}, 0.0)


def test_true_cfg_renders_what_the_pipeline_guides_and_refuses_a_scale_that_does_nothing(tiny_model):
    """``train.validation.true_cfg`` with a negative prompt draws what ``FluxPipeline`` draws with that
    ``true_cfg_scale`` and ``negative_prompt``, and differs from the unguided render."""
    from diffusers import FluxPipeline

    sets = [f"model.path={tiny_model}", "data.resolution=64", "train.validation.inference_steps=2"]
    sets.append(f"train.validation.prompts={PROMPTS[:1]}")
    guided = config.load(None, [*sets, "train.validation.true_cfg=4", "train.validation.negative_prompt=a green ring"])
    transformer = models.load_transformer(guided.model, "cpu", torch.float32)
    image = np.asarray(validation.render(transformer, guided, "cpu", torch.float32)[0])
    plain = np.asarray(validation.render(transformer, config.load(None, sets), "cpu", torch.float32)[0])

    pipe = FluxPipeline.from_pretrained(str(tiny_model), transformer=transformer, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    full = pipe(
        PROMPTS[0],
        negative_prompt="a green ring",
        true_cfg_scale=4.0,
        height=64,
        width=64,
        num_inference_steps=2,
        guidance_scale=3.5,
        max_sequence_length=models.model_facts(guided.model).text_length,
        generator=torch.Generator().manual_seed(0),
    ).images[0]
    np.testing.assert_array_equal(image, np.asarray(full))
    assert not np.array_equal(image, plain)
    with pytest.raises(config.ConfigError, match="true_cfg must be 0 .off. or above 1"):
        config.load(None, [*sets, "train.validation.true_cfg=0.5"])
