"""Joining a Ray for the job: ``run.ray_address``, else ``RAY_ADDRESS``, else a running local head, else a Ray of the
job's own. A head that refuses the job is reported in one line with the ways out, not as Ray's traceback."""

from __future__ import annotations

import os
import re

from rayflux import console


class HeadRefused(RuntimeError):
    """A running Ray head refused this job's driver (token authentication); the message is the one line to show."""


def connect(address: str = "") -> None:
    """Join ``address``, else ``RAY_ADDRESS``, else a running local head, else start a local Ray.

    A head that refuses the job (another token) raises :class:`HeadRefused`, never a silent start of another Ray."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS", "")
    # A Ray this job starts for itself lives as long as the job and runs without the dashboard: its dozen processes
    # cost seconds of every start on a small machine, and the job prints its own progress. `ray start --head` gives
    # a dashboard; the job joins such a head.
    own = {"include_dashboard": False, **console.init_kwargs()}
    if address == "local":
        ray.init(address=address, **own)
        return
    try:
        ray.init(address=address or "auto", **console.init_kwargs())
    except ConnectionError as exc:
        refused = _refusal(exc)
        if refused:
            raise HeadRefused(refused) from exc
        if address:
            raise
        ray.init(**own)


def _refusal(exc: BaseException) -> str:
    """The one line for a head that refused the driver's token, or "" when ``exc`` is not a refusal.

    ``ray.init`` wraps Ray's AuthenticationError as text (a traceback inside a RuntimeError inside the
    ConnectionError), so the chain's text is searched."""
    text, link = "", exc
    while link is not None:
        text += f"\n{type(link).__name__}: {link}"
        link = link.__cause__ or link.__context__
    if "AuthenticationError" not in text and "InvalidAuthToken" not in text:
        return ""
    head = re.search(r"Failed to connect to Ray cluster at (\S+)", text)
    reason = re.search(r"InvalidAuthToken: ([^.\n]+)", text)
    return (
        f"the Ray head at {head.group(1) if head else 'the address Ray found'} refused this job: "
        f"{reason.group(1) if reason else 'token authentication failed'}; run a Ray of the job's own with "
        "--set run.ray_address=local, or give the job the head's token (RAY_AUTH_MODE=token with "
        "RAY_AUTH_TOKEN=<token> or RAY_AUTH_TOKEN_PATH=<file>)"
    )


def on_this_node() -> dict:
    """Actor options that keep an actor on this process's node, as Ray Train attaches its controller to the driver's:
    the job's own bookkeeping actors (the handoff, the progress board) hold state no restart could rebuild, so the loss
    of a worker's node (an elastic shrink) must not take them along."""
    import ray

    return {"label_selector": {ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()}}
