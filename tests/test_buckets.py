"""The one bucket function: aligned outputs for any size and knob, and the latent shape the real VAE produces."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayflux import buckets, config, models
from rayflux.cache.keys import bucket_spec

specs = st.builds(
    buckets.BucketSpec,
    resolution=st.integers(32, 1536),
    resolution_type=st.sampled_from(["area", "shorter_edge"]),
    alignment=st.sampled_from([16, 32, 64]),
    crop=st.sampled_from(["center", "random"]),
    max_aspect=st.floats(1.0, 4.0),
    min_image_size=st.just(1),
    vae_scale_factor=st.just(8),
    latent_channels=st.sampled_from([4, 16]),
)
sides = st.integers(1, 6000)


@settings(max_examples=400, deadline=None)
@given(spec=specs, width=sides, height=sides, seed=st.integers(0, 2**31), salt=st.text(max_size=12))
def test_plans_are_aligned_inside_the_image_and_agree_with_their_key(spec, width, height, seed, salt):
    p = buckets.plan(width, height, spec, seed=seed, salt=salt)
    tw, th = p.target_width, p.target_height
    assert tw % spec.alignment == 0 and th % spec.alignment == 0 and tw > 0 and th > 0
    assert max(tw, th) <= spec.max_aspect * min(tw, th) + 1e-9  # the rounded bucket keeps the aspect limit too
    assert 0 <= p.crop_left and p.crop_left + p.crop_width <= width
    assert 0 <= p.crop_top and p.crop_top + p.crop_height <= height
    assert p.crop_width >= 1 and p.crop_height >= 1
    # The crop has the target's aspect ratio, up to one pixel of rounding on its shorter side.
    assert abs(p.crop_width * th - p.crop_height * tw) <= max(tw, th)
    # The largest such box: it spans the whole image in at least one direction.
    assert p.crop_width == width or p.crop_height == height
    assert p.latent_shape == (spec.latent_channels, th // 8, tw // 8)
    assert buckets.parse_key(p.key) == (tw, th)
    assert buckets.latent_shape_of(p.key, spec.latent_channels, spec.vae_scale_factor) == p.latent_shape
    assert buckets.plan(width, height, spec, seed=seed, salt=salt) == p  # deterministic on any worker


@settings(max_examples=300, deadline=None)
@given(spec=specs, width=sides, height=sides)
def test_resolution_knobs_mean_what_they_say(spec, width, height):
    """Each target side is the ideal side for the knobs, rounded to the nearest multiple of the alignment; only the
    longer side may be a whole step shorter still, where rounding both would break ``max_aspect``."""
    p = buckets.plan(width, height, spec)
    aspect = min(max(width / height, 1 / spec.max_aspect), spec.max_aspect)
    r = spec.resolution
    if spec.resolution_type == "shorter_edge":
        ideal_w, ideal_h = (r * aspect, r) if aspect >= 1 else (r, r / aspect)
    else:
        ideal_w, ideal_h = (r * r * aspect) ** 0.5, (r * r / aspect) ** 0.5
    for side, ideal, other in ((p.target_width, ideal_w, p.target_height), (p.target_height, ideal_h, p.target_width)):
        near = abs(side - ideal) <= spec.alignment / 2 + 1e-9 or side == spec.alignment  # never below one step
        shortened = side < ideal and side + spec.alignment > spec.max_aspect * other  # one step more breaks the limit
        assert near or shortened


def test_small_images_and_impossible_knobs_are_refused():
    spec = buckets.BucketSpec(resolution=512, min_image_size=64)
    with pytest.raises(buckets.ImageTooSmall, match="63x400"):
        buckets.plan(63, 400, spec)
    for bad in (dict(alignment=24), dict(alignment=8), dict(crop="top"), dict(resolution_type="long_edge")):
        with pytest.raises(ValueError):
            buckets.plan(512, 512, dataclasses.replace(spec, **bad))
    with pytest.raises(ValueError, match="not a bucket key"):
        buckets.parse_key("512-384")


def test_max_aspect_holds_after_rounding():
    """1200x200 at max_aspect 2.5 once got a 208x80 bucket (2.6): rounding both sides overshot the limit."""
    spec = buckets.BucketSpec(resolution=128, alignment=16, max_aspect=2.5, min_image_size=1)
    for size in ((1200, 200), (200, 1200)):
        p = buckets.plan(*size, spec)
        assert max(p.target_width, p.target_height) / min(p.target_width, p.target_height) <= 2.5, p.key
        assert p.key in ("192x80", "80x192")


def test_bucket_step_makes_fewer_buckets():
    """kohya's 64-px step against the model's 16 px: 2,000 random aspects at 1024 px fall into far fewer buckets."""
    import random

    rng = random.Random(0)
    sizes = [(rng.randint(400, 4000), rng.randint(400, 4000)) for _ in range(2000)]
    count = {}
    for step in (16, 64):
        spec = buckets.BucketSpec(resolution=1024, alignment=buckets.effective_step(step, 1024, 16), min_image_size=1)
        count[step] = len({buckets.plan(w, h, spec).key for w, h in sizes})
    assert count[64] * 3 < count[16]


def test_alignment_comes_from_bucket_step_and_the_model_unless_set(tiny_model):
    facts = models.model_facts(config.ModelConfig(path=str(tiny_model)))
    assert facts.vae_scale_factor == 8 and facts.alignment == 16
    assert bucket_spec(config.load(None, []), facts).alignment == 64  # data.bucket_step's default at 512 px
    assert bucket_spec(config.load(None, ["data.resolution=64"]), facts).alignment == 16  # capped at resolution / 8
    assert bucket_spec(config.load(None, ["data.bucket_step=40"]), facts).alignment == 32  # the model's multiple
    assert bucket_spec(config.load(None, ["data.alignment=128"]), facts).alignment == 128
    with pytest.raises(config.ConfigError, match="data.alignment"):
        bucket_spec(config.load(None, ["data.alignment=24"]), facts)


@pytest.fixture(scope="module")
def tiny_vae(tiny_model):
    return models.load_vae(config.ModelConfig(path=str(tiny_model)), "cpu", models.torch_dtype("float32", "cpu"))


@settings(max_examples=25, deadline=None)
@given(
    width=st.integers(64, 900),
    height=st.integers(64, 900),
    resolution=st.integers(64, 176),
    resolution_type=st.sampled_from(["area", "shorter_edge"]),
    alignment=st.sampled_from([16, 32]),
)
def test_the_real_vae_produces_the_predicted_latent_shape(
    tiny_vae, width, height, resolution, resolution_type, alignment
):
    import torch

    channels = tiny_vae.config.latent_channels
    spec = buckets.BucketSpec(
        resolution=resolution, resolution_type=resolution_type, alignment=alignment, latent_channels=channels
    )
    p = buckets.plan(width, height, spec)
    with torch.inference_mode():
        z = tiny_vae.encode(torch.zeros(1, 3, p.target_height, p.target_width)).latent_dist.mean
    assert tuple(z.shape[1:]) == p.latent_shape
