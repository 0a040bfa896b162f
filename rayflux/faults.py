"""Named points where a test can have a real process kill itself, at the worst moment for the code around it.

``RAYFLUX_KILL_AT=<point>[,<point>...]:<marker dir>`` in a process's environment (for Ray workers: the job's
runtime_env) makes the first process that reaches each named point SIGKILL itself there. It first creates
``<marker dir>/<point>``, so only one process dies per point, and Ray's retry of the killed task runs through. Several
points in one spec let one run take several independent faults (each point still kills exactly once). Unset, a point
costs one lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "RAYFLUX_KILL_AT"


def kill_point(name: str) -> None:
    spec = os.environ.get(ENV, "")
    if not spec:
        return
    points, _, markers = spec.partition(":")
    if name not in points.split(","):
        return
    try:
        fd = os.open(os.path.join(markers, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)
