"""The σ schedule's presets and per-family shifts (issue 45, item 3): ``train.timestep_bias`` and ``flux2_shift``."""

import math

import pytest
import torch

from rayflux import config, families, models
from rayflux.train import flow, timesteps

METHODS = ["uniform", "logit_normal", "sigmoid", "shift", "flux_shift", "flux2_shift"]


@pytest.mark.parametrize("seq_len", [64, 256, 1024, 4096, 4300, 4301, 16384])
@pytest.mark.parametrize("steps", [1, 4, 28, 50, 200])
def test_flux2_mu_is_the_pipelines_empirical_mu(seq_len, steps):
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu as klein_mu

    ours = flow.flux2_mu(seq_len, steps)
    assert ours == compute_empirical_mu(seq_len, steps) == klein_mu(seq_len, steps)


def test_flux2_shift_uses_the_models_steps():
    """Fewer denoising steps mean a larger μ below 4300 tokens (FLUX.2's fit), so every σ moves up."""
    draw = [
        flow.sample_sigmas(256, "flux2_shift", torch.Generator().manual_seed(0), seq_len=1024, shift_config=c)
        for c in ({"num_steps": 50}, {"num_steps": 4}, {})
    ]
    assert (draw[1] > draw[0]).all()
    assert torch.equal(draw[2], draw[0])  # unknown steps: the pipeline's default 50
    u = flow.sample_sigmas(256, "logit_normal", torch.Generator().manual_seed(0))
    torch.testing.assert_close(draw[0], flow.time_shift(u, flow.flux2_mu(1024, 50)))


@pytest.mark.parametrize("method", METHODS)
def test_timestep_bias_moves_the_draws_as_documented(method):
    """content: every draw's logit moves by -1 (lower noise), style by +1; balanced is the draw itself, bit for bit."""
    kw = {"seq_len": 1024, "shift_config": {"num_steps": 28}}

    def draw(preset):
        g = torch.Generator().manual_seed(5)
        return flow.sample_sigmas(4096, method, g, bias=flow.TIMESTEP_BIAS[preset], **kw)

    plain = flow.sample_sigmas(4096, method, torch.Generator().manual_seed(5), **kw)
    balanced, content, style = draw("balanced"), draw("content"), draw("style")
    assert torch.equal(balanced, plain)
    inner = (plain > 1e-3) & (plain < 1 - 1e-3)  # away from the clamp at the ends
    for moved, offset in ((content, -1.0), (style, 1.0)):
        torch.testing.assert_close(torch.logit(moved[inner]), torch.logit(plain[inner]) + offset, atol=1e-3, rtol=0)
    assert content.mean() < plain.mean() - 0.05 and style.mean() > plain.mean() + 0.05


def test_content_and_style_are_a_logit_normal_mean_shift():
    """With logit_normal the preset is exactly logit_mean moved by -1/+1: the same σ from the same seed."""
    for preset, mean in (("content", -1.0), ("style", 1.0)):
        a = flow.sample_sigmas(512, "logit_normal", torch.Generator().manual_seed(2), bias=flow.TIMESTEP_BIAS[preset])
        b = flow.sample_sigmas(512, "logit_normal", torch.Generator().manual_seed(2), logit_mean=mean)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    median = flow.sample_sigmas(20_000, "logit_normal", torch.Generator().manual_seed(2), bias=-1.0).median()
    assert math.isclose(float(median), 1 / (1 + math.e), abs_tol=0.01)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bias", [-1.0, 1.0])
def test_biased_eval_grid_is_the_biased_training_densitys_quantiles(method, bias):
    kw = {"seq_len": 1024, "shift_config": {"num_steps": 4}, "bias": bias}
    grid = flow.eval_sigmas(5, method, **kw)
    drawn = flow.sample_sigmas(100_000, method, torch.Generator().manual_seed(0), **kw)
    q = torch.tensor([0.1, 0.3, 0.5, 0.7, 0.9])
    torch.testing.assert_close(grid, torch.quantile(drawn, q), atol=0.01, rtol=0)


def test_auto_is_each_familys_own_schedule():
    flux1, flux2, kontext = (families.by_name(n) for n in ("flux1", "flux2", "kontext"))
    assert [timesteps.method("auto", f) for f in (flux1, flux2, kontext)] == ["flux_shift", "flux2_shift", "flux_shift"]
    assert timesteps.method("uniform", flux2) == "uniform"
    t = config.load(None, ["train.flow.sigma_sampling=auto", "train.timestep_bias=style"]).train  # old key: alias
    assert t.flow.timestep_bias == "style"
    opts = timesteps.options(t, flux2, 32, 32, {"num_steps": 4})
    assert opts["method"] == "flux2_shift" and opts["bias"] == 1.0 and opts["seq_len"] == 1024


def test_flux2_shift_config_names_the_pipelines_steps(tiny_flux2_klein, tiny_flux2_klein_distilled, tiny_flux2_dev):
    steps = [
        models.shift_config(config.ModelConfig(path=str(p)))["num_steps"]
        for p in (tiny_flux2_klein, tiny_flux2_klein_distilled, tiny_flux2_dev)
    ]
    assert steps == [50, 4, 50]


def test_unknown_timestep_bias_is_refused():
    with pytest.raises(config.ConfigError, match="timestep_bias"):
        config.load(None, ["train.timestep_bias=likeness"])
