"""Phase timestamps for benchmarks: when ``RAYFLUX_PHASES`` names a file, :func:`mark` appends one JSON line
``{"phase", "time", "pid"}`` to it; otherwise it does nothing.

The driver, the cache stage and the training workers all mark their phases (Ray start, discovery, worker start,
model load, first step, ...), so ``benchmarks/bench_cold.py`` can break a cold run down by phase. Ray's workers
inherit the variable from the driver that started the local Ray. A mark costs one small append and only when asked
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
