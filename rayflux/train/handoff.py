"""The committed generation, handed to a training worker group that may have started before it existed.

The driver starts the worker group while the cache stage runs (:mod:`rayflux.train.early`); the workers load the
base and attach the LoRA, then wait here for what only the committed manifest decides: the trainer run's plan (its
samples, counts and step total), the empty caption and the caption index. A run that starts after the cache stage
(the sequential order) takes the same path, with the generation published before the group starts.

Why an actor: the value appears after the workers are running, and a Ray object cannot be made first and filled
later; an actor holds it, wakes every waiting worker at once, answers a restarted worker group (elastic resizes,
failures) at once, and carries the other answer too: the cache stage failed, so the workers return without training
and the driver raises the cache's own error.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray

if TYPE_CHECKING:  # the actor's process imports this module: it stays light (no torch, no plan modules)
    from rayflux.train.loop_config import LoopConfig
    from rayflux.train.plan import TrainPlan


@dataclass(frozen=True)
class Generation:
    """What a worker group needs of the committed generation (from its manifest, through the driver's plan)."""

    plan: "TrainPlan"
    """The trainer run's plan without its sample list (:meth:`~rayflux.train.plan.TrainPlan.for_workers`)."""
    refs: object
    """An ObjectRef of the plan's samples (its ``refs``): only the feed's ``configure`` reads them, once per group."""
    empty_caption: dict
    """Where the empty caption's embeddings are (:meth:`rayflux.cache.manifest.Manifest.empty_caption`)."""
    caption_tables: tuple[str, ...]
    """The generation's caption index files (kohya metadata's tag counts)."""


@ray.remote(num_cpus=0)
class Handoff:
    """One trainer run's handoff: empty until the driver publishes the generation or cancels the run. It holds the
    generation as an ObjectRef (in a list, which Ray passes as is), never the value, so its process never imports
    what the value is made of."""

    def __init__(self):
        self._ready = asyncio.Event()
        self._value: list = []

    async def publish(self, value: list) -> None:
        self._value = value
        self._ready.set()

    async def cancel(self) -> None:
        """The cache stage failed: every waiting (and later) worker is answered None."""
        self._ready.set()

    async def wait(self) -> list:
        await self._ready.wait()
        return self._value


def start():
    """A trainer run's handoff, on the driver's node (:func:`rayflux.connect.on_this_node`)."""
    from rayflux.connect import on_this_node

    return Handoff.options(**on_this_node()).remote()


def publish(handoff, gen: Generation) -> None:
    """Hand ``gen`` to the run's workers (a driver call)."""
    ray.get(handoff.publish.remote([ray.put(gen)]))


def generation(plan: "TrainPlan", manifest) -> Generation:
    """The handoff's value for ``plan``, made on ``manifest``'s committed generation (a driver call)."""
    from rayflux.cache import index

    return Generation(
        plan=plan.for_workers(),
        refs=ray.put(list(plan.refs)),
        empty_caption=manifest.empty_caption(),
        caption_tables=(index.caption_table(manifest),),
    )


def receive(handoff) -> Generation | None:
    """The published generation, once there is one (a worker waits here); None when the run was cancelled."""
    value = ray.get(handoff.wait.remote())
    return ray.get(value[0]) if value else None


def filled(lc: "LoopConfig", gen: Generation) -> "LoopConfig":
    """The worker's loop config with the generation's parts filled in."""
    return dataclasses.replace(lc, plan=gen.plan, empty_caption=gen.empty_caption, caption_tables=gen.caption_tables)
