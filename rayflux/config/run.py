"""The ``run`` section: where the run writes its outputs and which Ray cluster it joins."""

from __future__ import annotations

from dataclasses import dataclass, field

from rayflux.config.identity import UNTRACKED


@dataclass
class RunConfig:
    """Where the run writes its outputs."""

    output_dir: str = field(default="runs/demo", metadata=UNTRACKED)
    """Run directory: LoRA, checkpoints, ledger and logs. A rerun with the same directory continues the run."""
    name: str = field(default="rayflux", metadata=UNTRACKED)
    """Ray Train run name under ``<output_dir>/checkpoints``."""
    ray_address: str = field(default="", metadata=UNTRACKED)
    """Ray cluster to join. Empty: ``RAY_ADDRESS``, else a running local head, else a new local Ray (without the
    dashboard; ``local`` always starts one)."""
    lease_seconds: float = field(default=60.0, metadata=UNTRACKED)
    """How long a job's lease on its run directory and cache keys outlives its last heartbeat (renewed every quarter
    of this). A second job on the same ``output_dir`` refuses while the lease is live. A holder that died on the same
    machine (killed, out of memory) is taken over at once; one on another machine (its node lost) this long after its
    last heartbeat. Keep it well above the clock skew between machines sharing the directory."""
    wandb_project: str = field(default="", metadata=UNTRACKED)
    """Weights & Biases project to log to as well (rank 0: the scalars, eval losses and validation grids TensorBoard
    gets). Needs ``pip install 'rayflux[wandb]'``; ``WANDB_MODE``/``WANDB_DIR``/``WANDB_API_KEY`` apply as usual. A
    resumed run continues the same wandb run. Empty: off, and wandb is never imported."""
    debug_slow_rank: str = field(default="", metadata=UNTRACKED)
    """``RANK:SECONDS`` delays every step of one training rank, to shake out ordering races. Empty: off."""
