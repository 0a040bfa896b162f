"""Run one command and measure what it cost: wall time to its exit, CPU seconds of its whole process tree, and the
lines it printed. Shared by ``bench_cold.py``'s rayflux and SimpleTuner sides so both are measured the same way.

CPU: ``getrusage(RUSAGE_CHILDREN)`` alone undercounts a tree whose processes do not wait for their children: a parent
that ignores SIGCHLD (as daemons such as Ray's raylet do, so their workers never linger as zombies) has its exited
children reaped by the kernel, and their CPU time is added to nobody. So the tree is also sampled every
``SAMPLE_S`` seconds (psutil: every descendant's own user + system time, keyed by pid and start time) and the sum of
each process's last sample is reported; it misses at most the last ``SAMPLE_S`` of each process that is reaped by
someone else. This process makes itself a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``) so that orphans of the
tree stay its descendants (sampled, then reaped here after the command exits, zombies included: a zombie's times are
still readable). Both figures are kept: ``cpu`` (the sampled sum, or the rusage delta where that is larger) and
``cpu_rusage``.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

_PR_SET_CHILD_SUBREAPER = 36
SAMPLE_S = 0.25


@dataclass
class Measured:
    """One command's cost."""

    returncode: int
    """The command's exit status."""
    wall: float
    """Seconds from its launch to its exit (what the user waits for)."""
    cpu: float
    """User + system CPU seconds of the command and every descendant (see the module's docstring)."""
    cpu_rusage: float
    """The ``getrusage(RUSAGE_CHILDREN)`` delta alone (undercounts processes reaped by the kernel)."""
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


class _TreeSampler:
    """The last-seen own CPU seconds of every descendant of this process."""

    def __init__(self):
        self.me = psutil.Process()
        self.seen: dict[tuple[int, float], float] = {}

    def sample(self) -> None:
        for p in self.me.children(recursive=True):
            try:
                t = p.cpu_times()
                self.seen[(p.pid, p.create_time())] = t.user + t.system
            except psutil.Error:
                pass  # gone between the listing and the read

    def total(self) -> float:
        return sum(self.seen.values())


def _reap_all(sampler: _TreeSampler, deadline: float) -> None:
    """Wait for every remaining child (the command's orphaned descendants), sampling them first, until ``deadline``."""
    while time.time() < deadline:
        sampler.sample()
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(SAMPLE_S)


def run_measured(argv: list[str], env: dict, cwd: Path, log: Path, timeout: float = 3600) -> Measured:
    """Run ``argv`` with its output in ``log``; its wall time, whole-tree CPU seconds and line count."""
    _become_subreaper()
    sampler = _TreeSampler()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "wb") as out:
        t0 = time.time()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        while proc.poll() is None:  # poll() reaps the command itself; sample before it can
            sampler.sample()
            if time.time() - t0 > timeout:
                proc.kill()
            time.sleep(SAMPLE_S)
        t1 = time.time()
    _reap_all(sampler, time.time() + 60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rusage = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    text = log.read_bytes()
    tail = text[-3000:].decode(errors="replace")
    return Measured(proc.returncode, t1 - t0, max(sampler.total(), rusage), rusage, text.count(b"\n"), tail, t0, t1)


def tree_bytes(*paths: Path) -> int:
    """Bytes of the files under ``paths`` (files or folders; missing ones count 0)."""
    total = 0
    for p in paths:
        if p.is_file():
            total += p.stat().st_size
        elif p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return total
