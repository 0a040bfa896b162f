"""rayflux's FLUX.2 and Kontext math equals, bitwise in fp32, what the families' own diffusers pipelines build with
their helpers: patchify, batch-norm normalisation, pack/unpack, latent/text/reference ids and reference-image
tokens, and the transformer's inputs for an edit."""

from __future__ import annotations

import pytest
import torch
from diffusers import Flux2KleinPipeline, Flux2Pipeline, FluxKontextPipeline

from rayflux.families import flux2_math as f2
from rayflux.families import kontext_math as kx
from rayflux.families.references import target_prediction, with_references
from rayflux.families import flux1_math

TEXT_LEN = 48


@pytest.fixture(scope="module")
def klein(tiny_flux2_klein):
    return Flux2KleinPipeline.from_pretrained(tiny_flux2_klein)


@pytest.fixture(scope="module")
def dev(tiny_flux2_dev):
    return Flux2Pipeline.from_pretrained(tiny_flux2_dev)


@pytest.fixture(scope="module")
def kontext(tiny_kontext):
    return FluxKontextPipeline.from_pretrained(tiny_kontext)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _encode(pipe, pixels: torch.Tensor) -> torch.Tensor:
    """rayflux's FLUX.2 latent of ``pixels``: the VAE's mode, patchified and normalised."""
    with torch.no_grad():
        return f2.normalize_latent(pipe.vae.encode(pixels).latent_dist.mode(), *f2.vae_bn_stats(pipe.vae))


