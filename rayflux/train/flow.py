"""FLUX flow-matching math as small pure functions (no state, no I/O), each unit-tested.

Conventions follow diffusers' ``FluxPipeline`` and the published FLUX training recipes:
``noisy = (1 - σ) x + σ ε``, the model predicts ``ε - x``, and it is called with ``timestep = σ`` (it multiplies
by 1000 internally).
"""

from __future__ import annotations

import math

import torch


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Fixed timestep shift ``σ' = sσ / (1 + (s - 1)σ)``; s > 1 moves weight towards noisier σ."""
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flux_mu(seq_len: int, shift_config: dict | None = None) -> float:
    """FLUX's resolution-dependent shift exponent, linear in the token count (diffusers' ``calculate_shift``), with
    the line's ends from the model's ``scheduler_config.json`` (diffusers' own defaults when not given).
    ``shift_config``: :func:`rayflux.models.shift_config`'s fields (:data:`rayflux.models.facts.SHIFT_KEYS`)."""
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    c = shift_config or {}
    ends = {"base_image_seq_len": "base_seq_len", "max_image_seq_len": "max_seq_len"}
    # num_steps is FLUX.2's (flux2_mu); the line's ends are all that calculate_shift takes.
    return calculate_shift(seq_len, **{ends.get(k, k): v for k, v in c.items() if k != "num_steps"})


def time_shift(sigmas: torch.Tensor, mu: float) -> torch.Tensor:
    """``σ' = e^μ / (e^μ + (1/σ - 1))``, the exponential shift FLUX.1 uses at inference."""
    return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))


TIMESTEP_BIAS = {"balanced": 0.0, "content": -1.0, "style": 1.0}
"""``train.timestep_bias`` presets: an offset added to ``logit(σ)`` after the ``sigma_sampling`` draw
(:func:`logit_offset`). ``content`` (-1) moves the draws to lower noise, where fine detail and likeness are learned;
``style`` (+1) to higher noise, where composition and colour are decided. For ``logit_normal`` it is exactly a shift
of the normal's mean by the offset (its median σ moves from 0.5 to 0.27 or 0.73)."""


def logit_offset(sigmas: torch.Tensor, offset: float) -> torch.Tensor:
    """``σ' = sigmoid(logit(σ) + offset)``: multiplies the odds ``σ / (1 - σ)`` by ``e^offset`` (the same family of
    maps as :func:`shift_sigmas` with ``s = e^offset``, and :func:`time_shift` with ``μ = offset``). 0 returns ``σ``
    itself, bit for bit."""
    if offset == 0:
        return sigmas
    return torch.sigmoid(torch.logit(sigmas) + offset)


def flux2_mu(seq_len: int, num_steps: int) -> float:
    """FLUX.2's resolution- and step-dependent shift exponent (its pipelines' ``compute_empirical_mu``, fitted by
    Black Forest Labs): two lines in the token count, at 10 and at 200 denoising steps, interpolated linearly in the
    step count; above 4300 tokens the 200-step line alone."""
    line_10 = 8.73809524e-05 * seq_len + 1.89833333
    line_200 = 0.00016927 * seq_len + 0.45666666
    if seq_len > 4300:
        return float(line_200)
    slope = (line_200 - line_10) / 190.0
    intercept = line_200 - 200.0 * slope  # formed first, as the pipelines do: the same float, bit for bit
    return float(slope * num_steps + intercept)


FLUX2_STEPS = 50
"""Denoising steps ``flux2_shift`` assumes when the model's own are not known (``Flux2Pipeline``'s default)."""


def _shift_mu(method: str, seq_len: int, shift_config: dict | None) -> float:
    """μ of the resolution-aware shifts: FLUX.1's line (``flux_shift``) or FLUX.2's fit (``flux2_shift``)."""
    if method == "flux2_shift":
        return flux2_mu(seq_len, int((shift_config or {}).get("num_steps", FLUX2_STEPS)))
    return flux_mu(seq_len, shift_config)


