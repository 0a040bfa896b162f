"""Training metrics: the per-step log, the throughput window, and TensorBoard event files (rank 0; the validation
render actor writes its images to an event file of its own in the same folder).

Every optimizer step appends one JSON line to ``<run dir>/metrics/steps.jsonl`` (step, epoch, plan position, loss,
lr, grad norm, samples/s, step time, what its reads cost and the epoch's read amplification so far; memory facts and
validation images at the steps that have them). The log only
grows by appending, so a step costs one line buffered by the OS, and checkpoints need not carry the history. A
restarted run logs the steps after its checkpoint again: readers keep the last line of each step
(:func:`read_steps`). For an object-store run directory the log is written locally and uploaded whenever metrics are
reported to Ray (every ``train.report_seconds``) and at checkpoints, in parts of at most ``PART_BYTES`` named
``steps-<start time>.jsonl``, so an upload never grows with the run's length.

Event files go to ``<run dir>/tensorboard``. tensorboardX writes them (it comes with ``ray[train]`` and needs neither
TensorFlow nor the TensorBoard server); view them with ``tensorboard --logdir <run dir>/tensorboard``. For an
object-store run directory the files are written locally and copied up whenever the log is flushed.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time

from rayflux import storage
from rayflux.train.observe import writer_lock

log = logging.getLogger(__name__)

REPORTED = (
    "loss",
    "lr",
    "grad_norm",
    "samples_per_s",
    "step_time",
    "read_amplification",
    "requests_per_sample",
    "eval_loss",
)
STEPS_DIR = writer_lock.LOCK_DIR
"""``metrics``: the step log's folder under the run directory, which also holds the lock a sweep seals."""
PART_BYTES = 8 << 20
"""An object-store step log starts a new part after this many bytes."""


class Throughput:
    """Samples per second and seconds per step of each step, measured from the end of the step before it."""

    def __init__(self):
        self.start = time.perf_counter()

    def take(self, samples: int) -> dict:
        """This step's rates (``samples``: all ranks' samples of the step), then start timing the next one."""
        now = time.perf_counter()
        seconds, self.start = max(now - self.start, 1e-9), now
        return {"samples_per_s": samples / seconds, "step_time": seconds}

    def restart(self) -> None:
        """Leave out time spent outside steps (rendering, checkpointing) from the next step's rates."""
        self.start = time.perf_counter()


def batch_reads(group: list[dict]) -> tuple[int, int, int]:
    """What reading one step's batches cost this rank: (bytes fetched, stored tensor bytes used, requests), from
    the figures each read task puts in its rows (:mod:`rayflux.cache.reads`)."""
    return tuple(sum(int(item.get(k, 0)) for item in group) for k in ("read_bytes", "tensor_bytes", "read_requests"))


class ReadTotals:
    """The epoch's read figures so far (all ranks), since the epoch began or this worker group started: a few
    numbers, whatever the run's length."""

    def __init__(self):
        self.epoch, self.samples, self.fetched, self.used, self.requests = None, 0, 0, 0, 0

    def add(self, epoch: int, samples: int, reads: tuple[int, int, int]) -> dict:
        """Count one step (``samples`` and ``reads`` summed over ranks); return the record's read fields."""
        if epoch != self.epoch:
            self.epoch, self.samples, self.fetched, self.used, self.requests = epoch, 0, 0, 0, 0
        self.samples += samples
        self.fetched += reads[0]
        self.used += reads[1]
        self.requests += reads[2]
        return {
            "read_bytes": reads[0],
            "tensor_bytes": reads[1],
            "read_requests": reads[2],
            "epoch_read_bytes": self.fetched,
            "epoch_tensor_bytes": self.used,
            "epoch_read_requests": self.requests,
            "read_amplification": round(self.fetched / max(self.used, 1), 4),
            "requests_per_sample": round(self.requests / max(self.samples, 1), 4),
        }


