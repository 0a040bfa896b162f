"""Helpers for the tests that start their own Ray clusters: free ports, ``ray start`` nodes, waits, checkpoints.

These tests never connect the pytest process itself to Ray (jobs run as subprocesses, and the pytest process only
talks to a cluster's GCS through a ``GcsClient``), so they do not disturb the session's local Ray and it does not
disturb them. Every process a test starts is stopped by the test, by process group: never ``ray stop``, which stops
every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RAY = str(Path(sys.executable).with_name("ray"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def node_ports(head: bool) -> list[str]:
    """Explicit ports for ``ray start``: Ray's fixed defaults (6379, 8265, 52365...) may be taken by other Rays."""
    names = [
        "node-manager-port",
        "object-manager-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "metrics-export-port",
        "runtime-env-agent-port",
    ]
    if head:
        names.append("ray-client-server-port")
    return [f"--{name}={free_port()}" for name in names]


def wait_for(check, timeout_s: float, what: str, interval_s: float = 0.5, proc: subprocess.Popen | None = None):
    """Poll ``check()`` until it returns something truthy; fail naming ``what`` (and a dead ``proc``) otherwise."""
    end = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process exited first with code {proc.returncode}")
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not seen within {timeout_s:.0f}s")
        time.sleep(interval_s)


def ensure_auth_token() -> None:
    """``ray start`` with token auth (conftest turns it on, as users should keep it) needs the token to exist."""
    if os.environ.get("RAY_AUTH_MODE") == "token" and not (Path.home() / ".ray" / "auth_token").exists():
        # The command prints the token; keep it out of the test log.
        subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True)