def sample_sigmas(
    n: int,
    method: str,
    generator: torch.Generator,
    *,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    shift: float = 3.0,
    seq_len: int = 256,
    shift_config: dict | None = None,
    bias: float = 0.0,
) -> torch.Tensor:
    """Draw ``n`` noise levels σ in (0, 1) by one of the published schemes (densities from diffusers'
    ``compute_density_for_timestep_sampling``), then move them by ``bias`` (:data:`TIMESTEP_BIAS`,
    :func:`logit_offset`). ``flux2_shift`` reads the model's denoising steps from ``shift_config["num_steps"]``."""
    from diffusers.training_utils import compute_density_for_timestep_sampling as density

    if method == "uniform":
        s = density("uniform", n, generator=generator)
    elif method == "logit_normal":
        s = density("logit_normal", n, logit_mean=logit_mean, logit_std=logit_std, generator=generator)
    elif method == "sigmoid":
        s = density("logit_normal", n, logit_mean=0.0, logit_std=logit_std, generator=generator)
    elif method == "shift":
        s = shift_sigmas(density("logit_normal", n, logit_mean=0.0, logit_std=1.0, generator=generator), shift)
    elif method in ("flux_shift", "flux2_shift"):
        u = density("logit_normal", n, logit_mean=0.0, logit_std=1.0, generator=generator)
        s = time_shift(u, _shift_mu(method, seq_len, shift_config))
    else:
        raise ValueError(f"unknown sigma sampling {method!r}")
    # Keep σ strictly inside (0, 1): σ = 0 has no noise to learn and σ = 1 breaks the 1/σ shift above.
    return logit_offset(s.clamp(1e-5, 1 - 1e-5), bias).clamp(1e-5, 1 - 1e-5)


