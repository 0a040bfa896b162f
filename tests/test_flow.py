"""Unit tests for the pure FLUX math in rayflux.train.flow."""

import math

import pytest
import torch

from rayflux.families import flux1_math
from rayflux.train import flow


def test_pack_unpack_round_trip():
    x = torch.randn(2, 16, 6, 10)
    packed = flux1_math.pack(x)
    assert packed.shape == (2, 3 * 5, 64)
    assert torch.equal(flux1_math.unpack(packed, 6, 10), x)


def test_pack_groups_each_2x2_patch_into_one_token():
    x = torch.arange(1 * 1 * 4 * 4, dtype=torch.float32).view(1, 1, 4, 4)
    packed = flux1_math.pack(x)
    # token 0 is the top-left 2x2 patch, in row-major order within the patch
    assert packed[0, 0].tolist() == [0.0, 1.0, 4.0, 5.0]
    # token 1 is the patch to its right
    assert packed[0, 1].tolist() == [2.0, 3.0, 6.0, 7.0]


def test_pack_matches_diffusers_pipeline():
    from diffusers import FluxPipeline

    x = torch.randn(2, 4, 8, 6)
    ours = flux1_math.pack(x)
    theirs = FluxPipeline._pack_latents(x, 2, 4, 8, 6)
    assert torch.equal(ours, theirs)
    assert torch.equal(flux1_math.unpack(ours, 8, 6), x)


def test_pack_rejects_odd_sizes():
    with pytest.raises(ValueError, match="even"):
        flux1_math.pack(torch.zeros(1, 4, 5, 4))


def test_image_ids_hold_row_and_column():
    ids = flux1_math.image_ids(4, 6)
    assert ids.shape == (2 * 3, 3)
    assert ids[:, 0].abs().sum() == 0
    assert ids[:, 1].tolist() == [0, 0, 0, 1, 1, 1]
    assert ids[:, 2].tolist() == [0, 1, 2, 0, 1, 2]


def test_image_ids_match_diffusers():
    from diffusers import FluxPipeline

    ours = flux1_math.image_ids(8, 6)
    theirs = FluxPipeline._prepare_latent_image_ids(1, 4, 3, "cpu", torch.float32)
    assert torch.equal(ours, theirs)


def test_text_ids_are_zero():
    t = flux1_math.text_ids(7)
    assert t.shape == (7, 3) and t.abs().sum() == 0


@pytest.mark.parametrize("method", ["uniform", "logit_normal", "sigmoid", "shift", "flux_shift"])
def test_sigmas_lie_in_open_unit_interval(method):
    g = torch.Generator().manual_seed(0)
    s = flow.sample_sigmas(4096, method, g, seq_len=1024)
    assert s.shape == (4096,)
    assert (s > 0).all() and (s < 1).all()
    assert s.std() > 0.05  # really random, not a constant


