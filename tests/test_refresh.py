"""Per-epoch cache refresh as coordinated stages, and a resumable stage ledger (real local Ray)."""

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import cache_sets
import numpy as np
import pytest

from rayflux import config, generation_stages, job, refresh
from rayflux.cache import generations
from rayflux.train.data import batching
from rayflux.train.data.batching import GenerationNotReadable, check_readable
from rayflux.train.observe.metrics import read_steps

ROOT = Path(__file__).resolve().parents[1]


def test_segments_cover_every_epoch_once():
    assert refresh.segments(3, 0) == [refresh.Segment(0, 0, 0, 3)]
    assert [(s.generation, s.first_epoch, s.end_epoch) for s in refresh.segments(3, 1)] == [
        (0, 0, 1),
        (1, 1, 2),
        (2, 2, 3),
    ]
    assert [(s.generation, s.first_epoch, s.end_epoch) for s in refresh.segments(5, 2)] == [
        (0, 0, 2),
        (1, 2, 4),
        (2, 4, 5),
    ]
    assert refresh.segments(2, 5) == [refresh.Segment(0, 0, 0, 2)]


def test_generation_seeds_differ_and_are_stable():
    seeds = [refresh.generation_seed(7, g) for g in range(4)]
    assert seeds[0] == 7 and len(set(seeds)) == 4
    assert seeds == [refresh.generation_seed(7, g) for g in range(4)]


def _settings(tiny_model, demo_images, out, *extra) -> list[str]:
    return [
        f"model.path={tiny_model}",
        f"data.images_dir={demo_images}",
        f"run.output_dir={out}",
        "data.resolution=64",
        # Square targets from non-square images leave room for the random crop to move.
        "data.max_aspect=1.0",
        "data.crop=random",
        "train.workers.num_workers=2",
        "cache.refresh=every_epoch",
        *extra,
    ]


def _cfg(tiny_model, demo_images, out, *extra):
    return config.load(None, _settings(tiny_model, demo_images, out, *extra))


def _stages(ledger_path) -> dict:
    return {s["name"]: s for s in json.loads(Path(ledger_path).read_text())["stages"]}


def _live_dirs(gen_dir: str) -> list[str]:
    key = str(Path(gen_dir).parent)
    return [
        d for d in generations.generation_dirs(key) if not generations.is_retired(d) and generations.load_manifest(d)
    ]


def _assert_refresh_protocol(ledger_path, history: list[dict], epochs: int, images: int):
    stages = _stages(ledger_path)
    for g in range(epochs):
        cache, train = stages[f"cache:g{g}"], stages[f"train:seg{g}"]
        assert cache["status"] == train["status"] == "done"
        # committed before the segment that reads it started
        assert cache["end"] <= train["start"]
        if g < epochs - 1:
            retire = stages[f"retire:g{g}"]
            # retired only after the segment that read it returned (every worker done)
            assert retire["status"] == "done" and retire["start"] >= train["end"]
            assert generations.is_retired(cache["dir"])
            # What a retired generation keeps is exactly what a live generation's index still points into.
            live = {f for d in _live_dirs(cache["dir"]) for f in generations.load_manifest(d)["borrowed"]}
            name = generations.generation_name(cache["dir"])
            kept = [f for f in generations.files_in(cache["dir"]) if f != generations.RETIRED]
            assert all(f"{name}/{f}" in live for f in kept), kept
    last = stages[f"cache:g{epochs - 1}"]["dir"]
    assert f"retire:g{epochs - 1}" not in stages and generations.load_manifest(last) is not None

    # Each epoch read exactly its own generation, and every sample exactly once (8 images, 2 ranks: no remainder).
    per_epoch: dict[int, dict] = {}
    for h in history:
        e = per_epoch.setdefault(h["epoch"], {"samples": 0, "generations": set()})
        e["samples"] += h["samples"]
        e["generations"].add(h["generation"])
    assert sorted(per_epoch) == list(range(epochs))
    for epoch, e in per_epoch.items():
        assert e["generations"] == {epoch}
        assert e["samples"] == images
    # The step counter runs on across trainer runs (each segment resumed from the last checkpoint).
    assert [h["step"] for h in history] == list(range(1, len(history) + 1))


def test_generations_differ_in_crops(ray_session, tiny_model, demo_images, tmp_path):
    cfg = _cfg(tiny_model, demo_images, tmp_path / "run")
    images, cache_root, out = job.resolve_dirs(cfg)
    cfg.data.images_dir = images
    from rayflux import models
    from rayflux.ledger import Ledger

    stages = generation_stages.GenerationStages(
        cfg, models.model_facts(cfg.model), Ledger(out, "x"), cache_root, False, job.Summary()
    )
    crops = []
    for g in (0, 1):
        rows = sorted(cache_sets.generation_rows(stages.generation(g)), key=lambda r: r["rel_path"])
        crops.append([(r["rel_path"], r["crop_left"], r["crop_top"]) for r in rows])
    assert [c[0] for c in crops[0]] == [c[0] for c in crops[1]]
    assert crops[0] != crops[1]
    # a generation built again with the same seed (by a later job: one job asks once) is reused, not rebuilt
    before = generations.load_manifest(stages.dirs[1])["committed_at"]
    again = generation_stages.GenerationStages(
        cfg, models.model_facts(cfg.model), Ledger(out, "x"), cache_root, False, job.Summary()
    )
    assert again.generation(1)["committed_at"] == before


