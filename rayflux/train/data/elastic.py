"""What changes when the cluster changes under a run: where to resume after a resize, and the preemption notice.

Ray Train restarts the whole worker group after a node loss, an elastic resize or a preemption, and the data feed
re-plans every epoch for the new world size ``W`` (:mod:`rayflux.train.data.feed`). An epoch's shuffled batch order does
not depend on ``W``; only its tail, cut by the remainder rule, does. Optimizer step ``s`` of an epoch trains its
planned batches ``sWA .. (s + 1)WA - 1`` (``A`` = gradient accumulation).

Planned step numbers name different batches for different world sizes, so a restored run resumes by plan position,
which does not depend on ``W``. The checkpoint's position record says *every batch before plan index* ``i`` *of
epoch* ``e`` *is done*. Training resumes at ``i`` rounded **up** to a multiple of ``W'A``; the at most ``W'A - 1``
batches that the rounding skips are dropped for that epoch, as the remainder rule drops a tail. The rounding keeps
every rank at the same number of steps (DDP needs that): rank ``r`` holds batches ``r, r + W', ...`` of each epoch,
and every rank holds the same number of them below a multiple of ``W'A``. With an unchanged world size (and no resize
before) the rounding is a no-op and this is exactly "skip the steps already trained".

The cut happens in the plan itself (:func:`plan_rows`, called by the data feed when the worker group starts), before
anything is read: a resumed run reads no batch it already trained. So across resizes no batch is trained twice, and
one is missed only where the remainder rule of the world size in force cuts it or a restart's rounding skips it.
Optimizer steps keep counting from the restored step; the planned steps of the new plan are shifted by the
difference, the LR schedule's horizon included. Steps trained after the latest committed checkpoint are lost and
redone; ``train.checkpoint.every`` bounds them.
"""

from __future__ import annotations

import logging

from rayflux.train.data import batching
from rayflux.train.plan import FeedPlan

log = logging.getLogger(__name__)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def step_position(group: list[dict], rank: int, world: int) -> dict:
    """The batches one optimizer step trained, on every rank together: plan indices ``index .. index + span - 1``."""
    # Rank r's accumulated batches are plan indices first + r, first + r + W, ...: the step's block starts at first.
    first = int(group[0]["index"]) - rank
    return {"epoch": int(group[0]["epoch"]), "index": first, "span": world * len(group), "world": world}


def resume_point(position: dict | None, world: int, accumulation: int) -> tuple[int, int] | None:
    """``(epoch, plan index)`` where a run with ``world`` workers continues after ``position``, or None."""
    if not position or not int(position.get("step", 0)):
        return None
    return int(position["epoch"]), _round_up(int(position["index"]), world * accumulation)


def plan_rows(refs: list, feed: FeedPlan, world: int, position: dict | None = None) -> list[list[dict]]:
    """Each rank's planned rows for the feed's epochs ``[first, end)``, cut for ``world`` workers at the restored
    ``position`` (a checkpoint's position record; None for a fresh start).

    Every row carries its global optimizer ``step`` (continuing the restored count), the run's ``total_steps`` and
    ``resume_step`` (the restored step, 0 for none), so every rank derives the same schedule without talking."""
    accumulation = feed.accumulation
    start = resume_point(position, world, accumulation)
    restored = int(position["step"]) if start else 0
    per_rank: list[list[dict]] = [[] for _ in range(world)]
    offset = None
    for epoch in range(*feed.epochs):
        planned = batching.plan_epoch(
            refs, feed.batch_size, feed.seed, epoch, world, accumulation, shuffle_block=feed.shuffle_block
        )[0]
        # The remainder rule makes each epoch's batch count a multiple of world * accumulation, so every rank gets
        # the same whole number of optimizer steps, each of `accumulation` consecutive batches.
        steps_per_epoch = len(planned) // (world * accumulation)
        for i, b in enumerate(planned):
            if start and (epoch, i) < start:
                continue  # trained before the checkpoint (or skipped by the rounding): never read
            step = epoch * steps_per_epoch + (i // world) // accumulation + 1
            if offset is None:
                offset = restored - (step - 1)
            per_rank[i % world].append(
                {
                    **b,
                    "step": step + offset,
                    "total_steps": steps_per_epoch * feed.total_epochs + offset,
                    "resume_step": restored,
                }
            )
    if start and start[1] != int(position["index"]) and offset is not None:
        log.info(
            "resuming on %d workers (was %s) at epoch %d, batch %d: %d batches skipped to keep ranks equal",
            world,
            position.get("world_size"),
            start[0],
            start[1],
            start[1] - int(position["index"]),
        )
    return per_rank


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
