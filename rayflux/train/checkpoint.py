"""What a training checkpoint holds, and how each rank writes and restores its part.

Every rank reports the same checkpoint directory (Ray Train merges the ranks' files), each with different names:

- rank 0: ``pytorch_lora_weights.safetensors`` (the LoRA, also the resume source), the kohya file when
  ``output_format=kohya``, ``train_state.pt`` (optimizer, LR scheduler, step, data position) and ``metrics.json``;
- every rank ``r``: ``rng-rank<r>.pt`` (torch CPU/CUDA, Python and numpy RNG states: LoRA dropout draws from them)
  and ``batches-rank<r>.jsonl`` (every batch it trained: step, plan index, bucket, sample ids).

Noise, σ, guidance and caption dropout need no saved state: they come from each planned batch's own seed. The data
position is the number of planned batches each rank has consumed (the same on every rank), because every rank
consumes its planned batches in order. ``torch.load`` runs with ``weights_only=True`` only; RNG states are stored as
tensors, ints and tuples.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from rayflux.train import kohya, lora

STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.json"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


def batches_file(rank: int) -> str:
    return f"batches-rank{rank:05d}.jsonl"


@dataclass
class Progress:
    """Where a run is: optimizer steps done, this rank's batch log, and the metrics history (rank 0)."""

    step: int = 0
    batches_done: int = 0
    """Planned batches this rank has consumed: its data position."""
    batches: list = field(default_factory=list)
    history: list = field(default_factory=list)
    world_size: int = 0
    resumed_at: list = field(default_factory=list)
    """The step each restart of the run continued from."""


def capture_rng() -> dict:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights_only loading refuses; a tensor carries the same numbers.
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
    }


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))


def save(directory: str, trainer, rank: int, progress: Progress, output_format: str) -> None:
    """Write this rank's part of a checkpoint into ``directory``."""
    torch.save(capture_rng(), os.path.join(directory, rng_file(rank)))
    with open(os.path.join(directory, batches_file(rank)), "w") as f:
        f.writelines(json.dumps(b) + "\n" for b in progress.batches)
    if rank != 0:
        return
    lora.save_diffusers(trainer.transformer, directory)
    if output_format == "kohya":
        kohya.save(trainer.transformer, directory, lora.scale(trainer.transformer))
    state = {
        **trainer.state_dict(),
        "step": progress.step,
        "batches_done": progress.batches_done,
        "world_size": progress.world_size,
    }
    torch.save(state, os.path.join(directory, STATE_FILE))
    with open(os.path.join(directory, METRICS_FILE), "w") as f:
        keys = ("step", "world_size", "resumed_at", "history")
        json.dump({k: getattr(progress, k) for k in keys}, f)


def restore(directory: str, trainer, rank: int, world_size: int) -> Progress:
    """Load a checkpoint into ``trainer`` and this rank's RNGs; returns where to continue from.

    After an elastic resize a rank may have no saved RNG state or batch log of its own: it keeps the fresh seed the
    trainer gave it, and the run goes on from the same step (exactness holds only for an unchanged world size).
    """
    lora.load_into(trainer.transformer, os.path.join(directory, lora.WEIGHT_NAME))
    state = torch.load(os.path.join(directory, STATE_FILE), weights_only=True)
    trainer.load_state_dict(state)
    with open(os.path.join(directory, METRICS_FILE)) as f:
        saved = json.load(f)
    step = int(state["step"])
    progress = Progress(
        step=step,
        batches_done=int(state["batches_done"]),
        history=saved["history"],
        world_size=world_size,
        resumed_at=saved["resumed_at"] + [step],
    )
    same_world = int(state["world_size"]) == world_size
    if same_world and os.path.exists(os.path.join(directory, rng_file(rank))):
        restore_rng(torch.load(os.path.join(directory, rng_file(rank)), weights_only=True))
        with open(os.path.join(directory, batches_file(rank))) as f:
            progress.batches = [json.loads(line) for line in f if line.strip()]
    return progress


def read_batches(directory: str) -> dict[int, list[dict]]:
    """Every rank's batch log in a checkpoint directory: ``{rank: [batch, ...]}``."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("batches-rank"):
            with open(os.path.join(directory, name)) as f:
                out[int(name[len("batches-rank") : -len(".jsonl")])] = [json.loads(x) for x in f if x.strip()]
    return out


def lora_file(output_format: str) -> str:
    """The checkpoint file to export for ``train.output_format``."""
    return kohya.KOHYA_NAME if output_format == "kohya" else lora.WEIGHT_NAME