def noisy_input(latents: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """``(1 - σ) x + σ ε`` with σ broadcast over every non-batch dimension."""
    s = sigmas.view(-1, *([1] * (latents.dim() - 1))).to(latents.dtype)
    return (1 - s) * latents + s * noise


def flow_target(latents: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity the model learns to predict: ``ε - x``."""
    return noise - latents


def loss_weights(sigmas: torch.Tensor, scheme: str) -> torch.Tensor:
    """Per-sample loss weights: ``none`` (1), ``sigma_sqrt`` (σ⁻²) or ``cosmap`` (2 / (π(1 - 2σ + 2σ²))), as
    diffusers' ``compute_loss_weighting_for_sd3`` computes them."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    if scheme not in ("none", "sigma_sqrt", "cosmap"):
        raise ValueError(f"unknown loss weighting {scheme!r}")
    return compute_loss_weighting_for_sd3(scheme, sigmas)


def mask_weights(mask: torch.Tensor, floor: float | torch.Tensor) -> torch.Tensor:
    """Per-token loss weights ``floor + (1 - floor) m`` from a packed mask ``m`` in [0, 1] (``data.mask_floor``).

    Computed as ``1 - (1 - floor)(1 - m)``, the same value, so that ``m = 1`` gives exactly 1.0 for every floor and
    a mask of all ones weighs every token exactly as no mask does (see :func:`flow_loss`). ``floor``: one for all,
    or one per sample ``[B]`` (each sample's dataset's)."""
    if isinstance(floor, torch.Tensor):
        keep = (1.0 - floor.float().to(mask.device)).view(-1, *([1] * (mask.dim() - 1)))
        return 1.0 - keep * (1.0 - mask.float())
    return 1.0 - (1.0 - float(floor)) * (1.0 - mask.float())


def flow_loss(
    pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor, token_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Batch mean of ``w_b L_b``: ``weights`` ``[B]`` are the per-sample weights (σ weighting, dataset weights).

    ``pred`` and ``target`` are the target's packed tokens ``[B, N, D]`` (an edit's reference tokens already cut off).
    Without ``token_weights``, ``L_b`` is the mean of ``(pred - target)²`` over the sample's tokens and channels. With
    per-token weights ``t`` ``[B, N]`` (:func:`mask_weights` of a packed mask), it is the mask-weighted mean over
    tokens, ``L_b = Σ_n t_n e_n / Σ_n t_n`` with ``e_n`` the token's mean squared error over its channels.

    The weighted mean is computed as ``mean(t ⊙ (pred - target)²) / mean(t)``: the unweighted expression with two
    extra operations that are exact when ``t`` is all ones (a product by 1.0 and a division by ``N / N = 1.0``), so a
    mask of all ones gives bitwise the loss and gradients of no mask. ``mean(t)`` is a tensor divided by a tensor,
    never by a Python scalar, which CUDA would turn into a product by an inexact reciprocal."""
    return (weights.float() * per_sample_loss(pred, target, token_weights)).mean()


def per_sample_loss(
    pred: torch.Tensor, target: torch.Tensor, token_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """``L_b`` of :func:`flow_loss` for each sample ``[B]``: what the training loss weights and averages, and what the
    eval loss averages unweighted."""
    sq = (pred.float() - target.float()) ** 2
    if token_weights is None:
        return sq.flatten(1).mean(dim=1)
    t = token_weights.to(sq.device, torch.float32)
    if t.shape != sq.shape[:2]:
        raise ValueError(f"token weights {tuple(t.shape)} do not match the {tuple(sq.shape[:2])} tokens")
    mean_t = t.sum(dim=1) / torch.full_like(t[:, 0], t.shape[1])
    # A sample whose weights are all 0 (floor 0, a mask black on every token) adds 0, not NaN; preparation skips
    # such masks, so this only guards.
    mean_t = mean_t.clamp_min(torch.finfo(torch.float32).tiny)
    return (sq * t.unsqueeze(-1)).flatten(1).mean(dim=1) / mean_t


def sample_guidance(n: int, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    """Per-sample guidance: the constant ``low``, or uniform in ``[low, high]`` when ``high > low``.

    A constant draws nothing from ``generator``, so turning a range off leaves every later draw unchanged.
    """
    if high <= low:
        return torch.full((n,), float(low))
    return low + (high - low) * torch.rand(n, generator=generator)


def caption_dropout_mask(n: int, p: float, generator: torch.Generator) -> torch.Tensor:
    """Which of ``n`` samples train on the empty caption (each independently with probability ``p``)."""
    if p <= 0:
        return torch.zeros(n, dtype=torch.bool)
    return torch.rand(n, generator=generator) < p


def drop_text(text: dict, mask, empty: dict) -> dict:
    """Swap the named text tensors (``[B, ...]``) of the masked samples for the empty caption's (``[...]``)."""
    if not bool(mask.any()):
        return text
    out = {}
    for name, x in text.items():
        m = mask.to(x.device).view(-1, *([1] * (x.dim() - 1)))
        out[name] = torch.where(m, empty[name].to(x.device, x.dtype).expand_as(x), x)
    return out


def eval_sigmas(
    n: int,
    method: str,
    *,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    shift: float = 3.0,
    seq_len: int = 256,
    shift_config: dict | None = None,
    bias: float = 0.0,
) -> torch.Tensor:
    """A fixed grid of ``n`` noise levels spread as :func:`sample_sigmas` spreads its draws: the quantiles
    ``(i + 0.5) / n`` of the same density (every shift is monotone, so the quantiles of the shifted σ are the shifted
    quantiles). The eval loss scores every held-out sample at each of them, so it does not depend on random σ."""
    q = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    probit = torch.special.ndtri(q)  # the standard normal's quantiles
    if method == "uniform":
        s = q
    elif method == "logit_normal":
        s = torch.sigmoid(logit_mean + logit_std * probit)
    elif method == "sigmoid":
        s = torch.sigmoid(logit_std * probit)
    elif method == "shift":
        s = shift_sigmas(torch.sigmoid(probit), shift)
    elif method in ("flux_shift", "flux2_shift"):
        s = time_shift(torch.sigmoid(probit), _shift_mu(method, seq_len, shift_config))
    else:
        raise ValueError(f"unknown sigma sampling {method!r}")
    return logit_offset(s.float().clamp(1e-5, 1 - 1e-5), bias).clamp(1e-5, 1 - 1e-5)
