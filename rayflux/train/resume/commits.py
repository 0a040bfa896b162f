"""Which checkpoints in storage are whole, which one a (re)started worker group resumes from, and pruning.

Ray Train registers a checkpoint only when its controller next polls the workers (every 0.5 s as the job sets
``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``; Ray's default is 2 s), after every rank has uploaded its files. A node lost
inside that window leaves a complete checkpoint in storage that Ray never heard of: it would restart from an older
one, or from step 0, and never prune the orphan. So rayflux marks completeness itself:

- after ``ray.train.report`` returns on every rank (each rank's upload is synchronous), an all-reduce lets rank 0
  know that every rank's files are in storage, and it writes ``COMMIT_FILE`` into the checkpoint directory;
- the controller also writes it when Ray registers a checkpoint (:class:`CommitCallback`), so a registered
  checkpoint is always committed, even if rank 0 died just before writing the marker.

Every worker-group start resumes from the newest committed checkpoint in storage (:func:`latest`), whatever Ray
offers; the data feed (:mod:`rayflux.train.data.feed`) plans from that checkpoint's position record and names it in every
row, so the loop restores exactly the checkpoint the plan was cut for. Failures the controller sees are written under
``<run storage>/restarts/`` (:class:`CommitCallback.after_exception`) and become the cause of the next restart's
record. :func:`prune` deletes every checkpoint directory that Ray never registered and that is older than the newest
one it holds, so orphans never outlive ``train.checkpoint.keep``; registered ones are Ray's to prune.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
import tempfile
import time

import pyarrow.fs as pafs
import ray.train

from rayflux import s3_objects, storage

log = logging.getLogger(__name__)

COMMIT_FILE = "rayflux-commit.json"
REGISTERED_FILE = "rayflux-registered.json"
"""Written by the controller when Ray registers a checkpoint: from then on only Ray deletes that directory."""
POSITION_FILE = "position.json"
RESTARTS_DIR = "restarts"
_RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"


def run_storage(output_dir: str, run_name: str) -> str:
    """Ray Train's directory for this run: ``<output_dir>/checkpoints/<run.name>``."""
    return storage.join(output_dir, "checkpoints", run_name)


def _dirs(run_storage: str) -> tuple[pafs.FileSystem, list[pafs.FileInfo]]:
    fs, inner = storage.resolve(run_storage)
    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    dirs = [i for i in infos if i.type == pafs.FileType.Directory and i.base_name.startswith("checkpoint_")]
    return fs, sorted(dirs, key=lambda i: i.base_name)  # Ray names them checkpoint_<time>: name order is time order


def committed(run_storage: str) -> list[str]:
    """The committed checkpoint directories of a run, oldest first, as paths or URIs like ``run_storage``."""
    fs, dirs = _dirs(run_storage)
    marks = [f"{d.path}/{COMMIT_FILE}" for d in dirs]
    found = {i.path for i in fs.get_file_info(marks) if i.type == pafs.FileType.File} if marks else set()
    return [storage.join(run_storage, d.base_name) for d, m in zip(dirs, marks) if m in found]


def latest(run_storage: str) -> str:
    """The newest committed checkpoint directory, or "" when there is none."""
    found = committed(run_storage)
    return found[-1] if found else ""


def checkpoint_at(checkpoint_dir: str) -> ray.train.Checkpoint:
    """A checkpoint directory in storage as Ray's ``Checkpoint`` (``as_directory`` downloads it when remote)."""
    fs, inner = storage.resolve(checkpoint_dir)
    return ray.train.Checkpoint(path=inner, filesystem=fs)


def download(checkpoint_dir: str, local_dir: str) -> str:
    """The checkpoint's files copied into ``local_dir`` (returned), by Ray's ``Checkpoint.to_directory``.

    That copy is pyarrow's ``copy_files``, whose requests the S3 SDK retries (503s, resets: :mod:`rayflux.s3_objects`)
    except one way: pyarrow hands the SDK a buffer the size of the object for a GET's body, and an error reply whose
    body is longer (S3's ``SlowDown`` XML against a small ``position.json`` or commit marker) overflows it. The SDK then
    fails the GET as ``INTERNAL_FAILURE ... Failed to flush response stream (eof: 0, bad: 1)``, its own error, not the
    server's, and never retries it (seen through tests/fault_proxy.py: every 503 on a GET of an object under its
    160-byte body, none on larger ones). So the whole copy is tried again here, up to ``RAYFLUX_S3_ATTEMPTS`` times with
    the SDK's backoff; the last failure is raised, naming the checkpoint. Trying again into the same directory is safe:
    ``copy_files`` waits for all its file copies before it fails, and opens each destination truncated, so a finished
    copy holds every file whole (25 downloads through 20% 503s and 12 bodies cut off, 19 of them tried again: all
    byte-exact)."""
    tries = s3_objects.attempts()
    for n in range(tries):
        try:
            return checkpoint_at(checkpoint_dir).to_directory(local_dir)
        except OSError as exc:
            if "Failed to flush response stream" not in str(exc):
                raise
            if n + 1 == tries:
                raise OSError(
                    f"{checkpoint_dir}: the checkpoint's download broke off {tries} times; last: {exc}"
                ) from exc
            log.warning("%s: checkpoint download broke off (%s); trying again", checkpoint_dir, exc)
            time.sleep(min(20.0, random.random() * 2**n))
    raise AssertionError("unreachable")


