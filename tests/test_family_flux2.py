"""FLUX.2 [klein] and [dev] through the model-family layer: facts, the inputs the pipelines build, a one-image LoRA
that learns, and both export formats read back by diffusers' own FLUX.2 loaders."""

import numpy as np
import pytest
import torch

from rayflux import config, models
from rayflux.config import ModelConfig
from rayflux.train import step
from rayflux.train.adapter import kohya, lora
from rayflux.train.trainer import LoraTrainer

CAPTION = "a red circle on a blue background"
SIZE = 64


@pytest.fixture(scope="module")
def klein(tiny_flux2_klein):
    return str(tiny_flux2_klein)


@pytest.fixture(scope="module")
def dev(tiny_flux2_dev):
    return str(tiny_flux2_dev)


def _pipe(path):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(path)


def _image():
    from rayflux.testing.images import draw

    return draw(SIZE, SIZE, "red", "circle", "blue")


def _pixels(img) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img, np.float32)).permute(2, 0, 1)[None] / 127.5 - 1.0


@pytest.mark.parametrize("variant", ["klein", "dev"])
def test_facts_and_inputs_match_the_pipeline(variant, request):
    path = request.getfixturevalue(variant)
    cfg = ModelConfig(path=path)
    family, facts = models.family(cfg), models.model_facts(cfg)
    assert (family.name, facts.pack, facts.guidance_embeds) == ("flux2", 1, variant == "dev")
    pipe = _pipe(path)
    assert type(pipe).__name__ in family.pipelines
    assert facts.latent_channels == 4 * pipe.vae.config.latent_channels and facts.vae_scale_factor == 16

    # Text: the pipeline's own prompt embedding, under the one name the cache stores.
    text = family.encode_text(family.load_text_encoders(path, {}, "cpu", torch.float32), [CAPTION, ""], facts)
    assert list(text) == [t.name for t in facts.text] == ["prompt_embeds"]
    want, want_ids = pipe.encode_prompt([CAPTION, ""], device="cpu", max_sequence_length=facts.text_length)
    assert torch.equal(text["prompt_embeds"], want) and want.shape[1] == facts.text.__getitem__(0).length

    # Latent: what the pipeline's _encode_vae_image makes of the VAE's mode (the cache samples; the mode is fixed).
    with torch.no_grad():
        z = pipe.vae.encode(_pixels(_image())).latent_dist.mode()
        ours = family.stored_latent(pipe.vae, z)
        theirs = pipe._encode_vae_image(_pixels(_image()), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ours, theirs) and ours.shape[1:] == (facts.latent_channels, SIZE // 16, SIZE // 16)

    # Tokens and ids as the pipeline's denoising loop passes them to the transformer.
    h, w = ours.shape[2:]
    args = family.forward_args(family.pack(ours), {"prompt_embeds": want[:1]}, torch.tensor([0.5]), h, w, None)
    assert torch.equal(args["hidden_states"], pipe._pack_latents(ours))
    assert torch.equal(args["img_ids"], pipe._prepare_latent_ids(ours)) and args["img_ids"].shape[-1] == 4
    assert torch.equal(args["txt_ids"], want_ids[:1])
    assert torch.equal(family.unpack(args["hidden_states"], h, w), ours)


def test_text_tokens_keep_the_first_tokens_under_a_cache_key_of_their_own(klein, demo_images):
    """``model.text_tokens=16``: tensors of 16 tokens, the same as the default's first 16 (Qwen3 is causal and pads
    on the right), and another cache key."""
    from rayflux.cache.keys import cache_key

    cfgs = [
        config.load(None, [f"model.path={klein}", f"data.images_dir={demo_images}", f"model.text_tokens={n}"])
        for n in (0, 16)
    ]
    full, short = (models.model_facts(c.model) for c in cfgs)
    assert (full.text_length, short.text_length, short.text[0].length) == (512, 16, 16)
    assert cache_key(cfgs[0], full) != cache_key(cfgs[1], short)
    family = models.family(cfgs[0].model)
    encoders = family.load_text_encoders(klein, {}, "cpu", torch.float32)
    a, b = (family.encode_text(encoders, [CAPTION, ""], f)["prompt_embeds"] for f in (full, short))
    assert b.shape == (2, 16, a.shape[2]) and torch.equal(a[:, :16], b)


@pytest.mark.parametrize("variant,steps,guidance", [("base", 50, 4.0), ("distilled", 4, 1.0)])
def test_klein_renders_validation_as_its_kind_is_meant_to_run(variant, steps, guidance, request):
    """[klein] base (no ``is_distilled``, as FLUX.2-klein-base-4B) renders with the pipeline's 50 steps and
    classifier-free guidance 4 against the empty prompt; step-distilled [klein] in 4 steps without guidance. Each
    render (at 2 steps, for time) is the pipeline's own with that guidance."""
    from rayflux.train.observe import validation

    path = str(request.getfixturevalue("tiny_flux2_klein" if variant == "base" else "tiny_flux2_klein_distilled"))
    cfg = config.load(
        None,
        [
            f"model.path={path}",
            f"data.resolution={SIZE}",
            f'train.validation.prompts=["{CAPTION}"]',
            "train.validation.inference_steps=2",
        ],
    )
    assert models.family(cfg.model).validation_settings(path, {}) == (steps, guidance)
    transformer = models.load_transformer(cfg.model, "cpu", torch.float32)
    ours = validation.render(transformer, cfg, "cpu", torch.float32)[0]
    pipe = _pipe(path)
    pipe.transformer = transformer
    theirs = pipe(
        prompt=CAPTION,
        height=SIZE,
        width=SIZE,
        num_inference_steps=2,
        guidance_scale=guidance,
        max_sequence_length=models.model_facts(cfg.model).text_length,
        generator=torch.Generator().manual_seed(cfg.train.seed),
    ).images[0]
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


def _render(pipe, steps=4, output_type="np", **edit):
    return pipe(
        prompt=CAPTION,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(0),
        output_type=output_type,
        **edit,
    ).images[0]


@pytest.fixture(scope="module")
def image_latent(klein):
    """The tiny klein VAE's latent of the training image: the closest any render of this model can come to it (its
    random decoder cannot reproduce pixels, so the comparison is made where the pipeline's render ends)."""
    with torch.no_grad():
        return _pipe(klein).vae.encode(_pixels(_image())).latent_dist.mode()


@pytest.fixture(scope="module")
def trained(klein, image_latent, tmp_path_factory):
    """A one-image LoRA trained in process on the tiny klein's cached form of the image, saved in both formats."""
    cfg = config.load(
        None,
        [
            f"model.path={klein}",
            "train.adapter.rank=8",
            "train.adapter.alpha=8",
            "train.optim.learning_rate=0.01",
            "train.adapter.targets=all",
            "train.flow.sigma_sampling=uniform",
        ],
    )
    family, facts = models.family(cfg.model), models.model_facts(cfg.model)
    pipe = _pipe(klein)
    with torch.no_grad():
        latent = family.stored_latent(pipe.vae, image_latent)
        text = family.encode_text(family.load_text_encoders(klein, {}, "cpu", torch.float32), [CAPTION], facts)
    steps = 80
    trainer = LoraTrainer(cfg, "cpu", total_steps=steps)
    losses = [trainer.train_step([step.Batch(latent, text, seed)]).loss for seed in range(steps)]
    out = tmp_path_factory.mktemp("flux2-lora")
    lora.save_diffusers(trainer.transformer, out)
    kohya.save(trainer.transformer, out, lora.scale(trainer.transformer))
    return out, losses


def test_a_one_image_lora_brings_the_render_closer_to_its_image(klein, trained, image_latent):
    out, losses = trained
    assert np.mean(losses[-10:]) < np.mean(losses[:10])
    pipe = _pipe(klein)
    before = float(((_render(pipe, output_type="latent") - image_latent) ** 2).mean())
    pipe.load_lora_weights(str(out), weight_name=lora.WEIGHT_NAME)
    after = float(((_render(pipe, output_type="latent") - image_latent) ** 2).mean())
    assert after < 0.8 * before, (before, after)


def test_kohya_and_diffusers_files_render_the_same_image(klein, trained):
    from diffusers import Flux2KleinPipeline
    from safetensors import safe_open

    trained, _ = trained
    with safe_open(str(trained / kohya.KOHYA_NAME), "pt") as f:
        keys = set(f.keys())
    assert "lora_unet_double_blocks_0_img_attn_qkv.alpha" in keys and "lora_unet_single_blocks_0_linear1.alpha" in keys
    assert all(k.startswith("lora_unet_") for k in keys)
    # diffusers' own FLUX.2 kohya reader takes every key (it warns about, and drops, any it cannot map).
    state = Flux2KleinPipeline.lora_state_dict(str(trained), weight_name=kohya.KOHYA_NAME)
    assert len({k.rsplit(".lora_", 1)[0] for k in state}) >= len({k.rsplit(".", 2)[0] for k in keys})
    images = {}
    for name in (lora.WEIGHT_NAME, kohya.KOHYA_NAME):
        pipe = _pipe(klein)
        base = _render(pipe, steps=2)
        pipe.load_lora_weights(str(trained), weight_name=name)
        images[name] = _render(pipe, steps=2)
        assert np.abs(images[name] - base).max() > 1e-3  # the LoRA changes the output
    np.testing.assert_allclose(images[kohya.KOHYA_NAME], images[lora.WEIGHT_NAME], atol=1e-5)


def _edit_set(root):
    """Two edit pairs from a metadata table: one with a single reference, one with two (FLUX.2 takes several)."""
    import json

    from rayflux.testing.images import draw

    root.mkdir()
    shapes = {
        "out1": ("red", "circle", "blue"),
        "out2": ("green", "square", "white"),
        "in1": ("blue", "circle", "red"),
        "in2a": ("white", "square", "green"),
        "in2b": ("red", "square", "blue"),
    }
    for name, look in shapes.items():
        draw(SIZE, SIZE, *look).save(root / f"{name}.png")
    rows = [
        {"file_name": "out1.png", "text": "swap the colours", "source": "in1.png"},
        {"file_name": "out2.png", "text": "merge them", "source": ["in2a.png", "in2b.png"]},
    ]
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.mark.parametrize("variant,fmt,edits,tokens", [("klein", "kohya", True, 16), ("dev", "diffusers", False, 0)])
def test_the_full_job_runs_and_its_lora_changes_the_pipeline(
    ray_session, demo_images, tmp_path, variant, fmt, edits, tokens, request
):
    """Cache, train, validation and export with ``model.path`` at the tiny FLUX.2 ([klein] from an edit-pair set with
    one and two references per edit, its validation an edit of two given references, its text cut to
    ``model.text_tokens=16``); the exported file loads with the family pipeline's ``load_lora_weights`` and changes
    its output."""
    import json

    from PIL import Image

    from rayflux import job
    from rayflux.cache import generations

    path = request.getfixturevalue(variant)
    out = tmp_path / "run"
    # Two steps at a rate that moves the tiny model visibly (at the default rate the dev variant's change of its
    # render sat at 1e-4, the assertion's own size).
    data = [f"data.images_dir={demo_images}", "train.optim.learning_rate=0.01"]
    renders = {}
    if edits:
        root = _edit_set(tmp_path / "edits")
        data = [
            f"data.images_dir={root}",
            "data.caption_strategy=metadata",
            "data.reference_column=source",
            f'train.validation.references=[["{root / "in2a.png"}", "{root / "in2b.png"}"]]',
            "train.optim.learning_rate=0.01",
        ]
        renders = {"image": [Image.open(root / n).convert("RGB") for n in ("in2a.png", "in2b.png")]}
    cfg = config.load(
        None,
        [
            f"model.path={path}",
            *data,
            f"run.output_dir={out}",
            "data.resolution=64",
            "train.max_steps=2",
            f"train.checkpoint.output_format={fmt}",
            f'train.validation.prompts=["{CAPTION}"]',
            "train.validation.inference_steps=2",
            "cache.batch_size=8",
            f"model.text_tokens={tokens}",
        ],
    )
    summary = job.run(cfg)
    manifest = generations.load_manifest(summary.cache_dir)
    assert [(t["name"], t["length"]) for t in manifest["layout"]["text"]] == [("prompt_embeds", tokens or 512)]
    assert all(e["latent_shape"][0] == 16 for e in manifest["buckets"].values())  # 4 VAE channels, patchified 2x2
    assert list((out / "validation").glob("step-*.png"))
    if edits:
        assert summary.cached == 2 and summary.steps == 2
    if fmt == "kohya":
        meta = _metadata(summary.lora_path)
        assert meta["ss_base_model_version"] == "flux2" and meta["modelspec.architecture"] == "flux-2-klein/lora"
        assert meta["ss_network_module"] == "networks.lora_flux_2"
        assert json.loads(meta["ss_network_dim"]) == cfg.train.adapter.rank
    pipe = _pipe(path)
    base = _render(pipe, steps=2, **renders)
    pipe.load_lora_weights(str(out / "lora"), weight_name=summary.lora_path.rsplit("/", 1)[-1])
    assert np.abs(_render(pipe, steps=2, **renders) - base).max() > 1e-4


def _metadata(path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return f.metadata()