def test_sigma_sampling_is_seeded():
    a = flow.sample_sigmas(8, "logit_normal", torch.Generator().manual_seed(3))
    b = flow.sample_sigmas(8, "logit_normal", torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_logit_normal_mean_moves_the_median():
    g = torch.Generator().manual_seed(0)
    low = flow.sample_sigmas(4096, "logit_normal", g, logit_mean=-1.0).median()
    high = flow.sample_sigmas(4096, "logit_normal", g, logit_mean=1.0).median()
    assert low < 0.35 < 0.65 < high


def test_unknown_sigma_method():
    with pytest.raises(ValueError, match="unknown"):
        flow.sample_sigmas(1, "nope", torch.Generator())


def test_shift_moves_sigmas_up_and_keeps_endpoints():
    s = torch.tensor([0.0, 0.25, 0.5, 1.0])
    shifted = flow.shift_sigmas(s, 3.0)
    assert shifted[0] == 0 and shifted[-1] == 1
    assert (shifted[1:3] > s[1:3]).all()
    assert math.isclose(float(flow.shift_sigmas(torch.tensor(0.5), 3.0)), 0.75, rel_tol=1e-6)


def test_flux_mu_endpoints_and_time_shift():
    assert math.isclose(flow.flux_mu(256), 0.5)
    assert math.isclose(flow.flux_mu(4096), 1.15)
    s = torch.tensor([0.5])
    # with mu = 0 the exponential shift is the identity
    assert torch.allclose(flow.time_shift(s, 0.0), s)
    assert flow.time_shift(s, 1.15) > s


def test_flux_shift_reads_the_models_scheduler_constants(tiny_model, tmp_path):
    """The mu line's ends come from scheduler_config.json: another model's constants give other sigmas."""
    import json
    import shutil

    from rayflux import config, models

    other = tmp_path / "model"
    shutil.copytree(tiny_model, other)
    path = other / "scheduler" / "scheduler_config.json"
    sched = json.loads(path.read_text())
    sched.update(base_shift=0.2, max_shift=2.0, max_image_seq_len=2048)
    path.write_text(json.dumps(sched))
    own = models.shift_config(config.ModelConfig(path=str(tiny_model)))
    changed = models.shift_config(config.ModelConfig(path=str(other)))
    assert own == {
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "num_steps": 28,
    }
    assert math.isclose(flow.flux_mu(2048, changed), 2.0) and math.isclose(flow.flux_mu(256, changed), 0.2)
    draw = [
        flow.sample_sigmas(64, "flux_shift", torch.Generator().manual_seed(1), seq_len=1024, shift_config=c)
        for c in (own, changed)
    ]
    assert (draw[1] > draw[0]).all()  # a larger mu at 1024 tokens pushes every sigma up


def test_noisy_input_and_target():
    x, n = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    s = torch.tensor([0.0, 0.5, 1.0])
    noisy = flow.noisy_input(x, n, s)
    assert torch.allclose(noisy[0], x[0]) and torch.allclose(noisy[2], n[2])
    assert torch.allclose(noisy[1], 0.5 * x[1] + 0.5 * n[1])
    assert torch.allclose(flow.flow_target(x, n), n - x)
    # the straight path: x_σ = x + σ (ε - x)
    assert torch.allclose(noisy, x + s.view(-1, 1, 1, 1) * flow.flow_target(x, n))


def test_loss_weights():
    s = torch.tensor([0.25, 0.5])
    assert torch.equal(flow.loss_weights(s, "none"), torch.ones(2))
    assert torch.allclose(flow.loss_weights(s, "sigma_sqrt"), torch.tensor([16.0, 4.0]))
    cos = flow.loss_weights(s, "cosmap")
    assert math.isclose(float(cos[1]), 2 / (math.pi * 0.5), rel_tol=1e-6)
    with pytest.raises(ValueError):
        flow.loss_weights(s, "bogus")


def test_flow_loss_is_weighted_per_sample_mean():
    pred = torch.zeros(2, 3, 4)
    target = torch.ones(2, 3, 4)
    target[1] *= 2
    w = torch.tensor([1.0, 0.5])
    # sample 0: mean 1, sample 1: mean 4 weighted 0.5 -> 2; batch mean 1.5
    assert math.isclose(float(flow.flow_loss(pred, target, w)), 1.5)


@pytest.mark.parametrize("method", ["uniform", "logit_normal", "sigmoid", "shift", "flux_shift"])
def test_eval_sigmas_are_the_training_densitys_quantiles(method):
    """The eval grid sits where training draws σ: grid point i is the (i + 0.5)/n quantile of sample_sigmas."""
    kw = {"logit_mean": 0.5, "logit_std": 1.2, "shift": 3.0, "seq_len": 1024}
    grid = flow.eval_sigmas(5, method, **kw)
    drawn = flow.sample_sigmas(200_000, method, torch.Generator().manual_seed(0), **kw)
    q = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9])
    assert grid.shape == (5,) and bool((grid[1:] > grid[:-1]).all())
    torch.testing.assert_close(grid, torch.quantile(drawn[:100_000], q), atol=0.01, rtol=0)
    assert torch.equal(grid, flow.eval_sigmas(5, method, **kw))  # fixed: no generator at all
