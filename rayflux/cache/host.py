"""One encoder process for both cache passes, where their two pools would take the same resources in turn.

Where the text and VAE pools exclude each other (:mod:`rayflux.cache.fit`: VAE after text, or sequential) and both
are of one fixed size, two pools start two rounds of processes: the VAE actors start only once the text actors have
gone, and each pays a process start and the imports of torch and the model's code again (about 5 s measured on two
cores). Instead the build starts that many encoder hosts (:class:`EncoderHost`), each holding one encoder actor's
resources for the whole build, and each pass's encode step becomes a task that hands its batch to a host and
returns what the host encoded; the rest of both pipelines (preparation, batch sizes, writers) is unchanged.

A host encodes text first. Image batches that reach it meanwhile wait there, holding nothing but their pixels (the
calling tasks are capped at two per host), until the text pass has ended and the host has dropped its text
encoders: as with two pools, the text encoders and the VAE are never loaded in one process at once. The build kills
the hosts once both passes are done, so no encoder outlives the cache stage.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import threading
from dataclasses import dataclass

from rayflux.cache.fit import Plan

log = logging.getLogger(__name__)

CALLS_PER_HOST = 2
"""Encode tasks of one pass in flight per host: one encoding, one waiting with its batch."""


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
        with self.lock:
            self.text = None
            gc.collect()
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

    @staticmethod
    def start(count: int, resources: dict, text: dict, vae: dict) -> Hosts:
        """``count`` hosts of ``resources`` each (one encoder actor's Ray options)."""
        import ray

        cls = ray.remote(max_concurrency=1 + CALLS_PER_HOST * 2, **resources)(EncoderHost)
        return Hosts([cls.remote(text, vae) for _ in range(count)])

    def end_text(self) -> None:
        """Every host drops its text encoders and starts on images (after the text pass, whether it failed or not:
        image batches waiting in a host must not wait for ever)."""
        import ray

        for h in self.actors:
            try:
                ray.get(h.end_text.remote())
            except ray.exceptions.RayActorError as exc:  # a host that died: the pass that used it has failed already
                log.warning("cache: an encoder host is gone: %s", exc)

    def kill(self) -> None:
        import ray

        for h in self.actors:
            ray.kill(h)

    def step(self, method: str, key: str) -> dict:
        """``map_batches`` arguments of a pass's encode step: a task per batch, on no CPU of its own (the host holds
        the encoder's), at most :data:`CALLS_PER_HOST` per host at once."""
        return {
            "fn": on_host,
            "fn_kwargs": {"hosts": self.actors, "method": method, "key": key},
            "num_cpus": 0,
            "concurrency": CALLS_PER_HOST * len(self.actors),
        }


def on_host(batch: dict, hosts: list, method: str, key: str) -> dict:
    """Ray Data batch function: encode ``batch`` on one of ``hosts`` (chosen by its first ``key``, so batches spread
    evenly over them) with the host's ``method``."""
    import ray

    first = str(batch[key][0]) if len(batch[key]) else ""
    host = hosts[int(hashlib.sha256(first.encode()).hexdigest()[:8], 16) % len(hosts)]
    return ray.get(getattr(host, method).remote(batch))
