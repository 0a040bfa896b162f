"""What the job's terminal shows when it starts a Ray of its own, and when a running head refuses it.

A ``test_cluster_`` module: its jobs start Rays and a ``ray start`` head beside the pytest process, so it runs after
the others with the session Ray stopped (see conftest). The refusing head has a temp dir (``RAY_TMPDIR``) and token of
its own, so ``address="auto"`` finds it there and never another Ray of this machine; it is stopped by process group.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

from cluster_support import free_port, ray_node, train_job_cmd, wait_for

BOUND_S = 600  # a bound for the job to finish at all on a busy 2-core machine; never a performance claim
# Lines only Ray writes: its token notice, its C++ core's log lines (``[time E pid tid] core_worker.cc:...``) and Ray
# Data's plain progress for a non-terminal stdout, and the Python warnings of Ray and the libraries (a deprecated
# argument, a concurrency cap above a pass's batch count).
RAY_LINES = re.compile(r"Token authentication is enabled|\.cc:\d+:|Total Progress|Warning: |is deprecated")


def _job_env(**extra: str) -> dict:
    """A user's plain environment: no RAY_AUTH_MODE (conftest sets it; Ray then announces token auth itself), and
    Ray Data's bars on (.ci/run turns them off for the rest of the suite)."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), **extra)
    for name in ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAYFLUX_VERBOSE", "RAY_DATA_DISABLE_PROGRESS_BARS"):
        env.pop(name, None)
    return env


def _run_on_pty(cmd: list[str], env: dict, timeout_s: float) -> tuple[int, str]:
    """Run ``cmd`` with a pseudo-terminal (120 columns) as stdin, stdout and stderr; its exit code and everything it
    showed."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a 0x0 terminal shows no bars
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env)
    os.close(slave)
    shown, end = b"", time.monotonic() + timeout_s
    try:
        while time.monotonic() < end:
            if select.select([master], [], [], 1.0)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every holder of the terminal has closed it
                    break
                if not chunk:
                    break
                shown += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=max(end - time.monotonic(), 1)), shown.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_a_terminal_shows_the_cache_bars_and_none_of_ray_s_own_lines(tiny_model, tmp_path):
    """The demo's cache stage on a terminal, starting its own Ray: Ray's token notice (Python logging) goes to the
    logs; Ray Data's one bar per pipeline stays. (The piped run is test_job_e2e's subprocess test.) On 2 CPUs one
    encoder process runs both passes (rayflux.cache.host) and is killed idle, so Ray's C++ core prints no
    ``core_worker.cc`` line about pool actors here; were it to print one, ``RAY_LINES`` keeps it off the terminal."""
    out = tmp_path / "run"
    cmd = train_job_cmd(
        f"model.path={tiny_model}", "data.resolution=64", f"run.output_dir={out}", "run.ray_address=local", only="cache"
    )
    code, shown = _run_on_pty(cmd, _job_env(), BOUND_S)
    assert code == 0, shown[-3000:]
    assert not RAY_LINES.findall(shown), shown
    # Ray Data's own bar, once per pipeline (text, images), ends each pipeline on the terminal.
    assert len(re.findall(r"Dataset cache-\w+-g0_\w+ execution finished", shown)) >= 2, shown
    assert "[rayflux] cache:" in shown, shown
    # What was kept off the terminal is in the run's driver log.
    kept = (out / "logs" / "ray-driver.txt").read_text()
    assert "Token authentication is enabled" in kept, kept


def test_a_head_that_refuses_the_job_is_named_in_one_line(tiny_model, tmp_path):
    """A ``ray start`` head with a token of its own runs here; the job joins it (``address="auto"``) without that
    token and fails with one line naming the head, the reason and both ways out."""
    own_tmp = tempfile.mkdtemp(prefix="rf-", dir="/tmp")  # short: Ray's socket paths live under it
    head_env = {"RAY_TMPDIR": own_tmp, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    try:
        head_args = ["--head", f"--port={free_port()}", "--num-cpus=1", "--include-dashboard=false"]
        with ray_node(head_args, tmp_path / "head.log", **head_env) as head:
            address_file = Path(own_tmp) / "ray" / "ray_current_cluster"
            address = wait_for(
                lambda: address_file.is_file() and address_file.read_text().strip(),
                BOUND_S,
                "the head's address file",
                proc=head,
            )
            # Ray tries a refusing GCS once a second for 20 s by default; a refusal is the same on the first try.
            env = _job_env(RAY_TMPDIR=own_tmp, RAY_gcs_server_port_wait_time_s="2")
            job = subprocess.run(
                train_job_cmd(f"model.path={tiny_model}", f"run.output_dir={tmp_path / 'run'}", only="cache"),
                capture_output=True,
                text=True,
                env=env,
                timeout=BOUND_S,
            )
    finally:
        shutil.rmtree(own_tmp, ignore_errors=True)
    assert job.returncode == 1, job.stderr
    # Ray warns when it sees several heads on the machine (other Rays may run here); it names the one it joins.
    lines = [line for line in job.stderr.splitlines() if line.strip() and "Found multiple active Ray" not in line]
    assert len(lines) == 1, job.stderr
    line = lines[0]
    assert line.startswith("rayflux: failed: HeadRefused: ") and f"Ray head at {address} " in line, line
    assert "token is missing or incorrect" in line, line
    assert "run.ray_address=local" in line and "RAY_AUTH_TOKEN" in line, line
