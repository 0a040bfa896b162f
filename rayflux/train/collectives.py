"""What every training rank agrees on: one step's numbers and flags reduced over the ranks, a barrier, the worst
rank's memory. Each is a collective: every rank must call it, at the same point of its step."""

from __future__ import annotations

import torch


def agree(loss: float, samples: int, report_due: bool, preempted: bool, device, world: int, *, reads=(0, 0, 0)):
    """One step's all-rank view: ``(mean loss, total samples, report due, preempted, reads)``, the flags true on every
    rank when true on any (rank 0 alone decides when a report is due), ``reads`` (bytes fetched, tensor bytes,
    requests) summed over ranks."""
    if world == 1:
        return loss, samples, report_due, preempted, tuple(reads)
    t = torch.tensor(
        [loss, float(samples), float(report_due), float(preempted), *map(float, reads)],
        dtype=torch.float64,
        device=device,
    )
    torch.distributed.all_reduce(t)
    return float(t[0]) / world, int(t[1]), bool(t[2] > 0), bool(t[3] > 0), tuple(int(x) for x in t[4:].tolist())


def barrier(device, world: int) -> None:
    """Wait for every rank (a tiny all-reduce, on the process group the step already uses)."""
    if world > 1:
        torch.distributed.all_reduce(torch.zeros(1, device=device))


def worst_rank(facts: dict, device, world: int) -> dict:
    """The largest value of each memory fact over all ranks (a collective: every rank must call it)."""
    if world == 1:
        return facts
    keys = sorted(facts)
    t = torch.tensor([float(facts[k]) for k in keys], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return {k: (int(v) if isinstance(facts[k], int) else round(float(v), 1)) for k, v in zip(keys, t.tolist())}
