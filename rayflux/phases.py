"""Phase timestamps for benchmarks: when ``RAYFLUX_PHASES`` names a file, :func:`mark` appends one JSON line
``{"phase", "time", "pid"}`` to it; otherwise it does nothing.

The driver, the cache stage and the training workers all mark their phases (Ray start, discovery, worker start,
model load, first step, ...), so ``benchmarks/bench_cold.py`` can break a cold run down by phase. Ray's workers
inherit the variable from the driver that started the local Ray; a training worker of a Ray the driver joined is
handed the driver's file (:func:`follow`), where it can reach it. A mark costs one small append and only when asked
for; nothing reads the file but the benchmark.
"""

from __future__ import annotations

import json
import os
import time

ENV = "RAYFLUX_PHASES"


def mark(phase: str) -> None:
    """Record that ``phase`` happened now (Unix seconds), when ``RAYFLUX_PHASES`` asks for it."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = json.dumps({"phase": phase, "time": time.time(), "pid": os.getpid()}) + "\n"
    # One write of one short line in append mode: lines from several processes do not interleave.
    with open(path, "a") as f:
        f.write(line)


def path() -> str:
    """The file marks go to ("" when none is asked for)."""
    return os.environ.get(ENV, "")


def follow(driver_path: str) -> None:
    """Mark into the driver's file from this process too (a training worker whose Ray did not inherit the driver's
    environment), where that file's folder is reachable from here (the same machine)."""
    if driver_path and os.path.isdir(os.path.dirname(driver_path) or "."):
        os.environ[ENV] = driver_path
