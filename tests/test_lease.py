"""The run directory's lease between real processes, on local disk and on the loopback S3 server: two jobs starting
at the same instant get exactly one lease, a live holder's heartbeat keeps it past its expiry time, a holder killed
on this machine loses it at once (to exactly one of two racing reruns), and a holder that may run elsewhere loses it
only once it expires."""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from rayflux import lease, liveness

# A process that takes the lease of argv[1] at the instant argv[3], holds it for argv[4] seconds, then lets go.
_HOLDER = """
import sys, time
from rayflux import lease
where, seconds, start_at, hold = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
time.sleep(max(0.0, start_at - time.time()))
try:
    held = lease.Lease(where, "run.output_dir " + where, seconds).acquire()
except lease.LeaseHeld as exc:
    print("refused:", exc, flush=True)
    sys.exit(3)
print("acquired", flush=True)
time.sleep(hold)
held.release()
"""


def _holder(where: str, seconds: float, start_at: float, hold: float) -> subprocess.Popen:
    args = [sys.executable, "-c", _HOLDER, where, str(seconds), str(start_at), str(hold)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("s3_bucket") + "/run"


def test_two_jobs_at_once_get_one_lease(where):
    # A 3 s lease held for 7 s: its heartbeat (every 0.75 s) must be 2.25 s late before the test's take-over could
    # win, which a loaded CI machine (three test processes on two cores) did with a 1 s lease.
    start_at = time.time() + 3.0  # both processes have imported rayflux by then
    procs = [_holder(where, 3.0, start_at, 7.0) for _ in range(2)]
    lines = [p.stdout.readline() for p in procs]
    assert sorted(line.split(" ", 1)[0].strip() for line in lines) == ["acquired", "refused:"], lines
    winner = procs[0] if lines[0].startswith("acquired") else procs[1]
    refusal = next(line for line in lines if line.startswith("refused:"))
    # One line: who holds it, since when, and how to take over.
    assert f"pid {winner.pid}" in refusal and "since" in refusal and f"delete {where}/lease.json" in refusal
    # One and a half expiry times later the winner still holds it: its heartbeat renews it.
    time.sleep(4.5)
    with pytest.raises(lease.LeaseHeld, match=f"pid {winner.pid}"):
        lease.Lease(where, "run.output_dir", 3.0).acquire()
    for p in procs:
        p.wait(timeout=30)
    assert sorted(p.returncode for p in procs) == [0, 3], [p.stderr.read() for p in procs]
    with lease.Lease(where, "run.output_dir", 1.0):  # released: the next job takes it at once
        pass


def _dead_pid() -> int:
    """The pid of a process that ran on this machine and has ended (reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_holder(where: str, **fields) -> None:
    """Put a lease naming ``fields`` (over a live, fresh holder on this machine) where a job would find it; a field
    given as None is left out of the file, as a lease written by an older rayflux lacks it."""
    now = time.time()
    me = dict(token="t", job="", host=os.uname().nodename, pid=os.getpid(), started=now, heartbeat=now, seconds=60.0)
    me.update(host_id=liveness.host_id(), pid_start=liveness.start_ticks(os.getpid()))
    record = {k: v for k, v in {**me, **fields}.items() if v is not None}
    assert lease._store(f"{where}/{lease.FILE}").put(json.dumps(record).encode(), None) is not None


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_killed_holder_on_this_machine_is_taken_over_at_once(where, caplog, reaped):
    """A 60 s lease whose holder was SIGKILLed a moment ago: the next job takes it at once, and says so."""
    holder = _holder(where, 60.0, 0.0, 120.0)
    try:
        assert holder.stdout.readline().strip() == "acquired", holder.stderr.read()
    finally:
        holder.send_signal(signal.SIGKILL)
        if reaped:
            holder.wait()
        else:  # killed but not yet reaped by its parent: still in /proc, as a zombie
            while liveness.proc_stat(holder.pid).state != "Z":
                time.sleep(0.01)
    caplog.set_level(logging.WARNING, logger="rayflux")
    try:
        lease.Lease(where, "run.output_dir", 60.0).acquire().release()
    finally:
        holder.wait()
    who = f"took over the lease of a job (host {os.uname().nodename}, pid {holder.pid})"
    assert who in caplog.text and ("no longer runs on this machine" if reaped else "zombie") in caplog.text


def test_cache_key_waiter_takes_a_dead_holder_s_lease_at_once(where, caplog):
    """A cache key's lease is waited for (``wait=True``), not refused: a dead holder's is taken without waiting."""
    _write_holder(where, pid=_dead_pid())
    caplog.set_level(logging.WARNING, logger="rayflux")
    began = time.monotonic()
    lease.Lease(where, "cache key k", 60.0).acquire(wait=True).release()
    assert time.monotonic() - began < 30  # not the holder's 60 s expiry
    assert "cache key k: took over the lease" in caplog.text and "no longer runs on this machine" in caplog.text


def test_live_holder_on_this_machine_is_refused(where):
    _write_holder(where)  # this very process, its start time right
    with pytest.raises(lease.LeaseHeld, match=f"pid {os.getpid()}.*run again after"):
        lease.Lease(where, "run.output_dir", 60.0).acquire()


def test_reused_pid_is_not_the_holder(where, caplog):
    """The recorded pid runs, but started later than the holder did: another process got the pid."""
    _write_holder(where, pid_start=liveness.start_ticks(os.getpid()) - 1)
    caplog.set_level(logging.WARNING, logger="rayflux")
    lease.Lease(where, "run.output_dir", 60.0).acquire().release()
    assert "its pid now belongs to a process started later" in caplog.text


@pytest.mark.parametrize(
    "elsewhere",
    [
        {"host": "other", "host_id": "0d6f2f1c-0000-0000-0000-000000000000/4026531836"},  # another machine
        {"host_id": "rebooted" + liveness.host_id()[8:]},  # this machine's name, another boot
        {"host_id": liveness.host_id().split("/")[0] + "/1"},  # this boot, another pid namespace (a container)
        {"host_id": None, "pid_start": None},  # a lease written before the host was recorded
    ],
    ids=["other-host", "other-boot", "other-pid-namespace", "unrecorded"],
)
def test_holder_elsewhere_keeps_its_lease_until_it_expires(where, elsewhere, caplog):
    """A holder that may run elsewhere (even under a dead pid here) is only taken over once its heartbeat is late."""
    seconds, written = 1.5, time.time()
    _write_holder(where, **{"pid": _dead_pid(), "pid_start": 1, "seconds": seconds, **elsewhere})
    caplog.set_level(logging.WARNING, logger="rayflux")
    while True:
        try:
            took = lease.Lease(where, "run.output_dir", seconds).acquire()
            break
        except lease.LeaseHeld:
            assert time.time() - written < 10, "the lease never expired"
            time.sleep(0.1)
    took.release()
    assert seconds <= time.time() - written < 5.0  # at its expiry, not before
    assert "its last heartbeat was at" in caplog.text


def test_two_reruns_race_for_a_dead_holder_s_lease(where):
    """Both see the dead holder at the same instant; the take-over is conditional, so exactly one wins."""
    _write_holder(where, pid=_dead_pid())
    start_at = time.time() + 2.0
    procs = [_holder(where, 60.0, start_at, 2.0) for _ in range(2)]
    lines = [p.stdout.readline().split(" ", 1)[0].strip() for p in procs]
    for p in procs:
        p.wait(timeout=30)
    assert sorted(lines) == ["acquired", "refused:"], [p.stderr.read() for p in procs]


def test_stat_line_with_parentheses_in_the_command_name():
    line = "77 (a) (b c)) S 1 77 77 0 -1 4194304 9 0 0 0 0 0 0 0 20 0 1 0 123456 3133440 391 18446744073709551615"
    assert liveness.parse_stat(line) == liveness.ProcStat(state="S", start_ticks=123456)
    assert liveness.start_ticks(os.getpid()) == liveness.proc_stat(os.getpid()).start_ticks > 0
