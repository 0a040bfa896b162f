"""Run one command and measure what it cost: wall time to its exit, CPU seconds of its whole process tree, and the
lines it printed. Shared by ``bench_cold.py``'s rayflux and SimpleTuner sides so both are measured the same way.

CPU: ``getrusage(RUSAGE_CHILDREN)`` counts a descendant only once its parent has waited for it, and a job's helper
processes (Ray's raylet, GCS and workers; a trainer's data loader workers) are often left to exit on their own after
their parent. So this process makes itself a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): orphans of the tree
are reparented here, and after the command exits every remaining descendant is reaped before the CPU delta is read.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36


@dataclass
class Measured:
    """One command's cost."""

    returncode: int
    """The command's exit status."""
    wall: float
    """Seconds from its launch to its exit (what the user waits for)."""
    cpu: float
    """User + system CPU seconds of the command and every descendant, reaped ones included."""
    lines: int
    """Newline-terminated lines it wrote to stdout and stderr together (progress bars redraw with ``\\r``, so a bar
    counts as the lines it ends with)."""
    tail: str
    """The last 3000 characters of its output, for error messages."""
    launch: float
    """Unix time of the launch."""
    exit: float
    """Unix time of the exit."""


def _become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def _reap_all(deadline: float) -> None:
    """Wait for every remaining child (the command's orphaned descendants), until ``deadline``."""
    while time.time() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.2)


def run_measured(argv: list[str], env: dict, cwd: Path, log: Path, timeout: float = 3600) -> Measured:
    """Run ``argv`` with its output in ``log``; its wall time, whole-tree CPU seconds and line count."""
    _become_subreaper()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "wb") as out:
        t0 = time.time()
        proc = subprocess.run(
            argv, check=False, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=env, cwd=cwd
        )
        t1 = time.time()
    _reap_all(time.time() + 60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    text = log.read_bytes()
    return Measured(proc.returncode, t1 - t0, cpu, text.count(b"\n"), text[-3000:].decode(errors="replace"), t0, t1)


def tree_bytes(*paths: Path) -> int:
    """Bytes of the files under ``paths`` (files or folders; missing ones count 0)."""
    total = 0
    for p in paths:
        if p.is_file():
            total += p.stat().st_size
        elif p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return total
