"""What a training checkpoint holds, and how each rank writes and restores its part.

Every rank reports the same checkpoint directory (Ray Train merges the ranks' files), each with different names:

- rank 0: ``pytorch_lora_weights.safetensors`` (the LoRA, also the resume source), the kohya file when
  ``output_format=kohya`` (both as :meth:`LoraTrainer.optimizer_eval` gives them), with ``train.optim.ema_decay`` the same
  files of the EMA's weights in ``ema/``, ``train_state.pt`` (optimizer and LR scheduler, a schedule-free optimizer's
  training weights, the EMA's state) and ``position.json``;
- every rank ``r``: ``rng-rank<r>.pt`` (torch CPU RNG, the worker's own accelerator RNG, Python and numpy: LoRA
  dropout draws from them) and ``rank-<r>.json`` (its data position and the digest of every batch it trained).

``position.json`` is a bounded record, whatever the step count: the optimizer step, the plan position (epoch, and
the plan index before which every batch of that epoch is done), the world size, a digest chained over every step's
position, ``resumed_at`` (the step each restart continued from) and ``restarts`` (each with its cause). The full
per-step history lives in the append-only step log beside the run (:mod:`rayflux.train.observe.metrics`).

Noise, σ, guidance and caption dropout need no saved state: they come from each planned batch's own seed.
``torch.load`` runs with ``weights_only=True`` and ``map_location="cpu"`` only, and the optimizer state is moved to
the parameters' device as it is loaded, so a restart may place ranks on other devices (8+4 GPUs becoming 6+6).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from rayflux.train.adapter import kohya, lora
from rayflux.train.resume.commits import POSITION_FILE

STATE_FILE = "train_state.pt"
EMA_DIR = "ema"
"""The checkpoint's folder of the EMA's LoRA files (the export's source; resume restores the EMA from STATE_FILE)."""


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def chain(digest: str, item) -> str:
    """The next link of a digest chain: ``sha256(digest + json(item))``. Equal chains mean equal sequences."""
    return hashlib.sha256((digest + json.dumps(item, sort_keys=True)).encode()).hexdigest()


@dataclass
class Progress:
    """Where a run is: steps done, the plan position, and (this rank) the digest of what it trained."""

    step: int = 0
    epoch: int = 0
    index: int = 0
    """Every planned batch of ``epoch`` before this plan index is trained (by all ranks together)."""
    world_size: int = 0
    batches_done: int = 0
    """Planned batches this rank has consumed."""
    digest: str = ""
    """Chained over every step's position (epoch, index, span, world): the same on every rank."""
    rank_digest: str = ""
    """Chained over every batch this rank trained (step, epoch, index, sample ids)."""
    resumed_at: list = field(default_factory=list)
    """The step each restart of the run continued from (0: a restart from scratch)."""
    restarts: list = field(default_factory=list)
    """One record per restart: step, checkpoint resumed from, the one Ray offered, and the cause."""
    failures_seen: str = ""
    """The newest failure record (``commits.RESTARTS_DIR``) already attributed to a restart."""
    feed_done: bool = False
    """The last step was the last of the trainer run's planned batches (not cut short by ``train.max_steps``)."""
    best_eval_loss: float | None = None
    """The lowest eval loss so far (None: no eval yet), the one ``lora/<name>-best.safetensors`` holds."""
    best_step: int = -1
    """The step of ``best_eval_loss`` (0: the untrained LoRA's baseline)."""

    def advance(self, step: int, position: dict, group: list[dict]) -> None:
        """Record one optimizer step: ``position`` as from ``elastic.step_position``, ``group`` this rank's rows."""
        self.step = step
        self.epoch, self.index = position["epoch"], position["index"] + position["span"]
        self.batches_done += len(group)
        self.digest = chain(self.digest, [step, position["epoch"], position["index"], position["span"]])
        for row in group:
            self.rank_digest = chain(self.rank_digest, batch_key(step, row))


def batch_key(step: int, row: dict) -> list:
    """What a rank's digest records of one trained batch."""
    return [step, int(row["epoch"]), int(row["index"]), json.loads(row["sample_ids"])]


_SHARED = (
    "step",
    "epoch",
    "index",
    "world_size",
    "digest",
    "resumed_at",
    "restarts",
    "failures_seen",
    "feed_done",
    "best_eval_loss",
    "best_step",
)


def capture_rng(device) -> dict:
    device = torch.device(device)
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        # Only this worker's own device: the set of visible devices may differ after a restart.
        "device": torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.empty(0, dtype=torch.uint8),
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights_only loading refuses; a tensor carries the same numbers.
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
    }


def restore_rng(state: dict, device) -> None:
    device = torch.device(device)
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("device") is not None and state["device"].numel():
        torch.cuda.set_rng_state(state["device"], device)
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))


def save(directory: str, trainer, rank: int, progress: Progress, output_format: str) -> None:
    """Write this rank's part of a checkpoint into ``directory``."""
    torch.save(capture_rng(trainer.device), os.path.join(directory, rng_file(rank)))
    with open(os.path.join(directory, rank_file(rank)), "w") as f:
        json.dump({"batches_done": progress.batches_done, "digest": progress.rank_digest}, f)
    if rank != 0:
        return
    with trainer.optimizer_eval():  # the LoRA as it is used (schedule-free: its average), also the export
        _save_lora(trainer, directory, output_format)
    if trainer.ema:
        os.makedirs(os.path.join(directory, EMA_DIR), exist_ok=True)
        with trainer.eval_weights():
            _save_lora(trainer, os.path.join(directory, EMA_DIR), output_format)
    torch.save(trainer.state_dict(), os.path.join(directory, STATE_FILE))  # in train mode: resume's exact weights
    with open(os.path.join(directory, POSITION_FILE), "w") as f:
        json.dump({k: getattr(progress, k) for k in _SHARED}, f)


def _save_lora(trainer, directory: str, output_format: str) -> None:
    lora.save_diffusers(trainer.transformer, directory)
    if output_format == "kohya":
        kohya.save(trainer.transformer, directory, lora.scale(trainer.transformer))


def restore(directory: str, trainer, rank: int, world_size: int) -> Progress:
    """Load a checkpoint into ``trainer`` and this rank's RNGs; returns where to continue from.

    After an elastic resize a rank may have no saved RNG state of its own: it keeps the fresh seed the trainer gave
    it, and the run goes on from the same step (exactness holds only for an unchanged world size).
    """
    lora.load_into(trainer.transformer, os.path.join(directory, lora.WEIGHT_NAME))
    trainer.load_state_dict(torch.load(os.path.join(directory, STATE_FILE), map_location="cpu", weights_only=True))
    with open(os.path.join(directory, POSITION_FILE)) as f:
        saved = json.load(f)
    progress = Progress(**{k: saved[k] for k in _SHARED if k in saved})
    same_world = int(saved["world_size"]) == world_size
    progress.world_size, progress.feed_done = world_size, False
    if same_world and os.path.exists(os.path.join(directory, rng_file(rank))):
        state = torch.load(os.path.join(directory, rng_file(rank)), map_location="cpu", weights_only=True)
        restore_rng(state, trainer.device)
        with open(os.path.join(directory, rank_file(rank))) as f:
            mine = json.load(f)
        progress.batches_done, progress.rank_digest = int(mine["batches_done"]), mine["digest"]
    return progress


def read_digests(directory: str) -> dict[int, str]:
    """Every rank's batch digest in a checkpoint directory: ``{rank: digest}``."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.startswith("rank-") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                out[int(name[len("rank-") : -len(".json")])] = json.load(f)["digest"]
    return out
