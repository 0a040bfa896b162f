"""A stopped trial's training workers hand their resources back.

When ASHA stops a trial, Tune ends the trial's actor, and with it the ``TorchTrainer``'s controller and workers; the
workers' placement group is the controller's job to remove. Ray Train leaves that to a detached cleaner that asks
Ray's state API (the dashboard) whether the controller still lives; on a Ray without the dashboard (the job's own
local Ray, the tests') it never learns, and every stopped trial would keep its workers' CPUs and GPUs reserved until
the sweep ends, starving the trials after it. So each trial's trainer records its placement groups in its run
directory (:func:`record_groups`), and the sweep's driver removes them (:func:`release`) when Tune is done with the
trial; a group the controller already removed is left alone.
"""

from __future__ import annotations

import logging

from rayflux import storage

log = logging.getLogger("rayflux")

GROUPS_FILE = "placement_groups.txt"
"""In a trial's run directory: the hex id of every placement group its trainer's worker groups ran in."""


def record_groups(trial_dir: str):
    """A Ray Train worker-group callback (runs in the trainer's controller) that appends each worker group's
    placement group id to ``GROUPS_FILE``."""
    from ray.train.v2._internal.execution.callback import WorkerGroupCallback

    class RecordGroups(WorkerGroupCallback):
        def after_worker_group_start(self, worker_group) -> None:
            pg = worker_group.get_worker_group_state().placement_group_handle.placement_group
            path = storage.join(trial_dir, GROUPS_FILE)
            old = storage.read_bytes(path).decode() if storage.exists(path) else ""
            storage.write_bytes_atomic(path, (old + pg.id.hex() + "\n").encode())

    return RecordGroups()


def release(trial_dir: str) -> int:
    """Remove the trial's recorded placement groups that still exist; returns how many were removed."""
    import ray
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    path = storage.join(trial_dir, GROUPS_FILE)
    if not storage.exists(path):
        return 0
    removed = 0
    for hex_id in storage.read_bytes(path).decode().split():
        pg = PlacementGroup(PlacementGroupID(bytes.fromhex(hex_id)))
        try:
            if placement_group_table(pg).get("state") in (None, "REMOVED"):
                continue
            remove_placement_group(pg)
            removed += 1
        except (ray.exceptions.RayError, ValueError) as exc:  # gone already, or its id unknown to this Ray
            log.debug("placement group %s: %s", hex_id, exc)
    if removed:
        log.info("sweep: released %d placement group(s) of the stopped trial in %s", removed, trial_dir)
    return removed
