"""The frozen base's memory per GPU for each ``train.base_dtype`` and ``train.base_sharding``, and the plan's table
of those options (:func:`option_lines`).

Bytes of the base, with the constants below:

- ``bf16``: the model dtype's bytes for every parameter (2; 4 for ``model.dtype=float32``).
- ``fp8`` (torchao's float8 training): the Linear weights stay in the model dtype. Each matmul casts its weight to
  fp8 (1 byte a parameter, ``FP8_CAST_BYTES``) with one fp32 tensorwise scale (``FP8_SCALE_BYTES``) for the length
  of that matmul, so the peak adds the largest Linear's fp8 copy and its scale. fp8 speeds the matmuls; it does not
  shrink the base.
- ``nf4`` (bitsandbytes): 4 bits a Linear weight plus one fp32 absmax per block of 64 weights (``NF4_BLOCK``, no
  double quantization): 0.5 + 4/64 = 0.5625 bytes (``NF4_BYTES``); biases and norms stay in the model dtype.
- ``base_sharding=node`` over W workers of a node: 1/W of the base, plus the blocks FSDP2 gathers whole while it
  computes: the running block and the prefetched next one (``GATHERED_BLOCKS`` x the largest block, model dtype).

The LoRA with its AdamW state and the activations are the same for every option (see :mod:`rayflux.plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rayflux.config.base_dtype import refusal

DTYPES = ("bf16", "fp8", "nf4")
SHARDINGS = ("none", "node")
NF4_BLOCK = 64
"""Weights per absmax block in bitsandbytes' 4-bit formats (its default blocksize)."""
NF4_BYTES = 0.5 + 4 / NF4_BLOCK
"""Bytes per NF4 Linear weight: half a byte of code plus its share of the block's fp32 absmax."""
FP8_CAST_BYTES = 1
"""Bytes per parameter of a weight's transient float8 (e4m3) copy."""
FP8_SCALE_BYTES = 4
"""One fp32 scale per cast tensor (tensorwise scaling)."""
GATHERED_BLOCKS = 2
"""Blocks an FSDP2-sharded base holds whole at once: the one computing and the one its prefetch gathers."""
GIB = 2**30


@dataclass(frozen=True)
class BaseCounts:
    """Parameter counts of a frozen transformer that the options need (elements, not bytes)."""

    total: int
    """All parameters."""
    linear: int
    """Weights of its Linear layers: what fp8 casts and nf4 quantizes."""
    largest_linear: int = 0
    """The largest single Linear weight (fp8's transient copy)."""
    largest_block: int = 0
    """The largest transformer block (what FSDP2 gathers whole)."""


def weight_bytes(counts: BaseCounts, base_dtype: str, float_bytes: int = 2) -> float:
    """Peak bytes of the whole frozen base on one GPU for ``base_dtype`` (see the module docstring)."""
    if base_dtype == "nf4":
        return counts.linear * NF4_BYTES + (counts.total - counts.linear) * float_bytes
    stored = counts.total * float_bytes
    if base_dtype == "fp8":
        stored += counts.largest_linear * FP8_CAST_BYTES + FP8_SCALE_BYTES
    return stored


def per_gpu_weight_bytes(counts: BaseCounts, base_dtype: str, sharding: str, workers: int,
                         float_bytes: int = 2) -> float:  # fmt: skip
    """Bytes of the base on each GPU: whole, or sharded over the ``workers`` of a node (``sharding="node"``)."""
    whole = weight_bytes(counts, base_dtype, float_bytes)
    if sharding != "node" or workers <= 1:
        return whole
    return whole / workers + GATHERED_BLOCKS * counts.largest_block * float_bytes


def option_lines(counts: BaseCounts, fixed_bytes: int, activations: Callable[[int, int, bool], int], workers: int,
                 float_bytes: int = 2) -> list[str]:  # fmt: skip
    """The plan's option table: GiB per GPU for each base_sharding x base_dtype at 512 and 1024 px, batch 1-4,
    gradient checkpointing off / on. ``fixed_bytes``: the LoRA with its AdamW state; ``activations(px, batch,
    checkpointing)``: bytes of one process's activations."""
    lines = [f"per-GPU memory by option (GiB, gradient checkpointing off / on; node: {workers} workers a node)",
             "  sharding dtype px    " + "".join(f"batch {b:<9}" for b in (1, 2, 3, 4)).rstrip()]  # fmt: skip
    refused = {}
    for sharding in SHARDINGS:
        for dtype in DTYPES:
            reason = refusal(dtype, gpu=True, sharding=sharding)
            if reason:
                refused[f"{sharding}/{dtype}"] = reason
                continue
            base = per_gpu_weight_bytes(counts, dtype, sharding, workers, float_bytes) + fixed_bytes
            for px in (512, 1024):
                off_on = [[(base + activations(px, b, c)) / GIB for c in (False, True)] for b in (1, 2, 3, 4)]
                cells = [f"{off:5.1f} / {on:<5.1f}" for off, on in off_on]
                lines.append((f"  {sharding:<8} {dtype:<5} {px:<5} " + " ".join(cells)).rstrip())
    lines += [f"  {key}: refused ({reason})" for key, reason in refused.items()]
    return lines
