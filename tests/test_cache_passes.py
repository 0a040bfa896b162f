"""The text and image passes run at once, and either one's failure stops the other: no thread is left behind, the
stopped pass's iterator is closed (in a cache build that shuts its Ray Data executor and actors down), and the first
failure is what the caller sees. Plain iterables stand in for the pipelines' outputs: the coordination does not
depend on what yields the rows (the real pipelines are in test_cache_fit.py)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest

from rayflux.cache import passes, stall


def _endless(closed: dict, name: str, running: threading.Event | None = None):
    """Rows that never end, as a pipeline still at work; records that it was closed (sets ``running`` once it runs)."""
    try:
        if running is not None:
            running.set()
        while True:
            time.sleep(0.02)
            yield 1
    finally:
        closed[name] = True


def _drain(rows, stop) -> int:
    with contextlib.closing(stall.watch(rows, seconds=60, stop=stop)) as watched:
        return sum(1 for _ in watched)


def _failing_after(n: int, stop, exc: Exception):
    """A pass whose n-th row fails its check; closes its watch as the cache's ``_collect`` does."""
    with contextlib.closing(stall.watch(iter(range(10**9)), seconds=60, stop=stop)) as watched:
        for k, _ in enumerate(watched):
            if k == n:
                raise exc
    return k


def _threads() -> set[str]:
    return {t.name for t in threading.enumerate()}


def test_a_failing_image_pass_stops_the_text_pass():
    closed, before = {}, _threads()
    error = ValueError("bucket 64x64: latent shape expected (4, 8, 8), got (5, 8, 8)")
    with pytest.raises(ValueError) as exc:
        passes.run(lambda stop: _drain(_endless(closed, "text"), stop), lambda stop: _failing_after(5, stop, error))
    assert exc.value is error and "the text pass was stopped because of this error" in exc.value.__notes__
    assert closed == {"text": True}
    assert _threads() == before


def test_a_failing_text_pass_stops_the_image_pass():
    closed, before, running = {}, _threads(), threading.Event()
    error = RuntimeError("t5 length expected 8, got 7")

    def text(stop):
        running.wait(30)  # fail once the image pass is at work (a text pass failing earlier never starts it)
        return _failing_after(3, stop, error)

    with pytest.raises(RuntimeError) as exc:
        passes.run(text, lambda stop: _drain(_endless(closed, "images", running), stop))
    assert exc.value is error and "the image pass was stopped because of this error" in exc.value.__notes__
    assert closed == {"images": True}
    assert _threads() == before


def test_passes_run_at_once_or_one_after_the_other():
    running = {"text": threading.Event(), "images": threading.Event()}

    def meeting(me: str, other: str):
        def run_pass(stop) -> bool:
            running[me].set()
            return running[other].wait(30)  # each pass sees the other one running

        return run_pass

    assert passes.run(meeting("text", "images"), meeting("images", "text"))[:2] == (True, True)
    for event in running.values():
        event.clear()

    def looking(me: str, other: str):
        def run_pass(stop) -> bool:
            running[me].set()
            return running[other].is_set()

        return run_pass

    text_saw_images, images_saw_text, times = passes.run(looking("text", "images"), looking("images", "text"), False)
    assert (text_saw_images, images_saw_text) == (False, True)
    assert times["text"]["end"] <= times["images"]["start"]


def test_where_the_pools_exclude_each_other_the_image_pass_starts_once_text_flows():
    flowing, order = threading.Event(), []

    def text(stop):
        order.append("text shard written")
        flowing.set()
        return "text rows"

    assert passes.run(text, lambda stop: order.append("image pass") or "image rows", text_flowing=flowing)[:2] == (
        "text rows",
        "image rows",
    )
    assert order == ["text shard written", "image pass"]
    # A text pass that fails before its first shard: the image pass never starts.
    started = []

    def failing_text(stop):
        raise ValueError("no text encoder")

    with pytest.raises(ValueError, match="no text encoder"):
        passes.run(failing_text, lambda stop: started.append(1), text_flowing=threading.Event())
    assert started == []
