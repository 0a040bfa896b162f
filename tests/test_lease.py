"""The run directory's lease between real processes, on local disk and on the loopback S3 server: two jobs starting
at the same instant get exactly one lease, a live holder's heartbeat keeps it past its expiry time, and a holder
killed with SIGKILL loses it once it expires."""

import logging
import os
import signal
import subprocess
import sys
import time

import pytest

from rayflux import lease

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
    start_at = time.time() + 2.0  # both processes have imported rayflux by then
    procs = [_holder(where, 1.0, start_at, 3.0) for _ in range(2)]
    lines = [p.stdout.readline() for p in procs]
    assert sorted(line.split(" ", 1)[0].strip() for line in lines) == ["acquired", "refused:"], lines
    winner = procs[0] if lines[0].startswith("acquired") else procs[1]
    refusal = next(line for line in lines if line.startswith("refused:"))
    # One line: who holds it, since when, and how to take over.
    assert f"pid {winner.pid}" in refusal and "since" in refusal and f"delete {where}/lease.json" in refusal
    # Two expiry times later the winner still holds it: its heartbeat renews it.
    time.sleep(2.0)
    with pytest.raises(lease.LeaseHeld, match=f"pid {winner.pid}"):
        lease.Lease(where, "run.output_dir", 1.0).acquire()
    for p in procs:
        p.wait(timeout=30)
    assert sorted(p.returncode for p in procs) == [0, 3], [p.stderr.read() for p in procs]
    with lease.Lease(where, "run.output_dir", 1.0):  # released: the next job takes it at once
        pass


def test_killed_holder_expires_and_is_taken_over(where, caplog):
    holder = _holder(where, 1.5, 0.0, 120.0)
    try:
        assert holder.stdout.readline().strip() == "acquired", holder.stderr.read()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    killed = time.time()
    with pytest.raises(lease.LeaseHeld, match=f"pid {holder.pid}.*run again after"):
        lease.Lease(where, "run.output_dir", 1.5).acquire()
    caplog.set_level(logging.WARNING, logger="rayflux")
    while True:
        try:
            took = lease.Lease(where, "run.output_dir", 1.5).acquire()
            break
        except lease.LeaseHeld:
            assert time.time() - killed < 10, "the dead holder's lease never expired"
            time.sleep(0.1)
    try:
        assert 0.5 < time.time() - killed < 3.0  # at its expiry, not before
        assert f"took over the lease of a job (host {os.uname().nodename}, pid {holder.pid})" in caplog.text
    finally:
        took.release()
