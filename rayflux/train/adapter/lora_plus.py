"""LoRA+ (Hayou et al., 2024): the ``B`` matrices train at ``train.optim.lora_plus_ratio`` times the learning rate of the
``A`` matrices, as two parameter groups of the optimizer.

``B`` starts at zero and maps the rank-``r`` bottleneck back to the layer's full width; the paper shows that for
wide layers it should move faster than ``A`` (it recommends a ratio of about 16). DoRA's magnitudes stay with ``A``
at the base rate. LoKr has no ``A``/``B`` pair, and Prodigy estimates one step size for every group and refuses
group learning rates that differ: both are refused before any work (:func:`rayflux.config.checks.lora_plus_refusal`).
"""

from __future__ import annotations

B_MARK = ".lora_B."
"""What peft's names of the ``B`` matrices hold (``<module>.lora_B.<adapter>.weight``)."""


def split(named: list[tuple[str, object]]) -> tuple[list, list]:
    """``(others, B matrices)`` of the named trainable parameters, in their order."""
    return [p for n, p in named if B_MARK not in n], [p for n, p in named if B_MARK in n]


def param_groups(transformer, params: list, ratio: float, learning_rate: float) -> list:
    """What the optimizer is built over: ``params`` themselves when LoRA+ is off (``ratio`` 0), else two groups, the
    ``A`` matrices (and DoRA magnitudes) at ``learning_rate`` first (the rate the schedule reports), then the ``B``
    matrices at ``ratio × learning_rate``. A schedule multiplies both alike, so the ratio holds at every step."""
    if not ratio:
        return params
    chosen = {id(p) for p in params}
    named = [(n, p) for n, p in transformer.named_parameters() if id(p) in chosen]
    others, b = split(named)
    if not b or len(others) + len(b) != len(params):
        raise ValueError("train.lora_plus_ratio: the adapter has no LoRA B matrices to train faster")
    return [{"params": others, "lr": learning_rate}, {"params": b, "lr": learning_rate * ratio}]
