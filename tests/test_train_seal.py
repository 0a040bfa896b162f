"""A sealed run directory: the seal waits for the step log's writer to die, and no writer starts after it (what a
sweep relies on to read a stopped trial's results only once its training processes are gone)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rayflux.sweep import seal
from rayflux.train.observe import metrics, writer_lock

ROOT = Path(__file__).resolve().parents[1]

# Rank 0 of a stopped trial that Ray has not ended yet: it goes on logging steps (and evals) into the run directory.
WRITER = """
import sys, time
from rayflux.train.observe import metrics
log = metrics.StepLog(sys.argv[1])
step = 0
while True:
    step += 1
    log.write({"step": step, "loss": 1.0, "eval_loss": 2.0 - step * 1e-4})
    if step == 1:
        print("writing", flush=True)
    time.sleep(0.01)
"""


def _lines(run_dir: Path) -> int:
    return len((run_dir / metrics.STEPS_DIR / "steps.jsonl").read_text().splitlines())


def test_a_seal_waits_for_the_writer_to_die_and_then_no_writer_starts(tmp_path):
    run_dir = tmp_path / "trial"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run_dir)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert not seal.seal(str(run_dir), timeout=0.3)  # a live writer: not sealed, and it goes on writing
        before = _lines(run_dir)
        time.sleep(0.2)
        assert _lines(run_dir) > before
        threading.Timer(0.5, proc.send_signal, (signal.SIGKILL,)).start()  # Ray ends the worker a moment later
        assert seal.seal(str(run_dir), timeout=60)
        assert proc.poll() is not None  # the seal returned only once the writer was gone
    finally:
        proc.kill()
        proc.wait()
    final = (run_dir / metrics.STEPS_DIR / "steps.jsonl").read_text()
    with pytest.raises(writer_lock.Sealed):  # a worker group its controller starts after the seal writes nothing
        metrics.StepLog(str(run_dir))
    assert (run_dir / metrics.STEPS_DIR / "steps.jsonl").read_text() == final
    assert [json.loads(x)["step"] for x in final.splitlines() if x.strip()][-1] > 1
    seal.unseal(str(run_dir))  # the trial runs again (a sweep rerun with resume_errored)
    log = metrics.StepLog(str(run_dir))
    log.write({"step": 1, "loss": 1.0})
    log.close()
    assert seal.seal(str(run_dir), timeout=1)  # a writer that closed its log holds nothing
