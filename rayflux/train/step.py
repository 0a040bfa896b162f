"""One flow-matching forward pass and loss on a planned batch (the backward pass is the trainer's); what differs
between FLUX.1 and FLUX.2 (packing, ids, forward arguments) is the model family's.

Every random choice of a batch (noise, σ, guidance, caption dropout) is drawn from a generator seeded with that
batch's planned ``seed``, in that order, so a batch trains the same way on whichever rank and in whichever run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import torch

from rayflux.cache.layout import SAMPLE_TEXTS, declared
from rayflux.config import TrainConfig
from rayflux.families.base import Family
from rayflux.families.references import target_prediction
from rayflux.train import flow, preserve, timesteps


@dataclass(frozen=True)
class Runtime:
    """Where a worker runs the model and what model it is: what every forward pass needs beside the batch."""

    device: torch.device | str
    dtype: torch.dtype
    """The weights' dtype: the model's inputs are cast to it."""
    family: Family
    """The model's family: packing, ids and forward arguments."""


@dataclass
class Batch:
    """One planned batch as float32 tensors: latents ``[B, C, H, W]`` and the named text tensors ``[B, ...]`` of the
    model's family (FLUX.1: ``t5`` ``[B, L, D]`` and ``clip_pooled`` ``[B, D]``)."""

    latents: torch.Tensor
    text: dict[str, torch.Tensor]
    seed: int
    weights: torch.Tensor | None = None
    """Per-sample loss weights ``[B]`` (regularisation datasets); None weighs every sample 1."""
    references: torch.Tensor | None = None
    """Edit pairs: each sample's cached reference latents ``[B, k, C, H, W]``; None for a plain batch."""
    masks: torch.Tensor | None = None
    """Loss masks on the latent grid ``[B, H, W]`` in [0, 1]; None for a batch without masks."""
    mask_floors: torch.Tensor | None = None
    """Each sample's dataset's ``data.mask_floor`` ``[B]``: the weight the masks' black area keeps."""
    tensors: dict[str, torch.Tensor | None] = field(default_factory=dict)
    """Every other declared per-sample tensor (:mod:`rayflux.cache.layout`), by name, stacked ``[B, ...]``; None
    for an optional one the batch lacks."""
    preservation_text: dict[str, torch.Tensor] | None = None
    """``train.flow.preservation=class``: the named text tensors of each sample's preservation prompt (its caption with
    the trigger word replaced by the class word, :mod:`rayflux.preservation`), as ``text``; None otherwise."""


@dataclass
class EmptyCaption:
    """The cached embedding of the empty caption ``""``: what caption dropout trains on (one tensor per name)."""

    text: dict[str, torch.Tensor]


def _array(data: bytes, shape) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(data, np.float32).reshape(shape).copy())


def from_item(item: dict) -> Batch:
    """Rebuild the tensors of a row made by :func:`rayflux.train.data.batching.stack_batch`: each declared per-sample
    tensor lands on the :class:`Batch` attribute its declaration names, or in ``Batch.tensors``."""
    text = {n: _array(item[f"text_{n}"], json.loads(item[f"text_{n}_shape"])) for n in json.loads(item["text_names"])}
    weights = torch.tensor(json.loads(item["weights"]), dtype=torch.float32) if "weights" in item else None
    fields: dict = {"tensors": {}}
    for st in SAMPLE_TEXTS:  # a declared caption besides the sample's own: its prefixed tensors (issue 45)
        if st.prefix and any(n.startswith(st.prefix) for n in text):
            fields[st.batch] = {n[len(st.prefix) :]: text.pop(n) for n in list(text) if n.startswith(st.prefix)}
    if "mask_floors" in item:
        fields["mask_floors"] = torch.tensor(json.loads(item["mask_floors"]), dtype=torch.float32)
    for name in json.loads(item["sample_tensors"]):
        value = _array(item[name], json.loads(item[f"{name}_shape"])) if item[name] else None
        t = declared(name)
        if t is not None and t.batch:
            fields[t.batch] = value
        else:
            fields["tensors"][name] = value
    return Batch(text=text, seed=int(item["seed"]), weights=weights, **fields)