def start_process_group(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    """Start ``cmd`` as the leader of a new session, so that its whole process tree can be stopped together."""
    with open(log, "wb") as out:  # the child keeps its own copy of the file
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def group_pids(pgid: int) -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid=,pgid="], capture_output=True, text=True, check=True).stdout
    return [int(pid) for pid, group in (line.split() for line in out.splitlines()) if int(group) == pgid]


def stop_process_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the group ``proc`` leads, then SIGKILL whatever is left after ``grace_s``; assert nothing remains."""
    pgid = proc.pid
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        end = time.monotonic() + grace_s
        while group_pids(pgid) and time.monotonic() < end:
            proc.poll()  # reap the leader so it does not linger as a zombie
            time.sleep(0.5)
        if not group_pids(pgid):
            break
    proc.poll()
    assert not group_pids(pgid), f"processes of group {pgid} survived SIGKILL"


@contextlib.contextmanager
def ray_node(args: list[str], log: Path, **env: str):
    """A ``ray start --block`` node (a head when ``args`` has ``--head``) leading its own process group; stopped by
    group on exit. SIGTERM to the yielded process is SIGTERM to the node, as a container runtime sends it."""
    from ray._private.services import get_node_ip_address

    ensure_auth_token()
    proc = start_process_group([RAY, "start", "--block", *args, *node_ports("--head" in args)], ray_env(**env), log)
    try:
        yield proc
    finally:
        stop_process_group(proc)
        ports = [a.split("=", 1)[1] for a in args if a.startswith("--port=")]
        if "--head" in args and ports:
            forget_address(f"{get_node_ip_address()}:{ports[0]}")


def forget_address(address: str) -> None:
    """Drop a stopped head from Ray's "latest cluster" file, which a plain ``ray.init()`` would otherwise try to join.

    Ray writes the file for every head it starts (``ray start``, ``Cluster``). Every Ray on the machine shares it, so
    it is only reset while it still names the head these tests stopped.
    """
    from ray._common.utils import reset_ray_address
    from ray._private.utils import read_ray_address

    if read_ray_address() == address:
        reset_ray_address()


def ray_env(**extra: str) -> dict:
    """The environment for Ray processes a test starts: this venv's ``python`` and ``ray`` first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # Stopping a node by SIGTERM would otherwise wait up to 30 s to drain it first.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    env.update(extra)
    return env


def gcs(address: str):
    import ray

    return ray._raylet.GcsClient(address=address)


def alive_nodes(address: str) -> dict[str, dict]:
    """node id (hex) -> total resources, for every alive node of the cluster at ``address``."""
    out = {}
    for node_id, info in gcs(address).get_all_node_info().items():
        if info.state == info.ALIVE:
            out[node_id.hex()] = dict(info.resources_total)
    return out


def registered_checkpoint_dir(storage_dir: Path) -> Path | None:
    """The checkpoint Ray Train would restore from now: its latest *registered* one, from the controller's snapshot.

    A checkpoint's files appear before every rank has reported it; only once the controller registers it (and writes
    the snapshot) is it the one a restart resumes from.
    """
    try:
        snapshot = json.loads((storage_dir / "checkpoint_manager_snapshot.json").read_text())
        return storage_dir / snapshot["latest_checkpoint_result"]["checkpoint_dir_name"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not written yet, or caught mid-write


def registered_checkpoint(storage_dir: Path) -> dict | None:
    """The position record (``position.json``) of :func:`registered_checkpoint_dir`, or None."""
    d = registered_checkpoint_dir(storage_dir)
    try:
        return json.loads((d / "position.json").read_text()) if d else None
    except (OSError, ValueError):
        return None


def train_job_cmd(*sets: str, only: str = "") -> list[str]:
    """The training job's command line with ``--set`` overrides (and ``--only``)."""
    cmd = [sys.executable, str(ROOT / "jobs" / "train_flux.py")]
    for s in sets:
        cmd += ["--set", s]
    return cmd + (["--only", only] if only else [])


def own_actor_process(actor_class: str):
    """The one process of this test's clusters that runs an actor of ``actor_class`` (Ray titles an actor's worker
    process ``ray::<class>``), or None. Only this process's descendants are searched: a ``Cluster``'s nodes are its
    children, so another Ray on the machine is never matched."""
    import psutil

    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:  # exited while listed
            continue
        if title.startswith(f"ray::{actor_class}"):
            found.append(proc)
    assert len(found) <= 1, f"more than one {actor_class} process: {found}"
    return found[0] if found else None


def alive_nodes_or_none(address: str) -> dict[str, dict] | None:
    """:func:`alive_nodes`, or None while the GCS is not answering yet."""
    try:
        return alive_nodes(address)
    except Exception:  # noqa: BLE001 - Ray raises several kinds while a GCS starts
        return None


# The GCS marks a node dead after this many failed health checks in a row, one check a period apart. A killed
# raylet refuses each check at once, so Ray's default period (3 s) made every node loss these tests stage wait 15 s
# before Ray Train could restart without it; 1 s makes that 5 s. A live raylet still passes unless it leaves five
# checks in a row unanswered for the whole timeout (Ray's 10 s, unchanged), so a busy machine is not taken for a
# lost node any sooner than before.
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 5}


def start_cluster():
    """A ``ray.cluster_utils.Cluster`` with a 2-CPU head; stop it with :func:`stop_cluster`."""
    from ray.cluster_utils import Cluster

    ensure_auth_token()
    head = {"num_cpus": 2, "include_dashboard": False, "_system_config": HEALTH_CHECKS}
    return Cluster(initialize_head=True, head_node_args=head)


def stop_cluster(c) -> None:
    # Node by node rather than Cluster.shutdown(), which also resets this process's Ray client state (a session Ray
    # started by other tests in this process must keep working).
    address = c.address
    for node in list(c.worker_nodes):
        c.remove_node(node, allow_graceful=False)
    c.remove_node(c.head_node, allow_graceful=False)
    forget_address(address)


@pytest.fixture(scope="module")
def cluster():
    """A module's own local cluster (import this fixture into the test module)."""
    c = start_cluster()
    yield c
    stop_cluster(c)
