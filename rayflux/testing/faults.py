"""Named points where a test can have a real process kill itself, at the worst moment for the code around it.

``RAYFLUX_KILL_AT=<point>:<marker dir>`` in a process's environment (for Ray workers: the job's runtime_env) makes
the first process that reaches ``point`` SIGKILL itself there. It first creates ``<marker dir>/<point>``, so only one
process dies per point, and Ray's retry of the killed task runs through. Unset, a point costs one lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "RAYFLUX_KILL_AT"


def kill_point(name: str) -> None:
    spec = os.environ.get(ENV, "")
    if not spec or spec.split(":", 1)[0] != name:
        return
    try:
        fd = os.open(os.path.join(spec.split(":", 1)[1], name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)
