"""One encoder process for both cache passes, where their two pools would take the same resources in turn.

Where the text and VAE pools exclude each other (:mod:`rayflux.cache.fit`: VAE after text, or sequential) and both
are of one fixed size, two pools start two rounds of processes: the VAE actors start only once the text actors have
gone, and each pays a process start and the imports of torch and the model's code again (about 5 s measured on two
cores). Instead the build starts that many encoder hosts (:class:`EncoderHost`), each holding one encoder actor's
resources for the whole build, and each pass's encode step becomes a task that hands its batch to a host and
returns what the host encoded; the rest of both pipelines (preparation, batch sizes, writers) is unchanged.

A host encodes text first. Image batches that reach it meanwhile wait there, holding nothing but their pixels (the
calling tasks are capped at two per host), until the text pass has ended and the host has dropped its text
encoders: as with two pools, the text encoders and the VAE are never loaded in one process at once. Each of the
host's three methods has a thread of its own (a Ray concurrency group), so image batches waiting there can never take
the thread a text batch or the end of the text pass needs. The build kills the hosts once both passes are done, or
either fails, so no encoder outlives the cache stage.

Unlike a pool's actor, a host is not restarted when it dies: a restarted host could not know whether the text pass
had ended. A batch whose host is gone goes to the next living host instead, and the pass fails with a plain error
only once every host is gone.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from rayflux.cache.fit import Plan
from rayflux.cache.stall import CacheStallError

log = logging.getLogger(__name__)
T = TypeVar("T")

CALLS_PER_HOST = 2
"""Encode tasks of one pass in flight per host: one encoding, one waiting with its batch."""

METHODS = ("encode_text", "encode_images", "end_text")
"""The host's methods, each with a thread (concurrency group) of its own."""


def wanted(plan: Plan) -> bool:
    """Whether one process per encoder slot runs both passes: the pools exclude each other (so they would run in
    turn on the same resources) and are of one size that does not grow (so the hosts are the actors either pool
    starts with and would ever have)."""
    from rayflux.cache import fit

    return plan.encoders != fit.SIDE_BY_SIDE and plan.vae == plan.text and plan.vae.initial == plan.vae.max


class EncoderHost:
    """A Ray actor (threaded: image batches wait while text batches encode) that runs the text encoder, then the
    VAE encoder, of one build (:class:`rayflux.cache.encoders.TextEncoder` and ``VaeEncoder``, built from their
    keyword arguments); one batch encodes at a time, as in a pool's actor."""

    def __init__(self, text: dict, vae: dict):
        self.text_args, self.vae_args = text, vae
        self.text = self.vae = None
        self.text_over = threading.Event()
        self.lock = threading.Lock()

    def encode_text(self, batch: dict) -> dict:
        from rayflux.cache.encoders import TextEncoder

        with self.lock:
            if self.text_over.is_set():
                raise RuntimeError("a caption batch reached the encoder host after the text pass ended")
            if self.text is None:
                self.text = TextEncoder(**self.text_args)
            return self.text(batch)

    def end_text(self) -> None:
        """The text pass is over: drop the text encoders, then let the image batches through."""
        from rayflux import allocator

        with self.lock:
            loaded, self.text = self.text is not None, None
            gc.collect()
            if loaded:  # hand the text encoders' memory back before the VAE loads
                allocator.trim()
                _empty_cuda_cache()
        self.text_over.set()

    def encode_images(self, batch: dict) -> dict:
        from rayflux.cache.encoders import VaeEncoder

        self.text_over.wait()
        with self.lock:
            if self.vae is None:
                self.vae = VaeEncoder(**self.vae_args)
            return self.vae(batch)


@dataclass
class Hosts:
    """The build's encoder hosts."""

    actors: list
    ready: list
    """One reference per host, ready once Ray has started it."""
    resources: dict

    @staticmethod
    def start(count: int, resources: dict, text: dict, vae: dict) -> Hosts:
        """``count`` hosts of ``resources`` each (one encoder actor's Ray options)."""
        import ray

        groups = dict.fromkeys(METHODS, 1)  # a thread per method: waiting image batches block nothing else
        cls = ray.remote(max_concurrency=1, concurrency_groups=groups, **resources)(EncoderHost)
        actors = [cls.remote(text, vae) for _ in range(count)]
        return Hosts(actors, [a.__ray_ready__.remote() for a in actors], resources)

    def end_text(self) -> None:
        """Every host drops its text encoders and starts on images (after the text pass, whether it failed or not:
        image batches waiting in a host must not wait for ever). Not waited for: a host Ray never started (a
        stalled stage) would never answer; a host that died has nothing to end."""
        for h in self.actors:
            _call(h, "end_text")

    def pending(self) -> str:
        """What a stall report adds: how many hosts Ray has not started, and what each needs ("" when all run)."""
        import ray

        started, waiting = ray.wait(self.ready, num_returns=len(self.ready), timeout=0)
        if not waiting:
            return ""
        return f" | EncoderHost (text then VAE encoder): {len(waiting)} of {len(self.actors)} not started, each needs {self.resources}"

    def step(self, method: str, key: str) -> dict:
        """``map_batches`` arguments of a pass's encode step: a task per batch, on no CPU of its own (the host holds
        the encoder's), at most :data:`CALLS_PER_HOST` per host at once."""
        return {
            "fn": on_host,
            "fn_kwargs": {"hosts": self.actors, "method": method, "key": key},
            "num_cpus": 0,
            "concurrency": CALLS_PER_HOST * len(self.actors),
        }


def run_pass(hosts: Hosts | None, one_pass: Callable[[], T], text: bool) -> T:
    """``one_pass()``; with hosts, a stall's report says which hosts Ray has not started, and the end of the text
    pass (``text``, whatever its outcome) is handed to every host."""
    try:
        return one_pass()
    except CacheStallError as exc:
        note = hosts.pending() if hosts is not None else ""
        if not note:
            raise
        raise CacheStallError(f"{exc}{note}") from exc
    finally:
        if hosts is not None and text:
            hosts.end_text()


def kill(hosts: Hosts | None) -> None:
    """Kill every host (``None``: no hosts, nothing to do)."""
    import ray

    for h in hosts.actors if hosts is not None else []:
        ray.kill(h)


def on_host(batch: dict, hosts: list, method: str, key: str) -> dict:
    """Ray Data batch function: encode ``batch`` on one of ``hosts`` (chosen by its first ``key``, so batches spread
    over them) with the host's ``method``; where that host is gone, on the next living one."""
    import ray

    first = str(batch[key][0]) if len(batch[key]) else ""
    start = int(hashlib.sha256(first.encode()).hexdigest()[:8], 16) % len(hosts)
    errors = []
    for i in range(len(hosts)):
        try:
            return ray.get(_call(hosts[(start + i) % len(hosts)], method, batch))
        except ray.exceptions.RayActorError as exc:
            errors.append(exc)
    raise RuntimeError(f"cache: every encoder host ({len(hosts)}) died; the last error: {errors[-1]}") from errors[-1]


def _call(actor, method: str, *args):
    """``actor.method(*args)`` on that method's own thread (see :data:`METHODS`)."""
    return getattr(actor, method).options(concurrency_group=method).remote(*args)


def _empty_cuda_cache() -> None:
    """Hand CUDA's cached blocks back to the device, where torch has initialised CUDA in this process."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
