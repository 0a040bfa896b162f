"""The stage ledger: a JSON file in the run directory recording every stage, written atomically.

A rerun of the same command reads it to skip finished stages; a rerun with a different config is refused.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from rayflux import storage

LEDGER = "ledger.json"


class ConfigChanged(RuntimeError):
    """The run directory belongs to a run with a different configuration."""


class Ledger:
    def __init__(self, output_dir: str, run_fingerprint: str, guard: Callable[[], None] | None = None):
        """``guard`` is called before every write and raises when this job may no longer write the run directory
        (its lease was taken over, see :mod:`rayflux.lease`)."""
        self.path = storage.join(output_dir, LEDGER)
        self.guard = guard
        self.data = {"run_fingerprint": run_fingerprint, "stages": []}
        if storage.exists(self.path):
            old = json.loads(storage.read_bytes(self.path))
            if old.get("run_fingerprint") != run_fingerprint:
                raise ConfigChanged(
                    f"{output_dir} holds a run with a different training config "
                    f"({old.get('run_fingerprint')} vs {run_fingerprint}); use a new run.output_dir, "
                    "or restore the original config to continue that run"
                )
            self.data = old

    def _save(self) -> None:
        if self.guard is not None:
            self.guard()
        storage.write_bytes_atomic(self.path, json.dumps(self.data, indent=1, sort_keys=True).encode())

    def find(self, name: str) -> dict | None:
        for s in reversed(self.data["stages"]):
            if s["name"] == name:
                return s
        return None

    def start(self, name: str, inputs: str, **info) -> dict:
        entry = {"name": name, "inputs": inputs, "status": "running", "start": time.time(), "end": None, **info}
        old = self.find(name)
        if old is not None:
            self.data["stages"].remove(old)
        self.data["stages"].append(entry)
        self._save()
        return entry

    def finish(self, entry: dict, status: str = "done", **outputs) -> None:
        entry.update(status=status, end=time.time(), outputs=outputs)
        self._save()

    def done(self, name: str, inputs: str) -> dict | None:
        s = self.find(name)
        return s if s and s["status"] == "done" and s["inputs"] == inputs else None