@contextlib.contextmanager
def downloaded(checkpoint_dir: str):
    """The checkpoint as a local directory, as ``Checkpoint.as_directory`` gives it: a local one itself, a remote one
    through :func:`download` into a temporary directory removed on exit."""
    if not storage.is_uri(checkpoint_dir):
        yield checkpoint_dir
        return
    local = tempfile.mkdtemp(prefix="rayflux-restore-")
    try:
        yield download(checkpoint_dir, local)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def read_json(checkpoint_dir: str, name: str = POSITION_FILE) -> dict:
    return json.loads(storage.read_bytes(storage.join(checkpoint_dir, name)))


def _mark(fs: pafs.FileSystem, path: str, by: str) -> None:
    with fs.open_output_stream(f"{path}/{COMMIT_FILE}") as f:
        f.write(json.dumps({"committed_by": by, "time": time.time()}).encode())


def commit(checkpoint: ray.train.Checkpoint, by: str = "rank 0") -> None:
    """Mark a persisted checkpoint (as ``ray.train.get_checkpoint()`` returns it) as complete."""
    _mark(checkpoint.filesystem, checkpoint.path, by)


def _registered(run_storage: str) -> list[str]:
    """The checkpoint directory names Ray Train's checkpoint manager holds (its snapshot in storage)."""
    try:
        snapshot = json.loads(storage.read_bytes(storage.join(run_storage, _RAY_SNAPSHOT)))
    except (OSError, ValueError):
        return []
    return [r["checkpoint_dir_name"] for r in snapshot.get("checkpoint_results", []) if "checkpoint_dir_name" in r]


def prune(run_storage: str) -> list[str]:
    """Delete the checkpoint directories Ray will never register or prune: those it never registered that are older
    than the newest it holds (newer ones may still be uploading or waiting for its poll). Returns what was deleted.

    A directory Ray registered carries ``REGISTERED_FILE`` and is left to Ray, even once its snapshot no longer lists
    it: Ray writes the snapshot before it deletes what it prunes, and fails on a directory already gone."""
    held = set(_registered(run_storage))
    if not held:
        return []
    newest_held = max(held)
    fs, dirs = _dirs(run_storage)
    older = [d for d in dirs if d.base_name < newest_held and d.base_name not in held]
    marks = fs.get_file_info([f"{d.path}/{REGISTERED_FILE}" for d in older]) if older else []
    gone = []
    for d, mark in zip(older, marks):
        if mark.type == pafs.FileType.NotFound:
            try:
                fs.delete_dir(d.path)
            except FileNotFoundError:
                continue
            gone.append(d.base_name)
    if gone:
        log.info("removed %d checkpoint(s) Ray Train never registered: %s", len(gone), ", ".join(gone))
    return gone


def failures_since(run_storage: str, since: str) -> tuple[list[str], str]:
    """``(causes, newest)``: the failures recorded after the record named ``since`` (all when ""), and the newest
    record's name, to store with the next checkpoint."""
    fs, inner = storage.resolve(storage.join(run_storage, RESTARTS_DIR))
    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    names = sorted(i.base_name for i in infos if i.base_name.endswith(".json") and i.base_name > since)
    causes = []
    for name in names:
        with fs.open_input_stream(f"{inner}/{name}") as f:
            causes.append(json.loads(f.read())["cause"])
    return causes, (names[-1] if names else since)


class CommitCallback(ray.train.UserCallback):
    """Runs in Ray Train's controller: commits every checkpoint Ray registers, and records every failure."""

    def __init__(self, run_storage: str):
        self.run_storage = run_storage

    def after_report(self, run_context, metrics, checkpoint) -> None:
        if checkpoint is None:
            return
        fs = checkpoint.filesystem
        with fs.open_output_stream(f"{checkpoint.path}/{REGISTERED_FILE}") as f:
            f.write(json.dumps({"time": time.time()}).encode())
        if fs.get_file_info(f"{checkpoint.path}/{COMMIT_FILE}").type == pafs.FileType.NotFound:  # rank 0 was first
            _mark(fs, checkpoint.path, "controller")

    def after_exception(self, run_context, worker_exceptions) -> None:
        cause = "; ".join(
            f"rank {rank}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            for rank, e in sorted(worker_exceptions.items())
        )
        record = {"time": time.time(), "cause": cause[:2000]}
        name = f"{time.time_ns():020d}.json"
        storage.write_bytes_atomic(storage.join(self.run_storage, RESTARTS_DIR, name), json.dumps(record).encode())


def record_restart(progress, run_storage: str, resume_from: str, offered) -> None:
    """Rank 0: record this worker-group start in ``progress`` when it is a restart (a checkpoint was restored, or
    the controller recorded a failure since the last checkpoint), with its cause."""
    causes, progress.failures_seen = failures_since(run_storage, progress.failures_seen)
    if not resume_from and not causes:
        return  # a fresh run
    offered_name = offered.path.rstrip("/").rsplit("/", 1)[-1] if offered else ""
    entry = {
        "step": progress.step,
        "from": resume_from.rstrip("/").rsplit("/", 1)[-1],
        "ray_offered": offered_name,
        "cause": "; ".join(causes) or "resumed by a new job, segment or resize",
        "time": time.time(),
    }
    progress.resumed_at.append(progress.step)
    progress.restarts.append(entry)
    log.warning(
        "restart at step %d from %s (Ray offered %s): %s",
        progress.step,
        entry["from"] or "scratch",
        offered_name or "none",
        entry["cause"],
    )
