"""Parameter counts of a transformer's config, on the meta device (no weights, no GPU): the frozen base's, and an
adapter's trainable ones. ``python -m rayflux plan`` prints them; the job's driver weighs a worker's GPU memory with
them (:mod:`rayflux.train.gpu_sharing`)."""

from __future__ import annotations

from rayflux.gpu_memory import BaseCounts
from rayflux.train.adapter import lora


def count_parameters(
    tc: dict, targets: str, rank: int, adapter: str = "lora", rank_pattern: dict | None = None
) -> tuple[int, int]:
    """(all transformer parameters, trainable adapter parameters) of ``targets`` at ``rank``, counted on peft's own
    modules attached on the meta device (``train.adapter.kind``: DoRA's magnitudes, LoKr's factors included)."""
    import torch

    from rayflux.models import meta_transformer

    model = meta_transformer(tc)
    base = sum(p.numel() for p in model.parameters())
    with torch.device("meta"):
        lora.add_lora(model, rank, rank, targets, adapter=adapter, rank_pattern=rank_pattern)
    return base, sum(p.numel() for p in model.parameters() if p.requires_grad)


def base_counts(tc: dict) -> BaseCounts:
    """What the base_dtype and base_sharding options need to know of the frozen transformer (meta device)."""
    from rayflux.models import meta_transformer
    from rayflux.train.adapter import base_weights

    return base_weights.counts(meta_transformer(tc))