def _images(n: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    """``n`` images in [-1, 1], as the pipelines' image processors hand them to the VAE."""
    return torch.rand(n, 3, height, width, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_patchify_and_pack_match_the_pipeline():
    x = _randn(2, 4, 6, 10)
    patches = f2.patchify(x)
    assert torch.equal(patches, Flux2Pipeline._patchify_latents(x))
    assert patches.shape == (2, 16, 3, 5)
    assert torch.equal(f2.unpatchify(patches), Flux2Pipeline._unpatchify_latents(patches))
    assert torch.equal(f2.unpatchify(patches), x)
    tokens = f2.pack(patches)
    assert torch.equal(tokens, Flux2Pipeline._pack_latents(patches))
    ids = f2.latent_ids(3, 5)
    unpacked = Flux2KleinPipeline._unpack_latents_with_ids(tokens, ids[None].expand(2, -1, -1))
    assert torch.equal(f2.unpack(tokens, 3, 5), unpacked)
    with pytest.raises(ValueError, match="even"):
        f2.patchify(_randn(1, 4, 5, 6))
    with pytest.raises(ValueError, match="cannot form"):
        f2.unpack(tokens, 4, 5)


def test_ids_match_the_pipeline():
    latents = _randn(3, 16, 4, 7)
    assert torch.equal(f2.latent_ids(4, 7).expand(3, -1, -1), Flux2Pipeline._prepare_latent_ids(latents))
    prompt = _randn(2, TEXT_LEN, 12)
    assert torch.equal(f2.text_ids(TEXT_LEN).expand(2, -1, -1), Flux2Pipeline._prepare_text_ids(prompt))
    refs = [_randn(1, 16, 3, 5, seed=1), _randn(1, 16, 4, 2, seed=2), _randn(1, 16, 2, 2, seed=3)]
    ours = f2.reference_ids([r.shape[-2:] for r in refs])
    assert torch.equal(ours[None], Flux2Pipeline._prepare_image_ids(refs))
    # Each reference sits on its own t, none on the target's.
    assert ours[:, 0].unique().tolist() == [10, 20, 30]


def test_bn_normalisation_matches_the_pipeline_vae_encode(klein):
    vae = klein.vae
    mean, var, eps = f2.vae_bn_stats(vae)
    assert mean.abs().sum() > 0, "the tiny VAE's statistics must not make normalisation an identity"
    image = _images(2, 64, 48)
    with torch.no_grad():
        expected = klein._encode_vae_image(image, generator=None)
        raw = vae.encode(image).latent_dist.mode()
    ours = f2.bn_normalize(f2.patchify(raw), mean, var, eps)
    assert ours.shape == (2, 16, 4, 3)
    assert torch.equal(ours, expected)
    assert torch.equal(f2.normalize_latent(raw, mean, var, eps), ours)
    assert torch.allclose(f2.denormalize_latent(ours, mean, var, eps), raw, atol=1e-5)


def test_reference_tokens_match_the_pipeline(dev):
    images = [_images(1, 64, 64, seed=4), _images(1, 32, 48, seed=5)]
    with torch.no_grad():
        expected_tokens, expected_ids = dev.prepare_image_latents(
            images, batch_size=2, generator=None, device=torch.device("cpu"), dtype=torch.float32
        )
    latents = [_encode(dev, x) for x in images]
    tokens = f2.reference_tokens([x.expand(2, -1, -1, -1) for x in latents])
    assert tokens.shape == (2, 4 * 4 + 2 * 3, 16)
    assert torch.equal(tokens, expected_tokens)
    assert torch.equal(f2.reference_ids([x.shape[-2:] for x in latents]).expand(2, -1, -1), expected_ids)


def _capture_transformer_inputs(pipe):
    seen = []
    handle = pipe.transformer.register_forward_pre_hook(lambda _m, _a, kw: seen.append(kw), with_kwargs=True)
    return seen, handle


def _klein_edit_inputs(klein, refs, noise) -> list[dict]:
    """The keyword inputs of every transformer call of a one-step 64x64 edit of ``refs`` from ``noise``."""
    seen, handle = _capture_transformer_inputs(klein)
    try:
        klein(
            prompt="make it red",
            image=refs,
            latents=noise,
            height=64,
            width=64,
            num_inference_steps=1,
            guidance_scale=1.0,
            max_sequence_length=TEXT_LEN,
            output_type="latent",
        )
    finally:
        handle.remove()
    return seen


def test_klein_edit_inputs_match_the_pipeline(klein):
    """The whole image stream of an edit: noisy target tokens, then two references at their own t."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(6)
    refs = [Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)) for h, w in ((64, 64), (80, 64))]
    noise = _randn(1, 16, 4, 4, seed=8)
    seen = _klein_edit_inputs(klein, refs, noise)
    # The same pixels the pipeline hands its VAE (its own resize/crop/normalise), then rayflux's math.
    pixels = [klein.image_processor.preprocess(r, height=r.height, width=r.width, resize_mode="crop") for r in refs]
    latents = [_encode(klein, x) for x in pixels]
    refs_tokens, refs_ids = f2.reference_tokens(latents), f2.reference_ids([x.shape[-2:] for x in latents])
    hidden, ids = with_references(f2.pack(noise), f2.latent_ids(4, 4), refs_tokens, refs_ids)
    call = seen[0]
    assert torch.equal(hidden, call["hidden_states"])
    assert torch.equal(ids[None], call["img_ids"])
    assert call["guidance"] is None
    assert torch.equal(target_prediction(hidden, 16), f2.pack(noise))


def test_kontext_reference_tokens_match_the_pipeline(kontext):
    image = _images(1, 64, 48, seed=9)
    noise = flux1_math.pack(_randn(1, 4, 8, 8, seed=10))
    with torch.no_grad():
        _, expected_tokens, expected_latent_ids, expected_ids = kontext.prepare_latents(
            image, 1, 4, 64, 64, torch.float32, torch.device("cpu"), None, noise
        )
        vae = kontext.vae
        ref = (vae.encode(image).latent_dist.mode() - vae.config.shift_factor) * vae.config.scaling_factor
    assert torch.equal(kx.reference_tokens(ref), expected_tokens)
    assert torch.equal(kx.reference_ids(8, 6), expected_ids)
    hidden, ids = with_references(noise, flux1_math.image_ids(8, 8), kx.reference_tokens(ref), kx.reference_ids(8, 6))
    assert torch.equal(ids, torch.cat([expected_latent_ids, expected_ids]))
    assert hidden.shape == (1, 16 + 12, 16) and torch.equal(target_prediction(hidden, 16), noise)


def test_with_references_refuses_mismatched_inputs():
    tokens, ids = _randn(2, 4, 8), f2.latent_ids(2, 2)
    with pytest.raises(ValueError, match="do not match"):
        with_references(tokens, ids, _randn(1, 3, 8), f2.reference_ids([(1, 3)]))
    with pytest.raises(ValueError, match="3 reference tokens but 4"):
        with_references(tokens, ids, _randn(2, 3, 8), f2.reference_ids([(2, 2)]))


def test_cached_references_give_the_pipelines_tokens_and_ids():
    refs = _randn(2, 3, 16, 2, 3, seed=11)  # a batch of 2 edits, 3 references each, as the cache stores them
    tokens, ids = f2.cached_references(refs)
    per_ref = [refs[:, i] for i in range(3)]
    assert torch.equal(tokens, torch.cat([Flux2Pipeline._pack_latents(r) for r in per_ref], dim=1))
    assert torch.equal(ids[None], Flux2Pipeline._prepare_image_ids([r[:1] for r in per_ref]))
    one = _randn(2, 1, 4, 8, 6, seed=12)
    k_tokens, k_ids = kx.cached_references(one)
    assert torch.equal(k_tokens, FluxKontextPipeline._pack_latents(one[:, 0], 2, 4, 8, 6))
    expected_ids = FluxKontextPipeline._prepare_latent_image_ids(2, 4, 3, torch.device("cpu"), torch.float32)
    expected_ids[..., 0] = 1  # as FluxKontextPipeline.prepare_latents marks its image ids
    assert torch.equal(k_ids, expected_ids)
    with pytest.raises(ValueError, match="one reference image per edit, got 3"):
        kx.cached_references(_randn(1, 3, 4, 8, 6))


def _pil(seed: int, height: int = 64, width: int = 64):
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8))


def test_flux2_forward_args_with_references_are_the_pipelines_transformer_inputs(klein):
    """The training step's transformer inputs for a cached edit pair (two references, cut to the target's size, as
    the cache stores them) equal what Flux2KleinPipeline(image=...) passes its transformer for the same latents."""
    from rayflux.families import for_class

    refs = [_pil(20), _pil(21)]
    noise = _randn(1, 16, 4, 4, seed=22)
    seen = _klein_edit_inputs(klein, refs, noise)
    call = seen[0]
    pixels = [klein.image_processor.preprocess(r, height=64, width=64, resize_mode="crop") for r in refs]
    cached = torch.stack([_encode(klein, x)[0] for x in pixels])[None]  # [B, k, C, h, w], the cache's ref_latent
    text = {"prompt_embeds": call["encoder_hidden_states"]}
    args = for_class("Flux2KleinPipeline").forward_args(
        f2.pack(noise), text, call["timestep"], 4, 4, None, references=cached
    )
    for key in ("hidden_states", "img_ids", "txt_ids", "encoder_hidden_states", "timestep"):
        assert torch.equal(args[key], call[key]), key
    assert args["hidden_states"].shape[1] == 16 * 3 and args["guidance"] is None


def test_kontext_forward_args_with_a_reference_are_the_pipelines_transformer_inputs(kontext):
    """The same for FLUX.1 Kontext: the reference's tokens after the target's, with their own ids (first axis 1), as
    FluxKontextPipeline(image=..., _auto_resize=False, max_area=H*W) builds them at the render's own size."""
    from rayflux.families import for_class

    family = for_class("FluxKontextPipeline")
    image = _pil(23)
    noise = flux1_math.pack(_randn(1, 4, 8, 8, seed=24))
    seen, handle = _capture_transformer_inputs(kontext)
    try:
        kontext(
            prompt="make it red",
            latents=noise,
            num_inference_steps=1,
            max_sequence_length=TEXT_LEN,
            output_type="latent",
            **family.reference_kwargs([image], 64, 64),
            height=64,
            width=64,
        )
    finally:
        handle.remove()
    call = seen[0]
    pixels = kontext.image_processor.preprocess(kontext.image_processor.resize(image, 64, 64), 64, 64)
    with torch.no_grad():
        cached = family.stored_latent(kontext.vae, kontext.vae.encode(pixels).latent_dist.mode())[:, None]
    text = {"t5": call["encoder_hidden_states"], "clip_pooled": call["pooled_projections"]}
    args = family.forward_args(noise, text, call["timestep"], 8, 8, call["guidance"], references=cached)
    for key in (
        "hidden_states",
        "img_ids",
        "txt_ids",
        "encoder_hidden_states",
        "pooled_projections",
        "timestep",
        "guidance",
    ):
        assert torch.equal(args[key], call[key]), key
    assert args["hidden_states"].shape[1] == 16 + 16 and args["img_ids"][16:, 0].unique().tolist() == [1.0]
    with pytest.raises(ValueError, match="one reference image per edit, got 2"):
        family.forward_args(noise, text, call["timestep"], 8, 8, None, references=cached.expand(-1, 2, -1, -1, -1))
    with pytest.raises(ValueError, match="edits one reference image, got 2"):
        family.reference_kwargs([image, image], 64, 64)
    with pytest.raises(ValueError, match="takes no reference images"):
        for_class("FluxPipeline").reference_kwargs([image], 64, 64)
