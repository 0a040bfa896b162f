"""Is a process that recorded itself earlier certainly gone? Exact on Linux, "can't tell" elsewhere.

A lease names its holder's pid. A pid alone says little: another machine with the same host name has the same pid
numbers, a rebooted machine hands them out again, a container sees only its own pid namespace, and the kernel
reuses a dead process's pid for the next one. So a process is identified by three things, read from ``/proc``:

- the kernel's boot id (``/proc/sys/kernel/random/boot_id``, a random UUID per boot): another machine, or this one
  after a reboot, has another;
- the pid namespace (the inode of ``/proc/self/ns/pid``): containers on one kernel share the boot id but number
  their processes apart;
- the process's start time (field 22 of ``/proc/<pid>/stat``, clock ticks since boot): a reused pid started later.

Only a process recorded on this boot and in this pid namespace can be judged, and it is gone when its pid is not
running, is a zombie (killed, not yet reaped by its parent), or runs with another start time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def host_id() -> str:
    """This kernel boot and pid namespace, ``<boot id>/<pid namespace inode>``; "" where ``/proc`` has neither
    (not Linux), so no process is ever judged gone there."""
    boot = _read(_BOOT_ID).strip()
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{namespace}" if boot else ""


@dataclass(frozen=True)
class ProcStat:
    """What ``/proc/<pid>/stat`` says of one process."""

    state: str
    """One letter: ``R`` running, ``S`` sleeping, ``Z`` zombie, ``X`` dead, ..."""
    start_ticks: int
    """When it started, in clock ticks since boot: unique for a pid at any one time, so it tells reuse apart."""


def parse_stat(line: str) -> ProcStat:
    """Parse one ``/proc/<pid>/stat`` line. The command name (field 2) is in parentheses and may itself hold
    spaces and parentheses, so the fields are counted from its last ``)``."""
    rest = line[line.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state); field 22 (starttime) is rest[19].
    return ProcStat(state=rest[0], start_ticks=int(rest[19]))


def proc_stat(pid: int) -> ProcStat | None:
    """The process ``pid`` as ``/proc`` shows it now, or None when no such process exists."""
    line = _read(f"/proc/{int(pid)}/stat")
    return parse_stat(line) if line else None


def start_ticks(pid: int) -> int:
    """``pid``'s start time in clock ticks since boot; 0 where ``/proc`` does not say."""
    found = proc_stat(pid)
    return found.start_ticks if found is not None else 0


def gone(recorded_host: str, pid: int, recorded_start: int) -> str:
    """Why the process ``pid`` that started at ``recorded_start`` on ``recorded_host`` is certainly gone, in a few
    words; "" when it may still run (it does, or it ran elsewhere, or the record is too old to say)."""
    here = host_id()
    if not recorded_host or not recorded_start or recorded_host != here:
        return ""
    now = proc_stat(pid)
    if now is None:
        return "that process no longer runs"
    if now.state in ("Z", "X"):
        return "that process was killed (a zombie its parent has not reaped)"
    if now.start_ticks != recorded_start:
        return "its pid now belongs to a process started later"
    return ""