def test_readers_refuse_uncommitted_and_retired_generations(tmp_path):
    gen = tmp_path / "key" / "g00000-abc"
    (gen / "samples").mkdir(parents=True)
    shard = gen / "samples" / "samples-b1-1.parquet"  # written by build b1
    shard.write_bytes(b"")
    with pytest.raises(GenerationNotReadable, match="not committed"):
        check_readable(str(gen))
    generations.commit(str(gen), {"files": [], "text_files": []}, [], "b1")
    assert not shard.exists()  # not listed by the manifest: commit removed it
    check_readable(str(gen))
    generations.retire(str(gen))
    with pytest.raises(GenerationNotReadable):
        check_readable(str(gen))


def test_a_centre_crop_refresh_references_the_previous_generation(ray_session, tiny_model, demo_images, tmp_path):
    """Nothing changed but the generation's seed: the new generation writes no shard; retiring the old one keeps
    exactly the files the new one reads, and retiring the new one then frees them."""
    from rayflux import models
    from rayflux.cache import verify
    from rayflux.ledger import Ledger

    cfg = _cfg(tiny_model, demo_images, tmp_path / "run", "data.crop=center")
    images, cache_root, out = job.resolve_dirs(cfg)
    cfg.data.images_dir = images
    stages = generation_stages.GenerationStages(
        cfg, models.model_facts(cfg.model), Ledger(out, "x"), cache_root, False, job.Summary()
    )
    m0, m1 = stages.generation(0), stages.generation(1)
    assert m1["encoded"]["samples"] == 0 and m1["reused"]["samples"] == m0["cached"] == 8
    assert sum(f["bytes"] for f in m1["files"]) == 0 < sum(f["bytes"] for f in m0["files"])
    assert set(m1["borrowed"]) >= {f"{generations.generation_name(m0['dir'])}/{f['path']}" for f in m0["files"]}
    before = {r["sample_id"]: r["latent"] for r in cache_sets.generation_rows(m0)}
    stages.retire(0)
    assert generations.is_retired(m0["dir"]) and generations.files_in(m0["dir"])
    assert verify.main([m1["dir"]], out=io.StringIO()) == 0
    refs = batching.index_samples(m1)
    planned, _ = batching.plan_epoch(refs, 2, seed=0, epoch=0, world_size=1)
    for item in batching.load_batches([{**p, "step": 1, "total_steps": 1} for p in planned]):
        lat = np.frombuffer(item["latent"], np.float32).reshape(json.loads(item["latent_shape"]))
        for sid, x in zip(json.loads(item["sample_ids"]), lat):
            assert x.tobytes() == before[sid]
    generations.retire(m1["dir"])
    assert generations.files_in(m0["dir"]) == [generations.RETIRED]


def test_changed_config_is_refused(ray_session, tiny_model, demo_images, tmp_path):
    from rayflux.ledger import ConfigChanged

    out = tmp_path / "run"
    job.run(_cfg(tiny_model, demo_images, out, "train.epochs=1", "cache.refresh=never"), only="cache")
    with pytest.raises(ConfigChanged, match="different training config"):
        job.run(_cfg(tiny_model, demo_images, out, "train.epochs=1", "train.optim.learning_rate=0.5"), only="cache")


def _job_cmd(out: Path, tiny_model, demo_images, *extra: str) -> list[str]:
    cmd = [sys.executable, str(ROOT / "jobs" / "train_flux.py")]
    for item in _settings(tiny_model, demo_images, out, *extra):
        cmd += ["--set", item]
    return cmd


def test_refresh_every_epoch_with_one_slow_worker_survives_a_killed_driver(
    ray_session, tiny_model, demo_images, tmp_path
):
    """Two epochs, one generation each, built, committed and retired in order; rank 1 lags every step, so a retire
    that waited only for rank 0 would start before its segment's end. The driver is SIGKILLed once its second segment
    is under way (generation 0 retired, generation 1 committed and being read); the same command then resumes without
    caching again or redoing the first segment, and the finished run passes every check of the refresh protocol.
    (One job for both: each alone cost a full run. Two epochs, not three: on the tests' 2-CPU Ray the next generation
    is built only after a segment ends, so a third epoch added a build and a segment after the resume, and no state
    at the kill that the second epoch lacks.)"""
    out = tmp_path / "run"
    cmd = _job_cmd(out, tiny_model, demo_images, "train.epochs=2", "run.debug_slow_rank=1:0.4")
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    ledger = out / "ledger.json"
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            if ledger.exists() and _stages(ledger).get("train:seg1", {}).get("status") == "running":
                break
            assert proc.poll() is None, "the job ended before it could be interrupted"
            time.sleep(0.5)
        else:
            pytest.fail("segment 1 never started")
        time.sleep(3)  # let segment 1 get going
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    killed_at = time.time()
    before = _stages(ledger)
    assert before["train:seg0"]["status"] == "done" and before["train:seg1"]["status"] == "running"
    assert before["cache:g1"]["status"] == "done"  # the generation segment 1 reads was committed before the kill

    # At once: the killed driver's lease (run.lease_seconds, 60 s) is taken over because its process is gone.
    rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    after = _stages(ledger)
    # Nothing cached again: the generations committed before the kill keep their stages.
    for g in (0, 1):
        assert after[f"cache:g{g}"]["start"] == before[f"cache:g{g}"]["start"] < killed_at, f"cache:g{g} was rebuilt"
    assert after["train:seg0"]["start"] == before["train:seg0"]["start"]  # not redone
    assert after["train:seg1"]["start"] > killed_at and after["train:seg1"]["status"] == "done"
    # The step counter continued: the run's step log holds steps 1..N once each, over both epochs.
    position = json.loads((Path(after["train:seg1"]["outputs"]["checkpoint"]) / "position.json").read_text())
    history = read_steps(str(out), last_step=position["step"])
    assert position["step"] == 2 * 8 // 2 and [h["step"] for h in history] == list(range(1, position["step"] + 1))
    _assert_refresh_protocol(ledger, history, epochs=2, images=8)
