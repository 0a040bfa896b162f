"""A run directory sealed against its training writers: a sweep reads a trial's results only once nothing of the trial
can write them any more.

Rank 0 of a training worker group writes the run directory's step log, TensorBoard events and best LoRA. When a
sweep's scheduler stops a trial, Ray ends it asynchronously (the trial's actor, then its trainer's controller, then
the workers, possibly after the controller started a new worker group): rank 0 may go on training, evaluating and
writing for seconds after Tune counts the trial as stopped, and a results table read meanwhile names a best eval loss
that the trial's log then outdoes, or a best LoRA file that is then overwritten with another step's.

So rank 0 holds a shared ``flock`` of ``<run dir>/metrics/writer.lock`` from opening its step log to closing it (the
kernel drops it when the process dies, however it dies), and refuses to start in a sealed directory
(:func:`rayflux.train.observe.writer_lock.hold`, training's side of this protocol). :func:`seal`
gets the exclusive lock only once every such writer is gone, and marks the directory sealed under it, so no writer
starts after it either; :func:`unseal` (the trial running again) clears the mark. The lock file is only ever
truncated, never replaced: a writer's lock and the sealer's must be on the same file. Local and shared filesystems
only (NFSv4 and Lustre carry ``flock`` between machines, as :mod:`rayflux.lease` relies on too): an object-store run
directory has no lock, and is read as it is.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time

from rayflux.train.observe.writer_lock import SEALED, lock_path

log = logging.getLogger("rayflux")


def seal(output_dir: str, timeout: float) -> bool:
    """Wait until no writer holds the run directory (every one closed its step log or died), then seal it. Returns
    False (and warns) when writers still held it after ``timeout`` seconds, or for an object-store directory."""
    path = lock_path(output_dir)
    if path is None:
        return False
    start = time.monotonic()
    deadline = start + timeout
    with open(path, "a+b") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning(
                        "%s: a training process still writes there after %.0fs; read as it is", output_dir, timeout
                    )
                    return False
                time.sleep(0.05)
        f.truncate(0)
        f.write(SEALED)
        f.flush()
    if time.monotonic() - start > 1.0:
        log.info("%s: sealed once its training processes ended, %.1fs later", output_dir, time.monotonic() - start)
    return True


def unseal(output_dir: str) -> None:
    """Let writers start in the run directory again (a sweep's trial that runs again)."""
    path = lock_path(output_dir, create=False)
    if path is not None and os.path.exists(path):
        with open(path, "r+b") as f:
            f.truncate(0)
