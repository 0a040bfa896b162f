"""A node lost inside a window the test holds open by construction (multi-node local cluster).

1. After a checkpoint is whole in storage but before Ray Train registers it. Ray Train's controller registers a
   checkpoint only when it next polls the workers. The test suspends the controller's process (SIGSTOP) once rank 0
   has entered the training loop, before any step can have been reported (rank 1 sleeps 2 s before each step, so
   step 2 cannot follow rank 0's start sooner), and resumes it only after worker node B is killed. A stopped
   controller cannot register anything, so B dies after rank 0's commit marker and before the registration every
   time, whatever the poll interval. The restarted worker group must resume from that committed checkpoint (Ray
   offers none), record the restart with its cause, and leave no checkpoint directory beyond
   ``train.checkpoint.keep``.
2. While the worker group, started beside the cache stage (``train.workers.start_during_cache``), waits for the
   committed generation. The test holds the cache key's lease, so the cache stage waits until the test lets go.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from cluster_support import cluster  # noqa: F401 - the fixture
from cluster_support import own_actor_process, ray_env, registered_checkpoint_dir, train_job_cmd, wait_for

from rayflux import config, lease, models
from rayflux.cache.keys import cache_key
from rayflux.train.resume import commits
from rayflux.train.observe.metrics import read_steps

PHASE_S = 420  # a bound for each phase to happen at all, on a busy 2-core machine; never a performance claim


def _committed_by_rank0(storage: Path) -> list[Path]:
    return [d for d in sorted(storage.glob("checkpoint_*")) if (d / commits.COMMIT_FILE).is_file()]


def test_a_node_lost_before_ray_registers_a_checkpoint_resumes_from_it(cluster, tiny_model, demo_images, tmp_path):
    node_a = cluster.add_node(num_cpus=1, resources={"trainer": 1})
    node_b = cluster.add_node(num_cpus=1, resources={"trainer": 1})
    out = tmp_path / "run"
    storage = out / "checkpoints" / "rayflux"
    # The suite's 0.5 s controller poll (conftest); the retry of the old size after B's loss gives up after 5 s (it
    # bounds only the placement-group wait, ready at once when the nodes exist).
    env = dict(ray_env(), RAY_ADDRESS=cluster.address, RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="5")
    cmd = train_job_cmd(
        f"model.path={tiny_model}",
        f"data.images_dir={demo_images}",
        f"run.output_dir={out}",
        "data.resolution=64",
        "train.epochs=1",
        "train.workers.num_workers=[1, 2]",
        "train.workers.worker_resources={trainer: 1}",
        "train.checkpoint.every=2",
        "train.checkpoint.keep=1",
        "train.workers.resize_check_seconds=1000",
        "train.report_seconds=1000000",
        "run.debug_slow_rank=1:2",
    )
    with open(tmp_path / "job.log", "wb") as log:
        job = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    controller = None
    try:
        # Rank 0 opens its TensorBoard file as it enters the training loop, before its first step: stop the
        # controller then. Checkpoints are the only reports (report_seconds), so step 2's is the first.
        wait_for(lambda: list((out / "tensorboard").glob("events.*")), PHASE_S, "rank 0 in the loop", 0.05, job)
        controller = own_actor_process("TrainController")
        assert controller is not None, "no TrainController process under this test's cluster"
        controller.suspend()
        assert registered_checkpoint_dir(storage) is None  # stopped before it could register anything
        # The step-2 checkpoint: every rank's files are in storage and rank 0 committed it; kill B at once. (The
        # ranks go on to step 4, whose report waits for the stopped controller to take step 2's: never committed.)
        [first] = wait_for(lambda: _committed_by_rank0(storage), PHASE_S, "a committed checkpoint", 0.05, job)
        assert registered_checkpoint_dir(storage) is None  # inside the window: Ray holds no checkpoint yet
        cluster.remove_node(node_b, allow_graceful=False)
        marker = json.loads((first / commits.COMMIT_FILE).read_text())
        killed = time.time()
        controller.resume()
        assert job.wait(timeout=PHASE_S) == 0, (tmp_path / "job.log").read_text()[-4000:]
    finally:
        if controller is not None and controller.is_running():
            controller.resume()  # a failed step above must not leave a stopped process behind
        if job.poll() is None:
            job.kill()
            job.wait()
        cluster.remove_node(node_a, allow_graceful=False)  # the module's next test brings nodes of its own

    assert marker["committed_by"] == "rank 0"  # by the workers, not by Ray registering it
    final = commits.read_json(commits.latest(str(storage)))
    [restart] = final["restarts"]
    # Resumed at the committed step 2, not from scratch, whatever Ray offered (nothing, unless it polled in between).
    assert restart["step"] == 2 and restart["from"] == first.name and final["resumed_at"] == [2]
    assert restart["cause"].startswith("rank ") and restart["time"] > killed  # the controller's failure record
    # Steps 1-2 on two workers (batches 0-3), then one worker: batches 4-7 as steps 3-6.
    history = read_steps(str(out), last_step=final["step"])
    assert [(h["step"], h["world"]) for h in history] == [(1, 2), (2, 2), (3, 1), (4, 1), (5, 1), (6, 1)]
    # The orphan-free rule: only the newest checkpoint (checkpoints_to_keep=1) is left in storage; the unregistered
    # step-2 checkpoint is gone.
    assert [d.name for d in storage.glob("checkpoint_*") if d.is_dir()] == [Path(commits.latest(str(storage))).name]


def _marked(marks: Path, phase: str) -> set[int]:
    """The processes that marked ``phase`` (whole lines only: a line being appended may be read half-written)."""
    text = marks.read_text() if marks.exists() else ""
    return {m["pid"] for m in map(json.loads, text.split("\n")[:-1]) if m["phase"] == phase}


def _loaded_and_waiting(marks: Path) -> set[int]:
    """Training workers that loaded the model and wait for the committed generation (none has it yet)."""
    return (_marked(marks, "handoff_wait_start") & _marked(marks, "model_load_end")) - _marked(
        marks, "handoff_wait_end"
    )


def _node_of(ray_cluster, pid: int):
    """The ``Cluster`` node whose raylet started process ``pid`` (Ray forks its workers from the raylet)."""
    import psutil

    ancestors = {p.pid for p in psutil.Process(pid).parents()}
    nodes = [ray_cluster.head_node, *ray_cluster.worker_nodes]
    [node] = [n for n in nodes if n.all_processes["raylet"][0].process.pid in ancestors]
    return node


def test_a_node_lost_while_the_early_group_waits_for_the_cache_stage(cluster, tiny_model, demo_images, tmp_path):
    """The worker group starts beside the cache stage (``train.workers.start_during_cache``), loads the model and
    waits for the committed generation. The test holds that window open by construction: it holds the cache key's
    lease itself, as another job building the same cache would, so the job's cache stage waits to build until the
    test lets go. Inside the window the node of the waiting worker is killed; Ray Train restarts the group
    (``train.workers.max_failures``) on the other node, whose new worker waits at the same handoff (on the driver's
    node), and only then does the test release the lease: the cache stage builds and commits, and the restarted
    group trains that generation to the end."""
    nodes = [cluster.add_node(num_cpus=1, resources={"trainer": 1}) for _ in range(2)]
    out, cache, marks = tmp_path / "run", tmp_path / "cache", tmp_path / "phases.jsonl"
    sets = [
        f"model.path={tiny_model}",
        f"data.images_dir={demo_images}",
        f"cache.dir={cache}",
        f"run.output_dir={out}",
        "data.resolution=64",
        "train.epochs=1",
        "train.workers.num_workers=1",
        "train.workers.worker_resources={trainer: 1}",
        "train.report_seconds=1000000",
    ]
    cfg = config.load(None, sets)
    key_dir = cache / cache_key(cfg, models.model_facts(cfg.model))
    env = dict(ray_env(), RAY_ADDRESS=cluster.address, RAYFLUX_PHASES=str(marks))
    held = lease.Lease(str(key_dir), "cache key (held by the test)", 6.0).acquire()
    try:
        with open(tmp_path / "job.log", "wb") as log:
            job = subprocess.Popen(train_job_cmd(*sets), env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            [first] = wait_for(lambda: _loaded_and_waiting(marks), PHASE_S, "a loaded worker waiting", 0.1, job)
            lost = _node_of(cluster, first)
            handoff = own_actor_process("Handoff")
            assert _node_of(cluster, handoff.pid) is cluster.head_node  # the driver's node (Ray prefers the head)
            cluster.remove_node(lost, allow_graceful=False)
            killed = time.time()
            # Ray Train restarts the group on the node left; its worker waits at the same handoff, still alive.
            [restarted] = wait_for(
                lambda: _marked(marks, "handoff_wait_start") - {first},
                PHASE_S,
                "the restarted worker waiting",
                0.1,
                job,
            )
            assert _node_of(cluster, restarted) in cluster.worker_nodes and handoff.is_running()
            assert not _marked(marks, "handoff")  # nothing was handed over yet
        finally:
            released = time.time()  # before the release: the cache stage cannot start building sooner
            held.release()  # the cache stage builds and commits generation 0 only now
        assert job.wait(timeout=PHASE_S) == 0, (tmp_path / "job.log").read_text()[-4000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        for node in set(nodes) & set(cluster.worker_nodes):
            cluster.remove_node(node, allow_graceful=False)

    # The cache stage waited for the test's lease, and built generation 0 after the loss; the first worker died
    # waiting for it, and the restarted one trained it.
    assert "waiting for" in (tmp_path / "job.log").read_text()
    assert first not in _marked(marks, "handoff_wait_end") and restarted in _marked(marks, "step_start")
    ledger = {s["name"]: s for s in json.loads((out / "ledger.json").read_text())["stages"]}
    built = ledger["cache:g0"]
    assert built["status"] == "done" and not built.get("reused") and built["start"] > released > killed
    assert ledger["train:seg0"]["generation"] == built["dir"] and ledger["train:seg0"]["status"] == "done"
    # One epoch of the 8 demo images on one worker, after a restart from scratch caused by the lost worker.
    final = commits.read_json(commits.latest(str(out / "checkpoints" / "rayflux")))
    [restart] = final["restarts"]
    assert restart["step"] == 0 and restart["from"] == "" and restart["cause"].startswith("rank 0: ")
    assert final["resumed_at"] == [0] and final["step"] == 8 and final["feed_done"]
    history = read_steps(str(out), last_step=final["step"])
    assert [(h["step"], h["world"]) for h in history] == [(s, 1) for s in range(1, 9)]
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
