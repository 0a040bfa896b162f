"""Run a cache build's text and image pipelines side by side, and stop both when either fails.

The image pass needs nothing the text pass writes (its rows hold caption ids; training joins them), so the two Ray
Data pipelines run at once, unless :mod:`rayflux.cache.fit` rules that their pools cannot share the cluster safely:
the text pass is iterated by a thread of its own while the calling thread iterates the image pass. Each iteration
runs under :func:`rayflux.cache.stall.watch` with one shared ``stop`` event: the first pipeline to fail sets it, the
other one's watch raises :class:`~rayflux.cache.stall.PipelineStopped` in its thread, Ray Data shuts that executor
down (its actors included), and the first failure is raised here once both threads are done. No thread outlives the
call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from rayflux.cache.stall import Interrupted, PipelineStopped

T = TypeVar("T")
U = TypeVar("U")


def run(
    text_pass: Callable[[threading.Event], T],
    image_pass: Callable[[threading.Event], U],
    together: bool = True,
    text_flowing: threading.Event | None = None,
) -> tuple[T, U, dict[str, dict[str, float]]]:
    """Run ``text_pass(stop)`` in a thread while this thread runs ``image_pass(stop)`` (or, unless ``together``, one
    after the other). With ``text_flowing``, the image pass starts once the text pass sets it (its first shard is
    written, so its actors hold their resources) or ends: where the two pools exclude each other, this decides that
    the VAE pool is the one that waits. Returns both results and each pass's wall-clock ``start``/``end`` (Unix
    seconds). Raises the first failure after both have stopped."""
    stop = threading.Event()
    times: dict[str, dict[str, float]] = {}
    text: dict = {}

    def timed(name: str, fn: Callable[[threading.Event], T]) -> T:
        times[name] = {"start": round(time.time(), 3)}
        try:
            return fn(stop)
        finally:
            times[name]["end"] = round(time.time(), 3)

    if not together:
        first = timed("text", text_pass)
        return first, timed("images", image_pass), times

    def run_text() -> None:
        try:
            text["out"] = timed("text", text_pass)
        except BaseException as exc:  # handed to the calling thread, which raises it
            text["error"] = _reported(exc)
            stop.set()

    thread = threading.Thread(target=run_text, name="rayflux-cache-text", daemon=True)
    thread.start()
    images_error: BaseException | None = None
    try:
        while text_flowing is not None and not text_flowing.wait(0.5) and thread.is_alive():
            pass
        if stop.is_set():  # the text pass failed before the image pass began
            raise PipelineStopped("the image pass was not started: the text pass failed")
        images = timed("images", image_pass)
    except BaseException as exc:
        images_error = _reported(exc)
        stop.set()
    try:
        thread.join()
    except BaseException:  # Ctrl-C while waiting: stop the text pass too, and wait for it
        stop.set()
        thread.join()
        raise
    text_error = text.get("error")
    if images_error is not None and not (isinstance(images_error, PipelineStopped) and text_error is not None):
        _note_stopped(images_error, text_error, "text")
        raise images_error
    if text_error is not None:
        _note_stopped(text_error, images_error, "image")
        raise text_error
    return text["out"], images, times


def _reported(exc: BaseException) -> BaseException:
    """The error a pass failed with (a stall or stop that landed outside its watch's frame carries it)."""
    return exc.error if isinstance(exc, Interrupted) else exc


def _note_stopped(error: BaseException, other: BaseException | None, other_name: str) -> None:
    """Say, in the traceback, that the build's other pass was stopped because of ``error``."""
    if isinstance(other, PipelineStopped):
        error.add_note(f"the {other_name} pass was stopped because of this error")
