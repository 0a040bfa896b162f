"""Rank 0's shared lock of its run directory, held while it may write there; a sweep seals the directory under the
exclusive lock once every writer is gone (:mod:`rayflux.sweep.seal`, which explains the protocol).

Local and shared filesystems only: an object-store run directory has no lock."""

from __future__ import annotations

import fcntl
import os
from typing import BinaryIO

from rayflux import storage

LOCK_FILE = "writer.lock"
"""In a run directory's ``metrics/``: empty while writers may start, ``SEALED`` once sealed."""
SEALED = b"sealed\n"
LOCK_DIR = "metrics"
"""The step log's folder (``rayflux.train.observe.metrics.STEPS_DIR``), which rank 0 writes anyway."""


class Sealed(RuntimeError):
    """The run directory was sealed: the run it belonged to has ended, and its results were read."""


def lock_path(output_dir: str, create: bool = True) -> str | None:
    """The run directory's lock file (its folder made when ``create``); None for an object-store directory."""
    if storage.is_uri(output_dir):
        return None
    if create:
        os.makedirs(os.path.join(output_dir, LOCK_DIR), exist_ok=True)
    return os.path.join(output_dir, LOCK_DIR, LOCK_FILE)


def hold(output_dir: str) -> BinaryIO | None:
    """Rank 0, before it writes anything to a local run directory: the open, share-locked lock file (close it when
    done writing); raises :class:`Sealed` in a sealed directory. None for an object-store directory."""
    path = lock_path(output_dir)
    if path is None:
        return None
    f = open(path, "a+b")
    fcntl.flock(f, fcntl.LOCK_SH)  # waits only while a seal() marks the file
    f.seek(0)
    if f.read(len(SEALED)) == SEALED:
        f.close()
        raise Sealed(f"{output_dir} was sealed: its run has ended and its results were read; nothing more is written")
    return f
