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
host's methods has a thread of its own (a Ray concurrency group), so image batches waiting there can never take the
thread a text batch or the end of the text pass needs. The build kills the hosts once both passes are done, or
either fails, so no encoder outlives the cache stage.

A host that dies (its process killed, out of memory, its node lost) comes back, as a pool's actor does: Ray restarts
it (up to :data:`RESTARTS` times) and hands the restarted process the calls the dead one held, so each of its batches
is encoded again from its pixels or caption and returned once; a batch's encoding reaches the writers only through
the call that returns it, so nothing is lost or written twice. The new process starts as the first one did, with no
encoder loaded and the text pass not over; the build's :class:`Lifelines` thread sees the death and, if the text
pass has ended, tells the new process so, which lets the image batches it holds through. A host that Ray may not
restart again is gone: its batches go to the next host, and once every host is gone the build fails with an error
that says so and gives Ray's cause of the last death (an encoder that does not fit in memory kills its host at each
start, which must end the build, not loop).
"""

from __future__ import annotations

import gc
import hashlib
import logging
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from rayflux.cache.fit import Plan
from rayflux.cache.stall import CacheStallError

log = logging.getLogger(__name__)
T = TypeVar("T")

CALLS_PER_HOST = 2
"""Encode tasks of one pass in flight per host: one encoding, one waiting with its batch."""

RESTARTS = 3
"""Times Ray restarts a host that died (Ray Data restarts a pool's actors too): enough for a killed process or a lost
node, few enough that a host dying at every start (an encoder too big for its memory) ends the build within a few
starts."""

NAME = "rayflux-encoder-host"
"""Each host's Ray name begins so (see :meth:`Hosts.start`)."""

METHODS = ("encode_text", "encode_images", "end_text", "lifeline")
"""The host's methods' threads (concurrency groups), one each; ``lifeline`` has two (see :class:`Lifelines`)."""


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
        self.encoded = {"captions": 0, "images": 0}
        """Batches this process has encoded, by pass (see :meth:`report`)."""

    def encode_text(self, batch: dict) -> dict:
        from rayflux.cache.encoders import TextEncoder

        with self.lock:
            if self.text_over.is_set():
                raise RuntimeError("a caption batch reached the encoder host after the text pass ended")
            if self.text is None:
                self.text = TextEncoder(**self.text_args)
            out = self.text(batch)
            self.encoded["captions"] += 1
            return out

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
            out = self.vae(batch)
            self.encoded["images"] += 1
            return out

    def report(self) -> dict:
        """This process's id and the batches it has encoded by pass (a restarted host answers once it runs, see
        :class:`Lifelines`)."""
        import os

        return {"pid": os.getpid(), **self.encoded}

    def lifeline(self) -> None:
        """Never returns: the call fails when this process dies, which is how the build learns of it."""
        threading.Event().wait()


@dataclass
class Hosts:
    """The build's encoder hosts."""

    actors: list
    ready: list
    """One reference per host, ready once Ray has started it."""
    resources: dict
    lifelines: Lifelines

    @staticmethod
    def start(count: int, resources: dict, text: dict, vae: dict, build: str) -> Hosts:
        """``count`` hosts of ``resources`` each (one encoder actor's Ray options), each restarted by Ray up to
        :data:`RESTARTS` times, with every call it held when it died handed to the restarted process (the calls are
        pure: a batch in, its encoding out). Named ``rayflux-encoder-host-<build>-<i>`` (``build``: the build's
        encode id), so that a person or a test can find one and ask for its :meth:`EncoderHost.report`."""
        import ray

        groups = {**dict.fromkeys(METHODS, 1), "lifeline": 2}  # waiting image batches block nothing else
        options = {"max_concurrency": 1, "concurrency_groups": groups, "max_restarts": RESTARTS, "max_task_retries": -1}
        cls = ray.remote(**options, **resources)(EncoderHost)
        actors = [cls.options(name=f"{NAME}-{build}-{i}").remote(text, vae) for i in range(count)]
        return Hosts(actors, [a.__ray_ready__.remote() for a in actors], resources, Lifelines.follow(actors))

    def end_text(self) -> None:
        """Every host drops its text encoders and starts on images (after the text pass, whether it failed or not:
        image batches waiting in a host must not wait for ever), and so will any host Ray restarts from now on. Not
        waited for: a host Ray never started (a stalled stage) would never answer; a host that died has nothing to
        end."""
        self.lifelines.text_ended()

    def pending(self) -> str:
        """What a stall report adds: how many hosts Ray has not started, and what each needs ("" when all run)."""
        import ray

        _, waiting = ray.wait(self.ready, num_returns=len(self.ready), timeout=0)
        if not waiting:
            return ""
        return f" | EncoderHost (text then VAE encoder): {len(waiting)} of {len(self.actors)} not started, each needs {self.resources}"

    def step(self, method: str, key: str) -> dict:
        """``map_batches`` arguments of a pass's encode step: a task per batch, on no CPU of its own (the host holds
        the encoder's), at most :data:`CALLS_PER_HOST` per host at once."""
        from ray.data import TaskPoolStrategy

        # The cap counts calls per host, not throughput: a pass with fewer batches than it is the usual small build,
        # which Ray Data would warn about on the user's terminal each time.
        warnings.filterwarnings(
            "ignore", message="The maximum number of concurrent tasks for 'MapBatches", category=UserWarning
        )
        return {
            "fn": on_host,
            "fn_kwargs": {"hosts": self.actors, "method": method, "key": key},
            "num_cpus": 0,
            "compute": TaskPoolStrategy(size=CALLS_PER_HOST * len(self.actors)),
        }


class Lifelines(threading.Thread):
    """The driver's thread that learns of each host's death and tells a restarted host what its first process knew.

    Each host holds one ``lifeline`` call that never returns; it fails when the process dies. Then a ``report`` call
    waits for the restarted process (Ray queues it while the host restarts, and fails it once the host is gone for
    good); once it answers, the host gets a new lifeline, and ``end_text`` again if the text pass has ended (ending it
    twice is harmless; an end the dead process got is lost with it)."""

    def __init__(self, actors: list):
        super().__init__(name="rayflux-cache-hosts", daemon=True)
        self.actors = actors
        self.over = False
        """Whether the text pass has ended (every host, and every restarted one, is told)."""
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.calls: dict = {}
        """Each call being waited for: its reference -> (host index, what it is: "lifeline" or "report")."""

    @staticmethod
    def follow(actors: list) -> Lifelines:
        lines = Lifelines(actors)
        for i in range(len(actors)):
            lines._hold(i)
        lines.start()
        return lines

    def text_ended(self) -> None:
        with self.lock:
            self.over = True
            for h in self.actors:
                _call(h, "end_text")

    def stop(self) -> None:
        """Stop following: the build is about to kill its hosts, and those deaths are its own (their lifelines fail
        at once, so the thread ends without waiting out its poll)."""
        self.stopping.set()

    def run(self) -> None:
        import ray

        while self.calls and not self.stopping.is_set():
            ready, _ = ray.wait(list(self.calls), num_returns=1, timeout=0.5)
            for ref in ready:
                i, what = self.calls.pop(ref)
                try:
                    report = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._died(i, what, exc)
                else:  # the restarted process answers: follow it, and hand it the end of the text pass if it came
                    log.warning("cache: encoder host %d runs again (pid %d)", i, report["pid"])
                    self._hold(i)

    def _died(self, i: int, what: str, exc: BaseException) -> None:
        if self.stopping.is_set():
            return
        if what == "report":  # no restart is left: the host's calls fail, and on_host says so
            log.error("cache: encoder host %d is gone after %d restarts: %s", i, RESTARTS, cause(exc))
            return
        log.warning(
            "cache: encoder host %d died (%s); Ray restarts it (%d times a build at most) and hands it the batches it "
            "held",
            i,
            cause(exc),
            RESTARTS,
        )
        self.calls[_call(self.actors[i], "report", lifeline=True)] = (i, "report")

    def _hold(self, i: int) -> None:
        """Hand host ``i`` (its current process) a lifeline, and the end of the text pass if it has come."""
        with self.lock:
            self.calls[_call(self.actors[i], "lifeline", lifeline=True, retries=0)] = (i, "lifeline")
            if self.over:
                _call(self.actors[i], "end_text")


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
    except Exception as exc:  # every host gone: said as itself, not as Ray Data's wrapper of it
        gone = _hosts_gone(exc)
        if gone is None:
            raise
        raise EncoderHostsGone(gone) from exc
    finally:
        if hosts is not None and text:
            hosts.end_text()


def kill(hosts: Hosts | None) -> None:
    """Kill every host for good (``None``: no hosts, nothing to do)."""
    import ray

    if hosts is None:
        return
    hosts.lifelines.stop()
    for h in hosts.actors:
        ray.kill(h, no_restart=True)
    hosts.lifelines.join()


def on_host(batch: dict, hosts: list, method: str, key: str) -> dict:
    """Ray Data batch function: encode ``batch`` on one of ``hosts`` (chosen by its first ``key``, so batches spread
    over them) with the host's ``method``. A host that dies is restarted and given the call again (by Ray); where a
    host is gone for good, the next one takes the batch."""
    import ray

    first = str(batch[key][0]) if len(batch[key]) else ""
    start = int(hashlib.sha256(first.encode()).hexdigest()[:8], 16) % len(hosts)
    errors = []
    for i in range(len(hosts)):
        try:
            return ray.get(_call(hosts[(start + i) % len(hosts)], method, batch))
        except ray.exceptions.RayActorError as exc:
            errors.append(exc)
    raise EncoderHostsGone(
        f"cache: every encoder host ({len(hosts)}) is gone: each died again after Ray restarted it {RESTARTS} times "
        f"(rayflux.cache.host.RESTARTS); the last death, as Ray gives its cause: {cause(errors[-1])}"
    ) from errors[-1]


class EncoderHostsGone(RuntimeError):
    """Every encoder host of the build died more often than Ray may restart it."""


def _hosts_gone(exc: BaseException) -> str | None:
    """The message of the :class:`EncoderHostsGone` an encode task raised, if it did. Ray Data hands the driver its
    batch function's error only as text (its ``UserCodeException`` keeps no cause), so the message is found after
    the class's name in the text of each error in the chain."""
    marker = f"{EncoderHostsGone.__module__}.{EncoderHostsGone.__name__}: "
    seen: set[int] = set()
    todo: list = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, EncoderHostsGone):
            return str(e)
        found = [line[len(marker) :] for line in str(e).splitlines() if line.startswith(marker)]
        if found:
            return found[-1]
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
    return None


def cause(exc: BaseException) -> str:
    """Ray's cause of an actor's death, in one line: the last line of its error (the exit type and detail, or the
    creation task's error)."""
    lines = str(exc).strip().splitlines()
    return lines[-1].strip() if lines else repr(exc)


def _call(actor, method: str, *args, lifeline: bool = False, retries: int | None = None):
    """``actor.method(*args)`` on that method's own thread (see :data:`METHODS`); ``lifeline``: on the lifeline
    threads; ``retries``: instead of the host's (0: the call fails when the process dies)."""
    options = {"concurrency_group": "lifeline" if lifeline else method}
    if retries is not None:
        options["max_task_retries"] = retries
    return getattr(actor, method).options(**options).remote(*args)


def _empty_cuda_cache() -> None:
    """Hand CUDA's cached blocks back to the device, where torch has initialised CUDA in this process."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
