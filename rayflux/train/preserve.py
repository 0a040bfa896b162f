"""Output preservation's loss term (``train.flow.preservation``, :mod:`rayflux.preservation` for the prompts).

The step's noisy latent goes through the model twice more, on the batch's preservation prompts: once with the
adapter switched off and no gradients (the base's prediction: the target), once with it on. The term is the
flow loss between the two, weighted per sample as the concept loss is (σ weighting, dataset weight) over the whole
image (a loss mask selects where the concept is, not what to keep). At weight 0 it changes nothing: the gradients
are those of plain training.

The base forward runs first, before the step builds any autograd graph: switching peft's adapters off and on
toggles their parameters' ``requires_grad``, which must not happen under a live graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from rayflux.train import flow


def unwrapped(model):
    """The transformer behind a DDP wrapper (its forward without gradients needs none of DDP's hooks)."""
    return getattr(model, "module", model)


@contextlib.contextmanager
def adapter_disabled(model):
    """The model without its adapter (LoRA, DoRA or LoKr: peft's tuner layers bypassed, as diffusers'
    ``disable_adapters``), for the length of the block; enabled again after it, trainable as before."""
    transformer = unwrapped(model)
    transformer.disable_adapters()
    try:
        yield transformer
    finally:
        transformer.enable_adapters()


def prompts(batch, mode: str, empty) -> dict[str, torch.Tensor]:
    """The batch's preservation prompts' named text tensors ``[B, ...]``: its class prompts (``class``), or the
    cached empty caption for every sample (``blank``)."""
    if mode == "class":
        if batch.preservation_text is None:
            raise ValueError("train.flow.preservation=class, but the batch carries no preservation prompts")
        return batch.preservation_text
    if empty is None:
        raise ValueError("train.flow.preservation=blank needs the cached empty-caption embedding")
    b = batch.latents.shape[0]
    return {n: x.unsqueeze(0).expand(b, *x.shape) for n, x in empty.text.items()}  # cached without a batch axis


def base_prediction(model, text: dict, forward: Callable) -> torch.Tensor:
    """The base model's prediction on ``text`` (``forward(model, text)``: the step's noisy latents, σ and guidance),
    the adapter off, without gradients."""
    with torch.no_grad(), adapter_disabled(model) as base:
        return forward(base, text).detach()


def term(model, text: dict, target: torch.Tensor, forward: Callable, weights: torch.Tensor) -> torch.Tensor:
    """The LoRA model's flow loss on the preservation prompts against the base's prediction ``target``."""
    pred = forward(model, text)
    return flow.flow_loss(pred, target.to(pred.dtype), weights, None)
