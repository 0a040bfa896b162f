"""What changes when the cluster changes under a run: where to resume after a resize, and the preemption notice.

Ray Train restarts the whole worker group after a node loss, an elastic resize or a preemption, and the data feed
re-plans every epoch for the new world size ``W`` (:mod:`rayflux.train.feed`). An epoch's shuffled batch order does
not depend on ``W``; only its tail, cut by the remainder rule, does. Optimizer step ``s`` of an epoch trains its
planned batches ``sWA .. (s + 1)WA - 1`` (``A`` = gradient accumulation).

Planned step numbers name different batches for different world sizes, so a restored run resumes by plan position,
which does not depend on ``W``. The last step in the checkpoint's history says *every batch before plan index* ``i``
*of epoch* ``e`` *is done*. Training resumes at ``i`` rounded **up** to a multiple of ``W'A``; the at most
``W'A - 1`` batches that the rounding skips are dropped for that epoch, as the remainder rule drops a tail. The
rounding keeps every rank at the same number of steps (DDP needs that): rank ``r`` holds batches ``r, r + W', ...``
of each epoch, and every rank holds the same number of them below a multiple of ``W'A``. With an unchanged world size
(and no resize before) the rounding is a no-op and this is exactly "skip the steps already trained".

So across resizes no batch is trained twice, and one is missed only where the remainder rule of the world size in
force cuts it or a restart's rounding skips it. Optimizer steps keep counting from the restored step; the planned
steps of the new plan are shifted by the difference (``offset``), the LR schedule's horizon included. Steps trained
after the latest checkpoint are lost and redone; ``train.checkpoint_every`` bounds them.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Iterable, Iterator

log = logging.getLogger(__name__)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def step_position(group: list[dict], rank: int, world: int) -> dict:
    """The batches one optimizer step trained, on every rank together: plan indices ``index .. index + span - 1``."""
    # Rank r's accumulated batches are plan indices first + r, first + r + W, ...: the step's block starts at first.
    first = int(group[0]["index"]) - rank
    return {"epoch": int(group[0]["epoch"]), "index": first, "span": world * len(group), "world": world}


def resume_rows(
    rows: Iterable[dict], directory: str | None, metrics_file: str, world: int, accumulation: int
) -> tuple[Iterator[dict], int, bool]:
    """``(rows, offset, positioned)``: the rows to train after restoring ``directory`` with ``world`` workers.

    ``positioned`` is False when there is no position to resume from (no checkpoint, nothing trained yet, or a
    checkpoint from before positions were recorded: the caller skips by planned step then). ``offset`` is what to add
    to the new plan's step numbers to continue the restored step count.
    """
    rows = iter(rows)
    if directory is None:
        return rows, 0, False
    with open(os.path.join(directory, metrics_file)) as f:
        saved = json.load(f)
    done = [h for h in saved["history"] if "span" in h]
    if not done:
        return rows, 0, False
    last = done[-1]
    epoch, index = int(last["epoch"]), int(last["index"]) + int(last["span"])
    start = (epoch, _round_up(index, world * accumulation))
    remaining = (r for r in rows if (int(r["epoch"]), int(r["index"])) >= start)
    head = next(remaining, None)
    if head is None:
        return iter(()), 0, True
    offset = int(saved["step"]) - (int(head["step"]) - 1)
    if start[1] != index:
        log.info("resuming on %d workers (was %d) at epoch %d, batch %d: %d batches skipped to keep ranks equal",
                 world, saved["world_size"], start[0], start[1], start[1] - index)  # fmt: skip
    return itertools.chain([head], remaining), offset, True


class PreemptionNotice:
    """Whether Ray Train has told this worker that a node of its group is being preempted.

    Ray Train 2.60 announces it when such a node is drained for preemption (``ray drain-node``, SIGTERM to a
    ``ray start --block`` node, or rayflux's spot guard), by setting it on every worker. ``local()`` reads this
    worker's copy without a barrier; the loop folds it into the all-reduce it does every step anyway, so every rank
    agrees at the same step. (``ray.train.get_preemption_info()`` would agree the same way, at the price of a Ray
    actor round trip per step; it is used only where the worker-side copy cannot be read.)
    """

    def __init__(self):
        import ray.train

        self._public = getattr(ray.train, "get_preemption_info", None)  # older Ray releases have no notice at all
        try:
            from ray.train.v2._internal.execution.context import get_train_context

            self._context = get_train_context().preemption_context
        except (ImportError, AttributeError):
            self._context = None

    def local(self) -> bool:
        """This worker's view; the caller must agree on it across ranks (every rank calls this once per step)."""
        if self._context is not None:
            return self._context.preemption_info is not None
        return self._public is not None and self._public() is not None
