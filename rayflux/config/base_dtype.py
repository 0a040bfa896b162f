"""Where ``train.base_dtype`` can run: the one-line reasons a lower-precision frozen base is refused.

Pure rules, shared by the config check (``train.workers.on_gpu=false``, ``train.workers.base_fsdp=node``: known before any
work), the driver once it has seen the cluster (no GPU in it), and each worker as it loads the model (its GPU's
compute capability, the package it needs).
"""

from __future__ import annotations

NEEDS = {
    "fp8": ("torchao", "fp8", "torchao's float8 matmuls"),
    "nf4": ("bitsandbytes", "nf4", "bitsandbytes' 4-bit kernels"),
}
"""base_dtype -> (package it imports, the ``rayflux[...]`` extra that installs it, what it runs on the GPU)."""
MIN_CAPABILITY = {"fp8": (8, 9)}
"""Lowest CUDA compute capability per base_dtype: fp8 tensor cores start with Ada (8.9) and Hopper (9.0)."""
NODE_SHARDING = {
    "fp8": "torchao's float8 layers would have to be swapped in before FSDP2 shards the base, and the sharded "
    "loader shards plain bf16 weights; use train.workers.base_fsdp=none with fp8, or bf16 with node",
    "nf4": "bitsandbytes' packed 4-bit weights are not tensors FSDP2 can shard; use train.workers.base_fsdp=none "
    "(an NF4 base is a quarter of bf16), or bf16 with node",
}
"""Why each lower-precision base does not combine with ``train.workers.base_fsdp=node``."""


def shardable(base_dtype: str) -> bool:
    """Whether ``train.workers.base_fsdp`` may shard this base (``auto`` must keep ``none`` where it may not)."""
    return base_dtype not in NODE_SHARDING


def refusal(
    base_dtype: str,
    *,
    gpu: bool,
    capability: tuple[int, int] | None = None,
    installed: bool = True,
    sharding: str = "none",
) -> str:
    """Why ``base_dtype`` cannot run here, in one line; empty when it can. ``gpu``: the run trains on CUDA GPUs;
    ``capability``: the GPU's (None: not known yet, e.g. on the driver); ``installed``: its package imports."""
    if base_dtype not in NEEDS:
        return ""
    key = f"train.base_dtype={base_dtype}"
    package, extra, what = NEEDS[base_dtype]
    if sharding == "node" and not shardable(base_dtype):
        return f"{key} with train.workers.base_fsdp=node: {NODE_SHARDING[base_dtype]}"
    if not gpu:
        return (
            f"{key} needs a CUDA GPU ({what}); this run trains on CPU (train.workers.on_gpu=false, no GPU in the "
            "cluster, or none on this worker)"
        )
    least = MIN_CAPABILITY.get(base_dtype)
    if capability is not None and least and tuple(capability) < least:
        return (
            f"{key} needs a GPU of compute capability {least[0]}.{least[1]} or more (fp8 tensor cores: Ada, "
            f"Hopper); this GPU is {capability[0]}.{capability[1]}"
        )
    if not installed:
        return f"{key} needs {package}, which is not installed: pip install 'rayflux[{extra}]'"
    return ""
