"""``python -m rayflux cluster spot-guard``: drain this node for Ray Train as soon as EC2 announces a spot reclaim.

How a preemption reaches training in Ray 2.60: the node is *drained* with reason ``PREEMPTION`` and a deadline (the
GCS ``DrainNode`` call behind ``ray drain-node``). Ray Train's preemption watcher then tells every worker,
``ray.train.get_preemption_info()`` returns the notice, and rayflux's loop saves a checkpoint at its next step and
keeps training (:mod:`rayflux.train.progress`). When the node goes, Ray Train restarts from that checkpoint on the
nodes that are left.

Who drains:

- A node run by ``ray start --block`` drains itself when that process receives SIGTERM (a container's PID 1 under
  Kubernetes, or a systemd unit that signals only its main process), with a deadline of
  ``RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S`` (30 s by default).
- On an EC2 virtual machine, a spot reclaim ends in an OS shutdown that signals every process at once, so the node
  dies before anything can be saved. EC2 posts an interruption notice in the instance metadata about two minutes
  earlier; Ray's autoscaler does not read it. This guard does: it polls ``spot/instance-action`` (IMDSv2) and
  drains its node with the notice's time as the deadline. ``cluster.yaml`` starts one on every worker node.

Without a drain (a crash, or no notice), a lost node still resumes from the last periodic checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime

IMDS_URL = "http://169.254.169.254"


def drain_node(address: str, node_id: str, deadline_ms: int, message: str) -> tuple[bool, str]:
    """Ask the GCS to drain ``node_id`` for a preemption at ``deadline_ms`` (the call ``ray drain-node`` makes)."""
    import ray
    from ray.core.generated import autoscaler_pb2

    client = ray._raylet.GcsClient(address=address)
    return client.drain_node(node_id, autoscaler_pb2.DRAIN_NODE_REASON_PREEMPTION, message, deadline_ms)


def local_node_id(address: str, timeout_s: float = 120.0) -> str:
    """The id of the alive Ray node on this machine, waiting for it to register (the guard starts with the node)."""
    import ray
    from ray._private.services import get_node_ip_address

    ip = get_node_ip_address(address)
    client = ray._raylet.GcsClient(address=address)
    end = time.monotonic() + timeout_s
    while True:
        mine = [
            node_id.hex()
            for node_id, info in client.get_all_node_info().items()
            if info.node_manager_address == ip and info.state == info.ALIVE
        ]
        if len(mine) == 1:
            return mine[0]
        if len(mine) > 1:
            raise RuntimeError(f"{len(mine)} Ray nodes run on {ip}; pass --node-id")
        if time.monotonic() > end:
            raise RuntimeError(f"no alive Ray node on {ip} after {timeout_s:.0f}s")
        time.sleep(2)


def spot_notice(imds_url: str, timeout_s: float = 2.0) -> dict | None:
    """EC2's spot interruption notice (IMDSv2), or None while there is none. Raises OSError where there is no IMDS."""
    token_req = urllib.request.Request(
        f"{imds_url}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "300"}
    )
    with urllib.request.urlopen(token_req, timeout=timeout_s) as r:
        token = r.read().decode()
    req = urllib.request.Request(
        f"{imds_url}/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": token}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        if e.code == 404:  # EC2's answer while no interruption is scheduled
            return None
        raise


def notice_deadline_ms(notice: dict) -> int:
    """The notice's ``time`` (``2026-05-01T12:00:00Z``) in epoch milliseconds."""
    return int(datetime.fromisoformat(notice["time"].replace("Z", "+00:00")).timestamp() * 1000)


def watch(address: str, node_id: str, imds_url: str, poll_s: float) -> int:
    """Poll for a notice; drain once when it comes. Returns the exit code."""
    reached = False
    while True:
        try:
            notice = spot_notice(imds_url)
            reached = True
        except (OSError, ValueError) as e:
            if not reached:
                print(f"rayflux: no instance metadata at {imds_url} ({e}); not on EC2, nothing to guard")
                return 0
            print(f"rayflux: reading the spot notice failed ({e}); retrying", file=sys.stderr)
            notice = None
        if notice is not None:
            break
        time.sleep(poll_s)
    deadline_ms = notice_deadline_ms(notice)
    accepted, why_not = drain_node(address, node_id, deadline_ms, f"EC2 spot interruption notice: {notice}")
    if not accepted:
        print(f"rayflux: drain of node {node_id} refused: {why_not}", file=sys.stderr)
        return 1
    left = deadline_ms / 1000 - time.time()
    print(f"rayflux: node {node_id} drained for preemption ({notice['action']} in {left:.0f}s)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rayflux cluster spot-guard", description=__doc__.split("\n")[0])
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", ""), help="GCS address, host:port")
    p.add_argument("--node-id", default="", help="node to drain (default: the one Ray node on this machine)")
    p.add_argument("--poll-s", type=float, default=5.0, help="seconds between reads of the notice")
    p.add_argument("--imds-url", default=IMDS_URL, help="instance metadata endpoint")
    args = p.parse_args(argv)
    if not args.address:
        p.error("--address (or RAY_ADDRESS) is required")
    address = args.address.split("://", 1)[-1]
    node_id = args.node_id or local_node_id(address)
    print(f"rayflux: watching for a spot interruption notice for node {node_id}", flush=True)
    return watch(address, node_id, args.imds_url, args.poll_s)
