"""Progress display: one line per stage start, one live bar per stage, the summary last.

- Cache stages show Ray Data's own progress bar, one per pipeline (per-operator bars are turned off, since a user
  cares about images done, not about which operator holds them).
- Training shows one bar of optimizer steps (epoch, loss, the latest eval loss, steps/s, ETA). Rank 0 tells a
  :class:`ProgressBoard` actor about each step with a fire-and-forget ``.remote()`` call (at most a few per
  second), and a thread in the driver reads the board every second and draws. The step never waits on the display: an actor call is queued and
  returns at once, whereas ``ray.train.report`` is a barrier of all ranks that Ray Train drains
  only when it polls the workers (every 0.5 s, see ``rayflux.train.stage.POLL_SECONDS``).
- When stdout is not a terminal (CI, ``ray job logs``), the bar becomes a plain line every ``PLAIN_SECONDS``:
  ``train step 120/800 epoch 2/5 loss 0.4100 2.1 step/s ETA 5m``.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

import ray

log = logging.getLogger("rayflux")

PLAIN_SECONDS = 15.0
"""Seconds between plain progress lines when stdout is not a terminal."""
SEND_SECONDS = 0.25
"""Rank 0 tells the board at most this often (and always about the last step)."""


def quiet_operator_bars() -> None:
    """Keep Ray Data's global bar per pipeline and drop the per-operator ones."""
    from ray.data import DataContext

    DataContext.get_current().enable_operator_progress_bars = False


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
    loss, ev = metrics.get("loss"), metrics.get("eval_loss")
    text = f"train epoch {epoch_of(step, per_epoch)}/{len(per_epoch)}"
    text += f" loss {loss:.4f}" if isinstance(loss, (int, float)) else ""
    return text + (f" eval {ev:.4f}" if isinstance(ev, (int, float)) else "")


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m" if seconds >= 60 else f"{seconds}s"


def plain_line(step: int, total: int, metrics: dict, per_epoch: list[int], rate: float) -> str:
    """``train step 120/800 epoch 2/5 loss 0.4100 2.1 step/s ETA 5m``: the bar as one line of plain text."""
    text = f"train step {step}/{total} epoch {epoch_of(step, per_epoch)}/{len(per_epoch)}"
    loss = metrics.get("loss")
    if isinstance(loss, (int, float)):
        text += f" loss {loss:.4f}"
    if isinstance(metrics.get("eval_loss"), (int, float)):
        text += f" eval {metrics['eval_loss']:.4f}"
    if rate > 0:
        text += f" {rate:.2f} step/s ETA {_duration(max(total - step, 0) / rate)}"
    return text


@ray.remote(num_cpus=0)
class ProgressBoard:
    """The latest step record from rank 0; the driver's bar reads it. Holds one small dict, whatever the run's
    length."""

    def __init__(self):
        self.latest: dict = {}

    def update(self, record: dict) -> None:
        self.latest = record

    def read(self) -> dict:
        return self.latest


class BoardSender:
    """Rank 0's side of the board: fire-and-forget updates, at most one per ``SEND_SECONDS`` unless forced."""

    def __init__(self, board):
        self.board, self.last, self.eval_loss = board, 0.0, None

    def send(self, record: dict, force: bool = False) -> None:
        if "eval_loss" in record:
            self.eval_loss = record["eval_loss"]
        elif self.eval_loss is not None:  # the bar keeps showing the latest eval loss between evals
            record = {**record, "eval_loss": self.eval_loss}
        now = time.monotonic()
        if self.board is not None and (force or now - self.last >= SEND_SECONDS):
            self.board.update.remote(record)  # the returned ref is dropped: nothing waits on it
            self.last = now


class TrainBar:
    """The training stage's bar, drawn by a driver thread from a :class:`ProgressBoard`. A context manager: the
    board lives as long as the stage. It counts optimizer steps, as rank 0's records and ``train.max_steps`` do:
    ``per_epoch`` per worker in each planned epoch, ``total`` in the whole run (the plan's
    :attr:`~rayflux.train.plan.TrainPlan.steps_per_epoch` and :attr:`~rayflux.train.plan.TrainPlan.total_steps`)."""

    def __init__(self, per_epoch: list[int], total: int, interactive: bool | None = None):
        self.per_epoch, self.total = per_epoch, total
        self.interactive = sys.stdout.isatty() if interactive is None else interactive
        self.board = None
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self) -> TrainBar:
        from rayflux.connect import on_this_node

        self.board = ProgressBoard.options(**on_this_node()).remote()
        self._thread = threading.Thread(target=self._draw, name="rayflux-train-bar", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.board is not None:
            ray.kill(self.board)

    def _read(self) -> dict:
        try:
            return ray.get(self.board.read.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - a missed frame only delays the bar
            return {}

    def _draw(self) -> None:
        bar, first, last_line, shown = None, None, 0.0, -1
        while True:
            stopping = self._stop.wait(1.0)
            record = self._read()
            step = int(record.get("step", 0))
            if step and first is None:
                first = (step, time.monotonic())  # rates count from the first step seen (a resumed run included)
            rate = (step - first[0]) / max(time.monotonic() - first[1], 1e-9) if first and step > first[0] else 0.0
            if step and self.interactive:
                if bar is None:
                    from tqdm import tqdm

                    bar = tqdm(total=self.total, desc="train", unit="step", dynamic_ncols=True)
                bar.set_description(describe(step, record, self.per_epoch), refresh=False)
                bar.update(max(0, step - bar.n))
            elif step and step != shown and (stopping or time.monotonic() - last_line >= PLAIN_SECONDS):
                log.info("%s", plain_line(step, self.total, record, self.per_epoch, rate))
                last_line, shown = time.monotonic(), step
            if stopping:
                if bar is not None:
                    bar.close()
                return
