"""Sweeps (``rayflux sweep``) on a real local Ray and Ray Tune: one cache build, four LoRAs, ASHA on eval loss, the
best LoRA kept; a standalone job with a trial's settings trains that trial's LoRA; a sweep killed mid-way continues."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from rayflux import job
from rayflux.cache import generations
from rayflux.config import ConfigError
from rayflux.sweep import config as sweep_config, driver
from rayflux.sweep.config import trial_job
from rayflux.train.adapter import lora_files
from rayflux.train.resume import commits

ROOT = Path(__file__).resolve().parents[1]


def _write(path: Path, sweep: dict, tiny_model, demo_images, out: Path, cache: Path, **train) -> Path:
    doc = {
        "sweep": sweep,
        "model": {"path": str(tiny_model)},
        "data": {"images_dir": str(demo_images), "resolution": 64, "eval_samples": 2},
        "cache": {"dir": str(cache)},
        "train": {"num_workers": 1, "cpus_per_worker": 0.5, "epochs": 1, "max_steps": 6, "eval_every": 2, **train},
        "run": {"output_dir": str(out), "lease_seconds": 4},
    }
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sweep-cache") / "cache"


@pytest.fixture(scope="module")
def swept(ray_session, tiny_model, demo_images, shared_cache, tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    space = {"train.optim.learning_rate": {"grid": [1.0e-4, 3.0e-3]}, "train.adapter.rank": {"grid": [2, 4]}}
    path = _write(
        root / "sweep.yaml",
        {"space": space, "max_concurrent": 2, "scheduler": "asha"},
        tiny_model,
        demo_images,
        root / "out",
        shared_cache,
    )
    sf = sweep_config.load(str(path))
    t0 = time.perf_counter()
    outcome = driver.run(sf)
    print(f"4-trial sweep: {time.perf_counter() - t0:.1f}s")
    return outcome, sf, root / "out"


def _ledger(run_dir) -> list[dict]:
    return json.loads((Path(run_dir) / "ledger.json").read_text())["stages"]


def test_four_trials_share_one_cache_build(swept, shared_cache):
    outcome, _, out = swept
    assert len(outcome.rows) == 4
    assert {(r.settings["train.optim.learning_rate"], r.settings["train.adapter.rank"]) for r in outcome.rows} == {
        (1e-4, 2),
        (1e-4, 4),
        (3e-3, 2),
        (3e-3, 4),
    }
    sweep_ledger = _ledger(out)
    builds = [s for s in sweep_ledger if s["name"] == "cache:g0"]
    assert len(builds) == 1 and not builds[0].get("reused")  # the sweep encoded the cache
    assert sorted(s["name"] for s in sweep_ledger if s["name"].startswith("trial:")) == sorted(
        f"trial:{r.trial}" for r in outcome.rows
    )
    manifests = [p for p in shared_cache.rglob(generations.MANIFEST)]
    assert len(manifests) == 1  # one committed generation, read by every trial
    for r in outcome.rows:
        stages = _ledger(out / "trials" / r.trial)
        cache = [s for s in stages if s["name"] == "cache:g0"]
        assert len(cache) == 1 and cache[0]["reused"] and cache[0]["dir"] == builds[0]["dir"]  # nothing encoded


def test_more_trials_than_slots_reuse_processes_and_lose_none(swept):
    """Four trials on two slots: the two that waited ran in the processes of the two before them (Tune's
    reuse_actors, through TrialTrainable.reset_config), each with its own settings in its own run directory, and
    none was lost or failed, an ASHA-stopped trial before them included (its trainer is ended before the next
    trial starts)."""
    outcome, _, out = swept
    info = {r.trial: json.loads((out / "trials" / r.trial / "trial.json").read_text()) for r in outcome.rows}
    assert all(info[r.trial]["settings"] == r.settings for r in outcome.rows)
    assert [r.status for r in outcome.rows if r.status not in ("finished", "stopped")] == []
    pids = [i["pid"] for i in info.values()]
    assert len(set(pids)) < len(pids), pids  # at least one process ran a second trial
    for pid in set(pids):  # one process ran its trials one after another, never two at once
        spans = sorted((i["started"], i.get("finished")) for i in info.values() if i["pid"] == pid)
        assert all(end is None or end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans)), spans


def test_results_table_and_best_lora(swept):
    outcome, _, out = swept
    table = pq.read_table(out / "sweep" / "results.parquet").to_pylist()
    assert (out / "sweep" / "results.csv").read_text().count("\n") == 5
    assert sorted(t["trial"] for t in table) == sorted(r.trial for r in outcome.rows)
    for r in outcome.rows:
        assert r.status in ("finished", "stopped"), r.error
        assert r.best is not None and r.best_lora and Path(r.lora).is_file()
        steps = [
            json.loads(x)
            for x in (out / "trials" / r.trial / "metrics").glob("steps*.jsonl")
            for x in x.read_text().splitlines()
            if x.strip()
        ]
        # The best is the eval of the LoRA the row hands out, as that file records it with its tensors, and no eval
        # the trial logged beats it: a stopped trial's workers, which Ray ends seconds after Tune stops the trial,
        # logged nothing after the table was read. The baseline (step 0, the base model) counts: a trial that only
        # got worse keeps the untrained LoRA. (The file may record one eval more than the log: a worker ended between
        # writing its best LoRA and logging the step.)
        assert (r.best_step, r.best) == lora_files.best_recorded(r.best_lora)
        evals = {s["step"]: s["eval_loss"] for s in steps if "eval_loss" in s}
        assert all(e >= r.best for e in evals.values()), (r, evals)
        assert evals.get(r.best_step) == r.best or r.best_step > max(s["step"] for s in steps), (r, evals)
        if r.status == "stopped":  # ASHA stopped it at a rung: it says where, and kept its best LoRA
            assert r.stopped_at is not None and r.stopped_at < 6 and r.lora == r.best_lora
        else:
            assert r.steps == 6 and r.lora.endswith(lora_files.lora.WEIGHT_NAME)
    assert outcome.best.best == min(r.best for r in outcome.rows)
    assert Path(outcome.best_lora).read_bytes() == Path(outcome.best.best_lora).read_bytes()
    assert list((out / "trials").glob("*/tensorboard/events.out.tfevents.*"))  # one folder, every trial's curves


def test_every_trial_lora_loads_in_diffusers(swept, tiny_model):
    from diffusers import FluxPipeline

    outcome, _, _ = swept
    pipe = FluxPipeline.from_pretrained(tiny_model)
    for r in outcome.rows:
        pipe.load_lora_weights(str(Path(r.lora).parent), weight_name=Path(r.lora).name, adapter_name=r.trial)
    assert {r.trial for r in outcome.rows} <= set(pipe.get_list_adapters()["transformer"])


def test_a_trial_rerun_standalone_trains_the_same_lora(swept, ray_session, tmp_path):
    from safetensors.torch import load_file

    outcome, sf, _ = swept
    done = next(r for r in outcome.rows if r.status == "finished")
    cfg = trial_job(sf.job, done.settings, str(tmp_path / "standalone"))
    summary = job.run(cfg)
    ours, theirs = load_file(summary.lora_path), load_file(done.lora)
    assert ours.keys() == theirs.keys()
    assert all((ours[k] == theirs[k]).all() for k in ours)


def test_sweep_keys_are_checked(tiny_model, demo_images, tmp_path):
    for sweep, fragment in [
        ({"space": {"train.adapter.rank": {"grid": [2]}}, "shceduler": "asha"}, "unknown sweep key sweep.shceduler"),
        ({"space": {"data.resolution": {"grid": [64]}}}, "is not a train.* setting"),
        ({"space": {"train.adapter.rank": {"range": [2, 4]}}}, "must be one of"),
    ]:
        path = _write(tmp_path / "s.yaml", sweep, tiny_model, demo_images, tmp_path / "o", tmp_path / "c")
        with pytest.raises(ConfigError, match=fragment.replace("*", r"\*")):
            sweep_config.load(str(path))


def test_killed_sweep_continues_where_it_stopped(swept, ray_session, tiny_model, demo_images, shared_cache, tmp_path):
    """Kill the sweep's driver while its second trial trains (after a checkpoint): the rerun keeps the finished trial
    and resumes the other from its checkpoint."""
    out = tmp_path / "out"
    space = {"train.optim.learning_rate": {"grid": [1.0e-4, 3.0e-3]}}
    path = _write(
        tmp_path / "sweep.yaml",
        {"space": space, "max_concurrent": 1, "scheduler": "fifo"},
        tiny_model,
        demo_images,
        out,
        shared_cache,
        checkpoint_every=2,
    )
    address = ray_session.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "rayflux", "sweep", "--config", str(path), "--set", f"run.ray_address={address}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    slow = ["--set", "run.debug_slow_rank=0:1.5"]  # the second trial's steps are slow enough to be caught mid-way
    proc = subprocess.Popen(cmd + slow, env=env, cwd=tmp_path, start_new_session=True)
    finished, running = None, None
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and proc.poll() is None:
        trials = [p for p in (out / "trials").glob("*") if (p / "trial.json").exists()]
        finished = next((p for p in trials if "finished" in json.loads((p / "trial.json").read_text())), None)
        running = next((p for p in trials if p != finished and list((p / "lora").glob("*-step*.safetensors"))), None)
        if finished and running:
            break
        time.sleep(0.5)
    assert finished and running, f"the sweep did not reach a second trial's checkpoint (exit {proc.poll()})"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    kept = (finished / "trial.json").read_text()
    time.sleep(5)  # the leases of the killed driver and trial expire (run.lease_seconds=4)
    rerun = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (finished / "trial.json").read_text() == kept  # the finished trial was not trained again
    resumed = json.loads((running / "trial.json").read_text())
    assert resumed["steps"] == 6
    stage = next(s for s in _ledger(running) if s["name"] == "train:seg0")
    position = commits.read_json(stage["outputs"]["checkpoint"])
    assert position["resumed_at"] and position["resumed_at"][0] >= 2  # from its checkpoint, not from scratch
    rows = pq.read_table(out / "sweep" / "results.parquet").to_pylist()
    assert sorted(r["status"] for r in rows) == ["finished", "finished"]


def test_a_sweep_whose_every_trial_fails_raises_the_first_error(
    ray_session, tiny_model, demo_images, shared_cache, tmp_path
):
    """Every trial fails in its training (a LoRA to start from that is not there): each is recorded with its error,
    and the sweep raises with the first one's error line (not Tune's whole remote traceback)."""
    out = tmp_path / "out"
    missing = [str(tmp_path / "missing-a.safetensors"), str(tmp_path / "missing-b.safetensors")]
    path = _write(
        tmp_path / "sweep.yaml",
        {"space": {"train.adapter.init_lora": {"grid": missing}}, "max_concurrent": 2, "scheduler": "fifo"},
        tiny_model,
        demo_images,
        out,
        shared_cache,
        max_failures=0,
    )
    with pytest.raises(RuntimeError, match=r"every trial of the sweep failed; the first \(\w+\): OSError: .*missing-"):
        driver.run(sweep_config.load(str(path)))
    rows = pq.read_table(out / "sweep" / "results.parquet").to_pylist()
    assert sorted(r["status"] for r in rows) == ["error", "error"]
    assert all("missing-" in r["error"] for r in rows), rows
    sweep_stage = next(s for s in _ledger(out) if s["name"] == "sweep")
    assert sweep_stage["status"] == "failed"
