"""Progress display: one line per stage.

- Cache stages show Ray Data's own progress bar, one per pipeline (per-operator bars are turned off, since a user
  cares about images done, not about which operator holds them).
- Training shows one bar of optimizer steps per worker with epoch, loss and ETA. It is fed by a Ray Train callback
  that runs in the train controller and draws through ``ray.experimental.tqdm_ray``, which forwards bars from any
  Ray process to the driver's terminal.
"""

from __future__ import annotations

import ray.train


def quiet_operator_bars() -> None:
    """Keep Ray Data's global bar per pipeline and drop the per-operator ones."""
    from ray.data import DataContext

    DataContext.get_current().enable_operator_progress_bars = False


def steps_per_epoch(counts: dict, world_size: int) -> list[int]:
    """Optimizer steps per worker in each planned epoch (``counts`` as from ``rayflux.train.stage.plan_counts``)."""
    return [counts[e]["batches"] // world_size for e in sorted(counts)]


def epoch_of(step: int, per_epoch: list[int]) -> int:
    """The 1-based epoch that global step ``step`` (1-based, per worker) falls in."""
    done = 0
    for i, n in enumerate(per_epoch):
        done += n
        if step <= done:
            return i + 1
    return len(per_epoch)


def describe(step: int, metrics: dict, per_epoch: list[int]) -> str:
    """The bar's text: ``train epoch 2/3 loss 0.1234``."""
    loss = metrics.get("loss")
    text = f"train epoch {epoch_of(step, per_epoch)}/{len(per_epoch)}"
    return text + (f" loss {loss:.4f}" if isinstance(loss, (int, float)) else "")


class TrainProgress(ray.train.UserCallback):
    """Steps/epoch/ETA bar for the training stage, drawn from the controller after every ``ray.train.report``."""

    def __init__(self, counts: dict, world_size: int, max_steps: int = 0):
        self.per_epoch = steps_per_epoch(counts, world_size)
        total = sum(self.per_epoch)
        self.total = min(total, max_steps) if max_steps else total
        self._bar = None

    def after_report(self, run_context, metrics, checkpoint):
        from ray.experimental import tqdm_ray

        if not metrics or "step" not in metrics[0]:
            return
        step = int(metrics[0]["step"])
        if self._bar is None:
            self._bar = tqdm_ray.tqdm(total=self.total, desc="train", unit="step")
        self._bar.set_description(describe(step, metrics[0], self.per_epoch))
        self._bar.update(max(0, step - self._bar.n))
        if step >= self.total:
            self._bar.close()
            self._bar = None
