"""Weights & Biases logging (``run.wandb_project``, rank 0): the scalars and validation grids TensorBoard gets.

wandb is an optional extra (``pip install 'rayflux[wandb]'``) and is imported only when ``run.wandb_project`` is set,
so a run without it never loads wandb or reaches the network. The driver refuses a missing package before the cache
stage (:func:`check`); rank 0 checks again as it starts, since workers may run in another environment.

A resumed run continues the same wandb run: its id comes from the Ray Train run's storage
(``<output_dir>/checkpoints/<run.name>``), which is what makes a rerun the same run, and it opens with
``resume="allow"``. wandb keeps a run's steps increasing, so the steps a restart retrains after its checkpoint keep
the values the interrupted run logged for them (wandb warns and drops the repeats). ``WANDB_MODE=offline`` and
``WANDB_DIR`` work as wandb documents them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re

from rayflux.train.observe.metrics import REPORTED

EXTRA = "pip install 'rayflux[wandb]'"


def refusal(project: str) -> str:
    """Why ``run.wandb_project`` cannot log here, in one line; empty when it can (or is unset)."""
    if project and importlib.util.find_spec("wandb") is None:
        return f"run.wandb_project={project} needs wandb, which is not installed: {EXTRA}"
    return ""


def check(project: str) -> None:
    """Refuse a missing wandb on the driver, before any cache or training work."""
    reason = refusal(project)
    if reason:
        raise ValueError(reason)


def run_id(run_storage: str, name: str) -> str:
    """The wandb run id of a Ray Train run: the same for every rerun of it, different for another output dir."""
    digest = hashlib.sha256(run_storage.rstrip("/").encode()).hexdigest()[:12]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '-', name)[:48]}-{digest}"


class WandbLog:
    """Rank 0's wandb run: the same scalars (``train/<key>``, ``eval/loss_q<q>``) and images as
    :class:`rayflux.train.observe.metrics.TensorBoardLog`."""

    def __init__(self, project: str, run_storage: str, name: str, config: dict):
        check(project)  # this worker's environment may lack what the driver has
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, id=run_id(run_storage, name), name=name, resume="allow", config=config)

    def scalars(self, step: int, values: dict) -> None:
        row = {f"train/{key}": values[key] for key in REPORTED if key in values}
        for q, v in zip(values.get("eval_quantiles", ()), values.get("eval_loss_sigmas", ())):
            row[f"eval/loss_q{q:g}"] = v
        if row:
            self.run.log(row, step=step)

    def image(self, step: int, tag: str, image) -> None:
        """``image``: a PIL image."""
        self.run.log({tag: self.wandb.Image(image.convert("RGB"))}, step=step)

    def close(self) -> None:
        self.run.finish()


class Both:
    """TensorBoard and wandb as one log: what the training loop writes goes to each."""

    def __init__(self, tensorboard, wandb_run: WandbLog):
        self.tensorboard, self.wandb_run = tensorboard, wandb_run

    def scalars(self, step: int, values: dict) -> None:
        self.tensorboard.scalars(step, values)
        self.wandb_run.scalars(step, values)

    def image(self, step: int, tag: str, image) -> None:
        self.tensorboard.image(step, tag, image)
        self.wandb_run.image(step, tag, image)

    def flush(self) -> None:
        self.tensorboard.flush()  # wandb streams to its own service process; nothing to push at a checkpoint

    def close(self) -> None:
        self.tensorboard.close()
        self.wandb_run.close()
