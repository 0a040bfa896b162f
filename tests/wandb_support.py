"""Reading an offline wandb run back without the network (``wandb.Api`` needs it): the records of its ``.wandb``
transaction log."""

from __future__ import annotations

import glob
import json
import os
import struct
import time

BLOCK = 32768  # wandb's transaction log (``run-<id>.wandb``): LevelDB-style blocks of framed protobuf records


def records(path: str):
    """The protobuf records of an offline run's ``.wandb`` file (``wandb.Api`` needs the network; this does not)."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK  # a block's tail too short for a header is padding
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):
            return  # a record still being written
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: the record is whole
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def offline_runs(root: str, run_id: str = "*", wait_s: float = 60.0) -> list[tuple[str, dict[int, dict]]]:
    """``(run id, history by step)`` of each offline run under ``root``, oldest first.

    ``run.finish()`` returns before wandb's service process has flushed the run's log to disk, so a file is read once
    it holds the run's ``exit`` record (the last one ``finish`` writes), waiting up to ``wait_s``."""
    paths = glob.glob(os.path.join(root, "wandb", "offline-run-*", f"run-{run_id}.wandb"))
    return [_offline_run(p, wait_s) for p in sorted(paths, key=os.path.getmtime)]


def _whole(path: str, wait_s: float) -> list:
    deadline = time.monotonic() + wait_s
    while True:
        found = list(records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in found):
            return found
        assert time.monotonic() < deadline, f"{path}: no exit record after {wait_s:g} s; the run never finished"
        time.sleep(0.1)


def _offline_run(path: str, wait_s: float) -> tuple[str, dict[int, dict]]:
    run_id, history = "", {}
    for r in _whole(path, wait_s):
        if r.WhichOneof("record_type") == "run":
            run_id = run_id or r.run.run_id  # later run records are updates that may leave the id out
        elif r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            history[r.history.step.num] = items
    return run_id, history
