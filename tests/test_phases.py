"""Phase marks for benchmarks (rayflux.phases): one JSON line per mark when RAYFLUX_PHASES names a file, from every
process that inherits it; nothing at all when it is unset."""

from __future__ import annotations

import json
import subprocess
import sys

from rayflux import phases


def test_marks_from_several_processes_land_in_one_file_in_order(tmp_path, monkeypatch):
    path = tmp_path / "phases.jsonl"
    monkeypatch.setenv(phases.ENV, str(path))
    phases.mark("ray_start")
    code = "from rayflux import phases; phases.mark('worker_start')"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)  # inherits RAYFLUX_PHASES, as Ray's do
    phases.mark("step_end")
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["phase"] for x in lines] == ["ray_start", "worker_start", "step_end"]
    assert lines[0]["time"] <= lines[1]["time"] <= lines[2]["time"]
    assert lines[0]["pid"] == lines[2]["pid"] != lines[1]["pid"]


def test_no_file_is_written_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv(phases.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    phases.mark("ray_start")
    assert list(tmp_path.iterdir()) == []
