"""Seeded stand-ins for cached batches, shaped like the tiny model's cache at 64 px, for in-process trainer tests.

They go through the same row format as the Ray feed (``batching.stack_batch`` -> ``step.from_item``), so the
trainer sees exactly what a worker sees; only the tensor values are drawn here instead of read from a cache.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rayflux import config
from rayflux.train import step
from rayflux.train.data import batching

LATENT = (4, 8, 8)  # tiny VAE latents of a 64x64 image
T5 = (512, 32)  # the tiny model is guidance-distilled, so 512 T5 tokens
CLIP = 32


def items(n: int, batch_size: int = 2, seed: int = 0) -> list[dict]:
    """``n`` planned-batch rows with seeded tensors and per-batch noise seeds."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        lat = [torch.randn(LATENT, generator=g).numpy() for _ in range(batch_size)]
        t5 = [torch.randn(T5, generator=g).numpy() for _ in range(batch_size)]
        clip = [torch.randn(CLIP, generator=g).numpy() for _ in range(batch_size)]
        plan = {"epoch": 0, "index": i, "seed": 1000 + i, "step": i + 1, "total_steps": n, "bucket": "64x64"}
        ids = [f"sample-{i}-{j}" for j in range(batch_size)]
        out.append(batching.stack_batch(plan, 0, ids, {"latent": lat}, {"t5": t5, "clip_pooled": clip}))
    return out


def empty_caption(seed: int = 99) -> step.EmptyCaption:
    g = torch.Generator().manual_seed(seed)
    return step.EmptyCaption({"t5": torch.randn(T5, generator=g), "clip_pooled": torch.randn(CLIP, generator=g)})


def job(tiny_model, *overrides: str) -> config.JobConfig:
    return config.load(None, [f"model.path={tiny_model}", *overrides])


def groups(rows: list[dict], size: int) -> list[list[step.Batch]]:
    return [[step.from_item(r) for r in rows[i : i + size]] for i in range(0, len(rows), size)]


def _gloo_rank(rank: int, port: int, worker, args: tuple, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        out[rank] = worker(rank, *args)
    finally:
        dist.destroy_process_group()


def two_ranks(worker, *args) -> tuple[dict, dict]:
    """``worker(rank, *args)`` in two real processes joined in one gloo group; what each rank returned."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_gloo_rank, args=(port, worker, args, out), nprocs=2, join=True)
        return dict(out[0]), dict(out[1])
