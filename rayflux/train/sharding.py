"""``train.workers.base_fsdp``: the frozen transformer sharded with FSDP2 across the workers of a node, replicated across
nodes (HSDP), while the LoRA stays a plain, whole module on every worker.

Only the frozen base is FSDP's: the adapter is attached after ``fully_shard``, so its parameters and AdamW state are
ordinary tensors, and their gradients are averaged over every rank once per optimizer step by
:func:`all_reduce_mean`, as DDP does. Frozen parameters never get a gradient, so FSDP only all-gathers (forward, and
again in the backward pass for the input gradients) and never reduce-scatters: that is all gloo must offer on CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

BUDGET = 0.9
"""``auto`` shards when the whole base plus activations exceed this share of the device's memory."""


@dataclass(frozen=True)
class Topology:
    """Where this worker runs, as Ray Train's context says (``get_world_size``, ``get_local_world_size``,
    ``get_node_rank``)."""

    world: int
    local_world: int
    node_rank: int


@dataclass(frozen=True)
class Layout:
    """How the base is held: the device mesh's shape (``(shards,)`` or ``(replicas, shards)``) and why."""

    shape: tuple[int, ...]
    reason: str

    @property
    def shards(self) -> int:
        return self.shape[-1]


def choose(mode: str, on_gpu: bool, workers_per_node: int, needed_bytes: int, device_bytes: int) -> str:
    """``none`` or ``node`` for a ``train.workers.base_fsdp`` setting. ``auto`` is ``node`` only on GPU, with more than
    one worker on the node, when one process's whole-base estimate (weights, LoRA + AdamW, activations) exceeds
    :data:`BUDGET` of the device's memory; on CPU it is always ``none``."""
    if mode != "auto":
        return mode
    crowded = on_gpu and workers_per_node > 1 and device_bytes > 0
    return "node" if crowded and needed_bytes > BUDGET * device_bytes else "none"


def mesh_shape(node_of: list[int], local_sizes: list[int]) -> Layout:
    """The mesh for ranks ``0..W-1`` given each rank's node rank and its node's worker count.

    A 2-D ``(nodes, workers per node)`` mesh (shard within a node, replicate across) needs every node to hold the
    same number of workers on consecutive ranks: ``init_device_mesh`` lays ranks out row by row. When an elastic
    placement breaks that, the base is sharded over all workers instead (a 1-D mesh): more traffic between nodes,
    but the same memory per worker and no rank waiting on a group it is not in.
    """
    world = len(node_of)
    per_node = local_sizes[0] if local_sizes else 0
    nodes = world // per_node if per_node else 0
    even = per_node > 0 and set(local_sizes) == {per_node} and nodes * per_node == world
    contiguous = even and all(node_of[r] == node_of[r - r % per_node] for r in range(world))
    distinct = contiguous and len({node_of[n * per_node] for n in range(nodes)}) == nodes
    if not distinct:
        return Layout(
            (world,),
            f"uneven workers per node ({local_sizes}) or nodes not on consecutive ranks: sharded over all workers",
        )
    if nodes == 1:
        return Layout((world,), "one node: sharded over its workers")
    return Layout((nodes, per_node), f"{nodes} nodes x {per_node} workers: sharded within a node, replicated across")


def gather_layout(topology: Topology, device) -> Layout:
    """Every rank's node rank and node size (one all-gather), then :func:`mesh_shape`. A collective."""
    import torch.distributed as dist

    mine = torch.tensor([topology.node_rank, topology.local_world], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(topology.world)]
    dist.all_gather(every, mine)
    return mesh_shape([int(t[0]) for t in every], [int(t[1]) for t in every])


def build_mesh(layout: Layout, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    # Unnamed on purpose: peft sizes an adapter on a sharded Linear by the mesh's dimension names, and takes an
    # unnamed (or "fsdp"-only) mesh as FSDP, whose modules compute the whole projection; any other name would give
    # it the local shard's shape, which only tensor parallelism computes.
    return init_device_mesh(device_type, layout.shape)


def shard(transformer, mesh) -> None:
    """``fully_shard`` each transformer block (the model's ``_no_split_modules``), then the root for what is left
    (embedders, norms, the final projection). A 2-D mesh makes it HSDP."""
    from torch.distributed.fsdp import fully_shard

    blocks = set(getattr(transformer, "_no_split_modules", None) or ())
    for module in transformer.modules():
        if module is not transformer and type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, reshard_after_forward=True)
    fully_shard(transformer, mesh=mesh, reshard_after_forward=True)


def shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """The ``[start, stop)`` rows of dim 0 that shard ``index`` of ``shards`` holds: FSDP2's ``torch.chunk`` split
    (``ceil(rows / shards)`` each, the last ones shorter or empty)."""
    chunk = -(-rows // shards)
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows)


def local_bytes(module) -> int:
    """Bytes of this rank's part of ``module``'s parameters: the local shard of a sharded one, all of a plain one."""
    total = 0
    for p in module.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def whole_bytes(module) -> int:
    """Bytes of all of ``module``'s parameters (a sharded one counted whole)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def all_reduce_mean(params: list) -> None:
    """Average the gradients of ``params`` over every rank in one flat all-reduce (a missing gradient counts as
    zeros): DDP's mean, for parameters FSDP does not manage."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _flatten_dense_tensors(grads)
    flat /= dist.get_world_size()  # before the sum, as DDP's default hook does: the same rounding as DDP
    dist.all_reduce(flat)
    for p, g in zip(params, _unflatten_dense_tensors(flat, grads)):
        p.grad = g.view_as(p)


def broadcast_from_first(params: list) -> None:
    """Rank 0's values of ``params`` on every rank (what DDP does to the adapter when it wraps the model)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    with torch.no_grad():
        flat = _flatten_dense_tensors([p.data for p in params])
        dist.broadcast(flat, src=0)
        for p, v in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
            p.copy_(v)


def any_rank(flag: bool, device) -> bool:
    """True on every rank when ``flag`` is true on any (one tiny all-reduce)."""
    import torch.distributed as dist

    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t[0] > 0)