def flow_loss(
    model,
    batch: Batch,
    t: TrainConfig,
    guidance_embeds: bool,
    empty: EmptyCaption | None,
    rt: Runtime,
    *,
    shift_config: dict | None = None,
):
    """Noise the latents, predict ``ε - x`` and return the weighted loss (float32 scalar). ``shift_config``: the
    model's ``flux_shift`` constants (:func:`rayflux.models.shift_config`)."""
    device, dtype, family = rt.device, rt.dtype, rt.family
    generator = torch.Generator().manual_seed(batch.seed)
    latents = batch.latents.to(device)
    b, _, h, w = latents.shape
    # Noise is drawn on the CPU so that the same seed gives the same noise on any device.
    noise = torch.randn(latents.shape, generator=generator).to(device)
    sigmas = flow.sample_sigmas(b, generator=generator, **timesteps.options(t, family, h, w, shift_config)).to(device)
    guidance = None
    if guidance_embeds:
        guidance = flow.sample_guidance(b, t.flow.guidance, t.flow.guidance_max, generator).to(device, dtype)
    text = {n: x.to(device, dtype) for n, x in batch.text.items()}
    if t.flow.caption_dropout > 0:
        if empty is None:
            raise ValueError("train.flow.caption_dropout needs the cached empty-caption embedding")
        mask = flow.caption_dropout_mask(b, t.flow.caption_dropout, generator)
        text = flow.drop_text(text, mask, empty.text)

    def forward(m, prompt: dict) -> torch.Tensor:
        return predict(m, batch, latents, noise, sigmas, text=prompt, guidance=guidance, rt=rt)[0]

    kept, mode = None, t.flow.preservation
    if mode != "none":  # issue 45: the base's prediction first, before any graph (rayflux.train.preserve)
        kept_text = {n: x.to(device, dtype) for n, x in preserve.prompts(batch, mode, empty).items()}
        kept = preserve.base_prediction(model, kept_text, forward)
    pred, target = predict(model, batch, latents, noise, sigmas, text=text, guidance=guidance, rt=rt)
    weights = flow.loss_weights(sigmas, t.flow.loss_weighting)
    if batch.weights is not None:  # per-dataset weights, see rayflux.datasets.mix
        weights = weights * batch.weights.to(weights.device, weights.dtype)
    loss = flow.flow_loss(pred, target, weights, token_weights(batch, family))
    if kept is not None:
        loss = loss + t.flow.preservation_weight * preserve.term(model, kept_text, kept, forward, weights)
    return loss


def token_weights(batch: Batch, family: Family) -> torch.Tensor | None:
    """The batch's per-token loss weights ``[B, N]`` from its masks, packed as the family packs the latent (only the
    target's tokens: an edit's references are cut off the prediction), or None for a batch without masks."""
    if batch.masks is None:
        return None
    floors = batch.mask_floors if batch.mask_floors is not None else torch.zeros(batch.masks.shape[0])
    return flow.mask_weights(family.pack_mask(batch.masks), floors)


def predict(model, batch: Batch, latents, noise, sigmas, *, text: dict, guidance, rt: Runtime):
    """The model's packed prediction of ``ε - x`` for ``latents`` noised to ``sigmas``, and the packed target."""
    device, dtype, family = rt.device, rt.dtype, rt.family
    _, _, h, w = latents.shape
    # Noisy input and target stay float32; only the model input is cast to the weights' dtype.
    noisy = family.pack(flow.noisy_input(latents, noise, sigmas)).to(dtype)
    target = family.pack(flow.flow_target(latents, noise))
    # An edit's reference latents are clean context after the target's tokens; the loss sees the target's only.
    refs = None if batch.references is None else batch.references.to(device, dtype)
    pred = model(**family.forward_args(noisy, text, sigmas, h, w, guidance, references=refs), return_dict=False)[0]
    return target_prediction(pred, noisy.shape[1]), target
