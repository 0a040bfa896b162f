"""One FLUX flow-matching forward pass and loss on a planned batch (the backward pass is the trainer's).

Every random choice of a batch (noise, σ, guidance, caption dropout) is drawn from a generator seeded with that
batch's planned ``seed``, in that order, so a batch trains the same way on whichever rank and in whichever run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from rayflux.config import TrainConfig
from rayflux.train import flow


@dataclass
class Batch:
    """One planned batch as float32 tensors: latents ``[B, C, H, W]``, T5 ``[B, L, D]``, CLIP pooled ``[B, D]``."""

    latents: torch.Tensor
    t5: torch.Tensor
    clip: torch.Tensor
    seed: int
    weights: torch.Tensor | None = None
    """Per-sample loss weights ``[B]`` (regularisation datasets); None weighs every sample 1."""


@dataclass
class EmptyCaption:
    """The cached embedding of the empty caption ``""``: what caption dropout trains on."""

    t5: torch.Tensor
    clip: torch.Tensor


def _array(data: bytes, shape) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, np.float32).reshape(shape).copy())


def from_item(item: dict) -> Batch:
    """Rebuild the tensors of a row made by :func:`rayflux.train.batching.stack_batch`."""
    lat = _array(item["latent"], json.loads(item["latent_shape"]))
    t5 = _array(item["t5"], json.loads(item["t5_shape"]))
    clip = _array(item["clip"], (lat.shape[0], int(item["clip_dim"])))
    weights = torch.tensor(json.loads(item["weights"]), dtype=torch.float32) if "weights" in item else None
    return Batch(lat, t5, clip, int(item["seed"]), weights)


def flow_loss(
    model, batch: Batch, t: TrainConfig, guidance_embeds: bool, empty: EmptyCaption | None, device, dtype,
    shift_config: dict | None = None,
):  # fmt: skip
    """Noise the latents, predict ``ε - x`` and return the weighted loss (float32 scalar). ``shift_config``: the
    model's ``flux_shift`` constants (:func:`rayflux.models.shift_config`)."""
    generator = torch.Generator().manual_seed(batch.seed)
    latents = batch.latents.to(device)
    b, _, h, w = latents.shape
    # Noise is drawn on the CPU so that the same seed gives the same noise on any device.
    noise = torch.randn(latents.shape, generator=generator).to(device)
    sigmas = flow.sample_sigmas(
        b,
        t.sigma_sampling,
        generator,
        logit_mean=t.logit_mean,
        logit_std=t.logit_std,
        shift=t.shift,
        seq_len=(h // 2) * (w // 2),
        shift_config=shift_config,
    ).to(device)
    kwargs = {}
    if guidance_embeds:
        kwargs["guidance"] = flow.sample_guidance(b, t.guidance, t.guidance_max, generator).to(device, dtype)
    t5, clip = batch.t5.to(device, dtype), batch.clip.to(device, dtype)
    if t.caption_dropout > 0:
        if empty is None:
            raise ValueError("train.caption_dropout needs the cached empty-caption embedding")
        mask = flow.caption_dropout_mask(b, t.caption_dropout, generator)
        t5, clip = flow.drop_captions(t5, clip, mask, empty.t5, empty.clip)
    # Noisy input and target stay float32; only the model input is cast to the weights' dtype.
    noisy = flow.pack(flow.noisy_input(latents, noise, sigmas)).to(dtype)
    target = flow.pack(flow.flow_target(latents, noise))
    pred = model(
        hidden_states=noisy,
        encoder_hidden_states=t5,
        pooled_projections=clip,
        timestep=sigmas.to(dtype),
        img_ids=flow.image_ids(h, w, device, dtype),
        txt_ids=flow.text_ids(t5.shape[1], device, dtype),
        return_dict=False,
        **kwargs,
    )[0]
    weights = flow.loss_weights(sigmas, t.loss_weighting)
    if batch.weights is not None:  # per-dataset weights, see rayflux.datasets.mix
        weights = weights * batch.weights.to(weights.device, weights.dtype)
    return flow.flow_loss(pred, target, weights)
