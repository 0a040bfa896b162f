"""Where a run is in its batch plan, and when it saves: the rules that keep restarts and resizes exact.

Ray Train restarts the whole worker group after a node loss, a resize of an elastic run or a preemption, and every
restart may have a different world size ``W``. The data feed then re-plans every epoch for the new ``W`` (see
:mod:`rayflux.train.feed`). Each epoch's shuffled batch order does not depend on ``W``; only its tail, cut by the
remainder rule, does. Global step ``s`` of an epoch trains batches ``sW .. sW + W - 1``.

So progress is kept as a world-size-free **cursor**: ``(epoch, index)`` = every batch before ``index`` in that
epoch's order, and every earlier epoch, has been trained. A checkpoint stores it. After a restart with ``W'``
workers, training resumes at the cursor rounded *up* to a multiple of ``W'``; the at most ``W' - 1`` batches skipped
by the rounding are dropped for that epoch, exactly like the remainder rule drops a tail. The rounding is what keeps
every rank at the same number of steps (DDP needs that): rank ``r`` holds the batches ``r, r + W', ...`` of every
epoch, and every rank holds the same number of them below a multiple of ``W'``.

Per-epoch accounting across resizes therefore is: no batch is trained twice, and a batch is only missed when the
remainder rule of the world size in force cuts it, or when a restart's rounding skips it. Steps trained after the
latest checkpoint and before a failure are lost and redone; ``train.checkpoint_every`` bounds them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class Progress:
    """The resumable state of a run, saved in every checkpoint's metrics and restored from the latest one."""

    epoch: int = 0
    index: int = 0
    """The cursor: batches before ``(epoch, index)`` in plan order are done."""
    starts: list = field(default_factory=list)
    """One ``{"step", "world"}`` per worker-group start that got as far as a checkpoint."""
    saves: list = field(default_factory=list)
    """One ``{"step", "world", "reason"}`` per checkpoint: ``interval``, ``preemption`` or ``final``."""

    @classmethod
    def restore(cls, saved: dict | None, step: int, world: int) -> Progress:
        """The progress of a worker group that starts at ``step`` with ``world`` workers."""
        p = cls(**saved) if saved else cls()
        p.starts = [*p.starts, {"step": step, "world": world}]
        return p

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "starts": self.starts, "saves": self.saves}

    def remaining(self, items: Iterable[dict], world: int, steps_left: int | None) -> Iterator[tuple[dict, bool]]:
        """This rank's planned batches still to train, each with ``last``: no batch follows it in this run.

        ``steps_left`` (None: no limit) caps the batches, for ``train.max_steps``. Every rank gets the same number
        of batches, so ``last`` is true on all ranks at the same step.
        """
        start = (self.epoch, _round_up(self.index, world))
        pending, count = None, 0
        for item in items:
            if (int(item["epoch"]), int(item["index"])) < start:
                continue  # trained before the restart (or skipped by the rounding, see the module docstring)
            if steps_left is not None and count >= steps_left:
                break
            if pending is not None:
                yield pending, False
            pending, count = item, count + 1
        if pending is not None:
            yield pending, True

    def advance(self, item: dict, world: int) -> None:
        """After a step in which this rank trained ``item``: the step's ``world`` batches are all done."""
        # Rank r always holds batch indices that are r modulo the world size (epochs and resume points start at
        # multiples of it), so the step's first batch is index - index % world.
        i = int(item["index"])
        self.epoch, self.index = int(item["epoch"]), i - i % world + world

    def saved(self, step: int, world: int, reason: str) -> None:
        self.saves = [*self.saves, {"step": step, "world": world, "reason": reason}]


class SavePolicy:
    """When a step ends in a checkpoint: every ``every`` steps, and once as soon as a preemption is announced.

    Ray Train 2.60 announces a preemption when a node running one of the workers is drained (``ray drain-node``,
    the autoscaler, or rayflux's preemption guard on a spot node). ``ray.train.get_preemption_info()`` is a barrier
    that returns the same answer on every rank, so every rank calls it once per step and they agree to save.
    """

    def __init__(self, every: int):
        self.every = every
        self._preempted = False

    def reason(self, step: int) -> str:
        """Why to checkpoint after ``step``, or ``""``. Call on every rank after every step but the last."""
        import ray.train

        interval = bool(self.every) and step % self.every == 0
        # Older Ray releases lack the preemption notice; their runs resume from the last interval checkpoint.
        notice = getattr(ray.train, "get_preemption_info", None)
        announced = notice is not None and notice() is not None
        if announced and not self._preempted:
            self._preempted = True
            return "preemption"
        return "interval" if interval else ""
