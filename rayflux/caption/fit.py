"""The captioner pool sized to the cluster, and refused with the numbers when it cannot fit.

Counted as the cache's encoder pools are (:mod:`rayflux.cache.fit`): the actors' reservations (CPUs, a GPU share,
an accelerator type) against the cluster or its autoscaler's maximum, beside one read task. Memory too, since a VLM
is large: the model's parameters (read from its safetensors headers) in ``caption.dtype``, plus a margin for
activations and the KV cache, must fit the memory of one actor's GPU share, or on CPU the largest node's memory.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

from rayflux.cache.fit import PREPARE_CPUS, Capacity, FitError

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MARGIN = 1.2
"""Memory of a generating actor over its weights: activations of a batch and its KV cache (about 20% for a 7B VLM
at batch 8 and a few hundred tokens)."""
GIB = 2**30


@dataclass(frozen=True)
class Pool:
    """The captioner actors: Ray options of one, and how many run."""

    resources: dict
    actors: int


def parameters(model: str) -> int | None:
    """Parameters of a local model directory, from its safetensors headers (no weights read); None when unknown
    (a hub id, or ``.bin`` weights)."""
    if not os.path.isdir(model):
        return None
    files = [f for f in os.listdir(model) if f.endswith(".safetensors")]
    if not files:
        return None
    total = 0
    for name in files:
        with open(os.path.join(model, name), "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for key, info in header.items():
            if key != "__metadata__":
                total += math.prod(info["shape"])
    return total


def needed_bytes(model: str, dtype: str) -> int | None:
    """Memory one captioner actor needs: its weights in ``dtype`` plus :data:`MARGIN`; None when unknown."""
    n = parameters(model)
    return None if n is None else int(n * BYTES[dtype] * MARGIN)


def resources(c, gpu: bool) -> dict:
    """Ray options of one captioner actor (``c``: the ``caption`` section)."""
    res: dict = {"num_cpus": c.cpus_per_actor}
    if gpu:
        res["num_gpus"] = c.gpus_per_actor
    if c.accelerator_type:
        res["accelerator_type"] = c.accelerator_type
    return res


def size(c, gpu: bool, need: int | None, cap: Capacity, memory: Memory, dtype: str = "float32") -> Pool:
    """The pool for ``caption.actors`` (0: auto); FitError naming the keys and numbers when it cannot fit.
    ``need``: :func:`needed_bytes`."""
    res = resources(c, gpu)
    budget = cap.budget(now=False)
    where = "at the autoscaler's maximum" if cap.most is not None else "in the cluster"
    if c.accelerator_type and f"accelerator_type:{c.accelerator_type}" not in budget:
        raise FitError(f"caption.accelerator_type={c.accelerator_type}: no such GPU {where}")
    _check_memory(c, gpu, need, memory, dtype)
    cpus = budget.get("CPU", 0.0) - PREPARE_CPUS
    fits = math.floor(cpus / c.cpus_per_actor + 1e-9)
    if gpu:
        fits = min(fits, math.floor(budget.get("GPU", 0.0) / c.gpus_per_actor + 1e-9))
    wanted = c.actors or (fits if gpu else 1)
    if fits < max(wanted, 1):
        what = f"caption.gpus_per_actor={c.gpus_per_actor:g} of {budget.get('GPU', 0.0):g} GPUs, " if gpu else ""
        raise FitError(
            f"caption.actors={wanted or 1}: {what}caption.cpus_per_actor={c.cpus_per_actor:g} + {PREPARE_CPUS} CPU "
            f"for reading images > {budget.get('CPU', 0.0):g} CPUs {where} (room for {fits})"
        )
    return Pool(res, max(wanted, 1))


@dataclass(frozen=True)
class Memory:
    """Memory the cluster offers an actor, in bytes (0: unknown)."""

    largest_node: int = 0
    """The largest node's Ray ``memory`` resource (where a CPU captioner holds its weights)."""
    gpu: int = 0
    """One of the cluster's GPUs (:func:`gpu_memory`)."""

    @staticmethod
    def of_cluster(gpu: bool, c) -> Memory:
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        largest = max((int(n["Resources"].get("memory", 0)) for n in nodes), default=0)
        return Memory(largest, gpu_memory(c) if gpu else 0)


def gpu_memory(c) -> int:
    """Bytes of one GPU of the kind a captioner actor gets (:func:`probe_gpu`)."""
    return probe_gpu(min(c.gpus_per_actor, 1.0), c.accelerator_type)


def probe_gpu(share: float, accelerator_type: str = "") -> int:
    """Bytes of one GPU (of ``accelerator_type``, when set), asked of a GPU in a short task that reserves ``share`` of
    it; 0 when no GPU answers within a minute (an autoscaler may not have started one yet)."""
    import ray

    def probe() -> int:
        import torch

        return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else 0

    opts = {"num_gpus": share, "num_cpus": 0}
    if accelerator_type:
        opts["accelerator_type"] = accelerator_type
    ref = ray.remote(**opts)(probe).remote()
    ready, _ = ray.wait([ref], timeout=60)
    if not ready:
        ray.cancel(ref)
        return 0
    return ray.get(ref)


def _check_memory(c, gpu: bool, need: int | None, memory: Memory, dtype: str) -> None:
    if need is None:
        return
    model = c.model or "the tiny captioner"
    if gpu and memory.gpu:
        gpu_memory, have = memory.gpu, memory.gpu * c.gpus_per_actor
        if need > have:
            raise FitError(
                f"caption.model {model} needs about {need / GIB:.1f} GiB in {dtype} (weights + "
                f"{int((MARGIN - 1) * 100)}%), more than caption.gpus_per_actor={c.gpus_per_actor:g} of a "
                f"{gpu_memory / GIB:.0f} GiB GPU gives ({have / GIB:.1f} GiB); raise caption.gpus_per_actor or "
                "use caption.dtype=bfloat16"
            )
    elif not gpu and memory.largest_node and need > memory.largest_node:
        raise FitError(
            f"caption.model {model} needs about {need / GIB:.1f} GiB in {dtype} on CPU, more than the largest "
            f"node's {memory.largest_node / GIB:.1f} GiB of Ray memory; caption on GPUs or a larger node"
        )
