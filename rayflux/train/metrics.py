"""Training metrics: the per-step record, the throughput window, and TensorBoard event files (rank 0).

Event files go to ``<run dir>/tensorboard``. tensorboardX writes them (it comes with ``ray[train]`` and needs neither
TensorFlow nor the TensorBoard server); view them with ``tensorboard --logdir <run dir>/tensorboard``. For an
object-store run directory the files are written locally and copied up whenever the log is flushed.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time

from rayflux import storage

log = logging.getLogger(__name__)

REPORTED = ("loss", "lr", "grad_norm", "samples_per_s", "step_time")


class Throughput:
    """Samples per second and seconds per step over the steps since the last report."""

    def __init__(self):
        self.start, self.samples, self.steps = time.perf_counter(), 0, 0

    def add(self, samples: int) -> None:
        self.samples += samples
        self.steps += 1

    def take(self) -> dict:
        """The window's rates, then start a new window. ``add`` is given all ranks' samples of a step."""
        seconds = max(time.perf_counter() - self.start, 1e-9)
        out = {"samples_per_s": self.samples / seconds, "step_time": seconds / max(self.steps, 1)}
        self.__init__()
        return out


UPLOAD_SECONDS = 60.0
"""How often an object-store run copies its event files up between checkpoints, so that ``tensorboard --logdir
s3://...`` follows a long run."""


class TensorBoardLog:
    """Scalars and images for TensorBoard under ``<run_dir>/tensorboard``.

    ``purge_step``: the first step a resumed run logs again. TensorBoard then drops the events of that step and later
    that the interrupted run wrote after its last checkpoint, so no step shows twice.
    """

    def __init__(self, run_dir: str, purge_step: int | None = None, upload_seconds: float = UPLOAD_SECONDS):
        from tensorboardX import SummaryWriter

        self.remote = storage.join(run_dir, "tensorboard") if storage.is_uri(run_dir) else ""
        self.local = tempfile.mkdtemp(prefix="rayflux-tb-") if self.remote else os.path.join(run_dir, "tensorboard")
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