class StepLog:
    """Rank 0's append-only log of every optimizer step under ``<output_dir>/metrics``."""

    def __init__(self, output_dir: str):
        self.remote = storage.join(output_dir, STEPS_DIR) if storage.is_uri(output_dir) else ""
        self.hold = writer_lock.hold(
            output_dir
        )  # held while this process may write the run directory: a sweep waits for it
        if self.remote:
            self.local_dir = tempfile.mkdtemp(prefix="rayflux-steps-")
            self._new_part()
        else:
            self.local_dir = os.path.join(output_dir, STEPS_DIR)
            os.makedirs(self.local_dir, exist_ok=True)
            self.name = "steps.jsonl"
            path = os.path.join(self.local_dir, self.name)
            torn = _torn(path)
            self.file = open(path, "a", buffering=1)
            if torn:
                self.file.write("\n")  # a process killed mid-line left it torn: start clean after it
        self._upload: threading.Thread | None = None

    def _new_part(self) -> None:
        self.name = f"steps-{time.time_ns():020d}.jsonl"  # later parts sort after earlier ones, across restarts too
        self.file = open(os.path.join(self.local_dir, self.name), "a", buffering=1)

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")

    def sync(self, wait: bool = False) -> None:
        """Flush; for an object store, upload the current part in the background (``wait``: in the foreground)."""
        self.file.flush()
        if not self.remote:
            return
        if self._upload is not None and self._upload.is_alive():
            if not wait:
                return  # the previous upload is still running; the next sync sends what this one would have
            self._upload.join()
        path, size, name = self.file.name, self.file.tell(), self.name
        if size >= PART_BYTES:
            self.file.close()
            self._new_part()

        def upload() -> None:
            with open(path, "rb") as f:
                storage.write_bytes_atomic(storage.join(self.remote, name), f.read(size))

        self._upload = threading.Thread(target=upload, name="rayflux-step-log", daemon=True)
        self._upload.start()
        if wait:
            self._upload.join()

    def close(self) -> None:
        self.sync(wait=True)
        self.file.close()
        if self.hold is not None:
            self.hold.close()


def _torn(path: str) -> bool:
    """Does the file at ``path`` end inside a line?"""
    if not os.path.exists(path) or not os.path.getsize(path):
        return False
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def read_steps(output_dir: str, last_step: int | None = None, evals: bool = False) -> list[dict]:
    """The step log of a run, one record per step in step order: the last line logged for each step (a restart
    retrains the steps after its checkpoint), up to ``last_step`` when given. ``evals``: only the records with an
    eval loss, the baseline before the first step (step 0) included."""
    import pyarrow.fs as pafs

    fs, inner = storage.resolve(storage.join(output_dir, STEPS_DIR))
    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    parts = sorted(i.path for i in infos if i.base_name.startswith("steps") and i.base_name.endswith(".jsonl"))
    by_step: dict[int, dict] = {}
    for part in parts:
        with fs.open_input_stream(part) as f:
            for line in f.read().decode().splitlines():
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # the torn last line of a process killed mid-write
                    if "loss" in record or evals:  # the baseline eval record of step 0 trained nothing
                        by_step[int(record["step"])] = record
    out = [by_step[s] for s in sorted(by_step) if last_step is None or s <= last_step]
    return [r for r in out if "eval_loss" in r] if evals else out


UPLOAD_SECONDS = 60.0
"""How often an object-store run copies its event files up between checkpoints, so that ``tensorboard --logdir
s3://...`` follows a long run."""


class TensorBoardLog:
    """Scalars and images for TensorBoard under ``<output_dir>/tensorboard``.

    ``purge_step``: the first step a resumed run logs again. TensorBoard then drops the events of that step and later
    that the interrupted run wrote after its last checkpoint, so no step shows twice.
    """

    def __init__(self, output_dir: str, purge_step: int | None = None, upload_seconds: float = UPLOAD_SECONDS):
        from tensorboardX import SummaryWriter

        self.remote = storage.join(output_dir, "tensorboard") if storage.is_uri(output_dir) else ""
        self.local = tempfile.mkdtemp(prefix="rayflux-tb-") if self.remote else os.path.join(output_dir, "tensorboard")
        self.writer = SummaryWriter(self.local, flush_secs=30, purge_step=purge_step)
        self._upload_lock = threading.Lock()
        self._stop = threading.Event()
        if self.remote:
            threading.Thread(target=self._upload_every, args=(upload_seconds,), daemon=True).start()

    def _upload_every(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            try:
                self.flush()
            except Exception as exc:  # noqa: BLE001 - a failed copy is retried next time and at every checkpoint
                log.warning("could not copy TensorBoard events to %s: %s", self.remote, exc)

    def scalars(self, step: int, values: dict) -> None:
        for key in REPORTED:
            if key in values:
                self.writer.add_scalar(f"train/{key}", values[key], step)
        for q, v in zip(values.get("eval_quantiles", ()), values.get("eval_loss_sigmas", ())):
            self.writer.add_scalar(f"eval/loss_q{q:g}", v, step)  # per σ of the grid, by its density quantile

    def image(self, step: int, tag: str, image) -> None:
        """``image``: a PIL image."""
        import numpy as np

        self.writer.add_image(tag, np.asarray(image.convert("RGB")), step, dataformats="HWC")

    def flush(self) -> None:
        self.writer.flush()
        if not self.remote:
            return
        with self._upload_lock:  # the periodic upload and a checkpoint's flush never interleave their copies
            for name in os.listdir(self.local):
                with open(os.path.join(self.local, name), "rb") as f:
                    storage.write_bytes_atomic(storage.join(self.remote, name), f.read())

    def close(self) -> None:
        self._stop.set()
        self.flush()
        self.writer.close()
