"""Fail a cache pipeline that stops making progress, with what Ray Data says is pending, instead of waiting forever.

Ray Data waits without end for work it cannot schedule (an actor no node can hold, a task left no CPU). The driver's
iteration over the write tasks' results is wrapped by :func:`watch`: a monitor thread follows the running streaming
executors' counters (task outputs, finished tasks, rows handed on) and, when none moves for ``seconds``, raises
:class:`CacheStallError` in the iterating thread. Ray Data's own iterator then shuts its executor down, so the
stage's actors and tasks are released.

A build runs its text and image pipelines side by side, each iterated by its own thread under its own watch. Both
watches follow every executor of the process, so a pipeline waiting for actors that the other pipeline's actors hold
is not stalled while the other one moves. Both share a ``stop`` event: when one pipeline fails, the other's watch
raises :class:`PipelineStopped` in its thread the same way, within a second (and, at the latest, instead of handing
on its next row), and its executor shuts down too.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterable, Iterator

STALL_CONFIG = "rayflux.cache.stall_seconds"
"""``DataContext`` config key that carries ``cache.stall_seconds`` to :func:`watch`."""
DEFAULT_SECONDS = 600.0


class CacheStallError(RuntimeError):
    """A cache pipeline made no progress for ``cache.stall_seconds``."""


class PipelineStopped(RuntimeError):
    """Another pipeline of the same build failed, so this one was stopped (its error is the one to report)."""


def _executors() -> list:
    """Ray Data's running streaming executors (each is a thread of this process)."""
    try:
        from ray.data._internal.execution.streaming_executor import StreamingExecutor
    except ImportError:  # a Ray without it: progress is then the rows the driver receives
        return []
    return [t for t in threading.enumerate() if isinstance(t, StreamingExecutor)]


def _progress(rows: int) -> tuple:
    marks = [rows]
    for ex in _executors():
        for op in getattr(ex, "_topology", None) or {}:
            m = op.metrics
            marks += [
                getattr(m, name, 0)
                for name in (
                    "num_task_outputs_generated",
                    "num_tasks_finished",
                    "num_outputs_taken",
                    "num_inputs_received",
                )
            ]
    return tuple(marks)


def pending_report() -> str:
    """Each running operator's state as Ray Data formats it, and the cluster's free resources."""
    parts = []
    for ex in _executors():
        try:
            from ray.data._internal.execution.streaming_executor_state import format_op_state_summary

            for op, state in (ex._topology or {}).items():
                parts.append(f"{op.name}: {format_op_state_summary(state, ex._resource_manager)}")
        except Exception as exc:  # private structures: say what could not be read rather than fail the report
            parts.append(f"(operator states unavailable: {exc})")
    try:
        import ray

        free = {k: round(v, 3) for k, v in sorted(ray.available_resources().items()) if "memory" not in k}
        total = {k: round(v, 3) for k, v in sorted(ray.cluster_resources().items()) if "memory" not in k}
        parts.append(f"free {free} of {total}")
    except Exception as exc:
        parts.append(f"(cluster resources unavailable: {exc})")
    return " | ".join(parts)


class Interrupted(BaseException):
    """What the monitor raises asynchronously in the iterating thread, carrying the error to report in ``error``.

    A BaseException, so that no ``except Exception`` the thread happens to be in when it lands (in Ray Data's
    iterator, in a logging handler) can swallow it; :func:`watch` raises ``error`` in its place, and a consumer that
    catches it between two rows (outside the watch's frame) does the same."""

    error: Exception


def _interrupt(error) -> type[Interrupted]:
    """An Interrupted class (async exceptions are raised as classes) whose instances carry ``error()``."""

    class _Interrupt(Interrupted):
        def __init__(self):
            super().__init__()
            self.error = error()

    return _Interrupt


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


class _Monitor:
    """The watch's thread: interrupts the consuming thread when its pipeline stalls, or when ``stop`` is set."""

    def __init__(self, name: str, seconds: float, stop: threading.Event | None):
        self.name, self.seconds, self.stop = name, seconds, stop
        self.consumer = threading.get_ident()
        self.done = threading.Event()
        self.rows, self.message = 0, ""
        self.stalled = _interrupt(lambda: CacheStallError(self.message))
        self.stop_message = f"{name}: stopped because another pipeline of the build failed"
        self.stopped = _interrupt(lambda: PipelineStopped(self.stop_message))
        # Held while the monitor raises, and by the consumer while it marks itself done: once ``done`` is set,
        # nothing more is raised, so the consumer's cleanup (closing Ray Data's iterator) is never interrupted.
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="rayflux-stall-watch", daemon=True)

    def _interrupt(self, exc: type[Interrupted]) -> None:
        with self.lock:
            if not self.done.is_set():
                _raise_in(self.consumer, exc)

    def _run(self) -> None:
        mark, since = _progress(0), time.monotonic()
        while not self.done.wait(min(0.5, self.seconds / 4)):
            if self.stop is not None and self.stop.is_set():
                self._interrupt(self.stopped)
                return
            now = _progress(self.rows)
            if now != mark:
                mark, since = now, time.monotonic()
            elif time.monotonic() - since >= self.seconds:
                self.message = (
                    f"{self.name}: no progress for {self.seconds:g} s (cache.stall_seconds); "
                    f"pending: {pending_report()}"
                )
                self._interrupt(self.stalled)
                return

    def finish(self) -> None:
        """Mark the consumer done (no interrupt after this), dropping one sent but not delivered yet."""
        while not self.done.is_set():
            try:
                with self.lock:
                    self.done.set()  # first, so that the monitor never stops this pipeline for the event below
                    _raise_in(self.consumer, None)
            except Interrupted:  # delivered just now, as the pipeline was ending anyway
                pass


def watch(
    rows: Iterable, seconds: float | None = None, name: str = "cache", stop: threading.Event | None = None
) -> Iterator:
    """Yield from ``rows``; raise CacheStallError when nothing progresses for ``seconds`` (default: the value the
    cache stage put in ``DataContext`` under :data:`STALL_CONFIG`), and PipelineStopped once ``stop`` is set. When
    the iteration ends early for any reason (an error raised by the consumer included), ``stop`` is set."""
    if seconds is None:
        from ray.data import DataContext

        seconds = float(DataContext.get_current().get_config(STALL_CONFIG, DEFAULT_SECONDS))
    monitor = _Monitor(name, seconds, stop)
    it = iter(rows)
    monitor.thread.start()
    finished = False
    try:
        for row in it:
            if stop is not None and stop.is_set():
                # Also checked here: an asynchronous exception that lands in a finalizer (``__del__``) is swallowed.
                raise PipelineStopped(monitor.stop_message)
            monitor.rows += 1
            yield row
        finished = True
    except Interrupted as exc:
        raise exc.error from None
    finally:
        monitor.finish()
        if not finished and stop is not None:
            stop.set()  # the other pipeline stops now, not once this one's executor has shut down (which can take long)
        monitor.thread.join()
        # Close Ray Data's iterator now, not whenever the garbage collector reaches it: its ``finally`` shuts the
        # streaming executor down, and until then the stage's encoder actors keep their CPUs and GPUs, which the
        # next pipeline (or the trainer) then waits for.
        close = getattr(it, "close", None)
        if close is not None:
            close()
