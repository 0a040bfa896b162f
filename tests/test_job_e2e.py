"""End to end on a real local Ray: cache stage, 2-worker training, LoRA loaded back into diffusers."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import cache_sets
import numpy as np
import pyarrow.parquet as pq
import pytest

from pipeline_support import render

from rayflux import job
from rayflux.cache import generations
from rayflux.discovery.listing import IMAGE_EXTENSIONS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def finished_run(ray_session, tiny_model, demo_images, tmp_path_factory):
    from rayflux import config

    out = tmp_path_factory.mktemp("e2e") / "run"
    cfg = config.load(
        None,
        [
            f"model.path={tiny_model}",
            f"data.images_dir={demo_images}",
            f"run.output_dir={out}",
            "data.resolution=64",
            "train.epochs=2",
            "train.workers.num_workers=2",
            "cache.batch_size=8",
        ],
    )
    return job.run(cfg), cfg


def test_one_row_per_input_image(finished_run, demo_images):
    summary, _ = finished_run
    manifest = generations.load_manifest(summary.cache_dir)
    images = sorted(p.name for p in Path(demo_images).iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
    table = pq.ParquetDataset(generations.sample_files(manifest)).read()
    assert table.num_rows == len(images) == manifest["cached"] == summary.cached
    assert not {"t5", "clip_pooled"} & set(table.column_names)  # text lives once per caption, in the text shards
    assert sorted(table["rel_path"].to_pylist()) == images
    assert len(set(table["sample_id"].to_pylist())) == len(images)
    assert manifest["skipped"] == 0 and summary.discovered == len(images)


def test_shape_columns_match_stored_bytes(finished_run):
    summary, _ = finished_run
    manifest = generations.load_manifest(summary.cache_dir)
    for path in generations.sample_files(manifest):
        for row in pq.read_table(path).to_pylist():
            assert row["latent_dtype"] == "float32"
            c, h, w = row["latent_c"], row["latent_h"], row["latent_w"]
            assert len(row["latent"]) == c * h * w * 4
            assert (h * 8, w * 8) == (row["target_h"], row["target_w"])
            assert f"{row['target_w']}x{row['target_h']}" == row["bucket"]
            lat = np.frombuffer(row["latent"], np.float32).reshape(c, h, w)
            assert np.isfinite(lat).all() and lat.std() > 0
    for row in cache_sets.generation_text(manifest):  # text tensors decoded as the index says
        assert len(row["t5"]) == row["t5_len"] * row["t5_dim"] * 4
        assert len(row["clip_pooled"]) == row["clip_dim"] * 4


def test_losses_are_finite_and_recorded(finished_run):
    summary, _ = finished_run
    # 8 demo images, batch size 1, 2 workers, 2 epochs -> 8 steps per worker
    assert summary.steps == 8
    assert len(summary.losses) == summary.steps
    assert all(math.isfinite(x) for x in summary.losses)
    ledger = json.loads(Path(summary.ledger).read_text())
    assert [s["name"] for s in ledger["stages"]] == ["cache:g0", "train:seg0", "export"]
    assert all(s["status"] == "done" for s in ledger["stages"])


def test_lora_loads_into_diffusers_and_changes_output(finished_run, tiny_model):
    from diffusers import FluxPipeline

    summary, _ = finished_run
    lora = Path(summary.lora_path)
    assert lora.name == "pytorch_lora_weights.safetensors" and lora.is_file()

    pipe = FluxPipeline.from_pretrained(tiny_model)
    base = render(pipe)
    pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    assert any("lora" in n for n, _ in pipe.transformer.named_parameters())
    tuned = render(pipe)
    assert np.abs(tuned - base).max() > 1e-4


def test_rerun_reuses_the_committed_cache(finished_run, ray_session):
    summary, cfg = finished_run
    manifest_before = generations.load_manifest(summary.cache_dir)
    again = job.run(cfg, only="cache")
    assert again.cache_dir == summary.cache_dir
    assert generations.load_manifest(again.cache_dir)["committed_at"] == manifest_before["committed_at"]


def test_shorter_text_is_a_cache_key_of_its_own(tiny_model):
    """``model.text_tokens=16``: a cache key of its own (T5 runs unmasked, so the kept positions' embeddings depend
    on the length and must not mix with the default's). Its text tensors and a training run on them: the CLI job
    below runs with it."""
    from rayflux import config, models
    from rayflux.cache.keys import cache_key

    sets = [f"model.path={tiny_model}", "data.resolution=64"]
    plain, short = config.load(None, sets), config.load(None, [*sets, "model.text_tokens=16"])
    assert cache_key(plain, models.model_facts(plain.model)) != cache_key(short, models.model_facts(short.model))


_ENTRIES = {
    "jobs/train_flux.py": [sys.executable, str(ROOT / "jobs" / "train_flux.py")],
    "rayflux train": [str(Path(sys.executable).parent / "rayflux"), "train"],
}


def test_both_entries_are_the_same_job():
    """``jobs/train_flux.py`` (the README's entry, run in full by the ``ray job submit`` and driver-kill tests) and the
    installed ``rayflux train`` parse the same options into the same job."""
    helps = {}
    for entry, command in _ENTRIES.items():
        proc = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        helps[entry] = proc.stdout.split("\n", 1)[1]  # the usage line names the program; the rest must agree
    assert "--set" in helps["rayflux train"] and helps["rayflux train"] == helps["jobs/train_flux.py"]


def test_cli_demo_job_runs_as_a_subprocess(ray_session, tiny_model, tmp_path):
    """The installed ``rayflux train``, joined to the session's Ray through RAY_ADDRESS, with stdout and stderr one
    pipe (not a terminal): stage lines, plain progress lines and the summary last; Ray's chatter stays in its logs,
    what its C++ core prints on the driver's fd 2 included. (The same on a terminal: test_cluster_driver_terminal.)
    On this 2-CPU Ray one encoder process runs both cache passes (rayflux.cache.host) and is killed idle, so the C++
    core no longer prints ``core_worker.cc`` lines about pool actors here; Ray Data's progress is the chatter that
    must have reached the log. With ``model.text_tokens=16``, so that the same job shows the shorter
    text cached as 16-token tensors and trained on (one job less than a run of its own)."""
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address)
    env.pop("RAYFLUX_VERBOSE", None)
    out = tmp_path / "cli-run"
    proc = subprocess.run(
        [
            *_ENTRIES["rayflux train"],
            "--set",
            f"run.output_dir={out}",
            "--set",
            f"model.path={tiny_model}",
            "--set",
            "data.resolution=64",
            "--set",
            "train.max_steps=2",
            "--set",
            "model.text_tokens=16",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert "LoRA:" in proc.stdout and str(out) in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    chatter = ("TrainingReport(", "Execution plan of", "core_worker.cc", "Total Progress", "execution finished in")
    assert not [line for line in lines if any(c in line for c in chatter)], proc.stdout
    # There was chatter, and it went there: Ray Data's line for each finished dataset (its progress bars are off in CI,
    # RAY_DATA_DISABLE_PROGRESS_BARS=1, so "Total Progress" cannot be the sign).
    assert "execution finished in" in (out / "logs" / "ray-driver.txt").read_text()
    assert len(lines) <= 40, proc.stdout
    assert lines[-1].startswith("[rayflux] time:"), proc.stdout  # the summary is last
    assert any(line.startswith("[rayflux] train step 2/2 ") for line in lines), proc.stdout
    steps = [json.loads(x) for x in (out / "metrics" / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(math.isfinite(s["loss"]) for s in steps)
    # The shorter text: 16-token T5 tensors in the generation the steps above trained on.
    [cache] = [s for s in json.loads((out / "ledger.json").read_text())["stages"] if s["name"] == "cache:g0"]
    manifest = generations.load_manifest(cache["dir"])
    assert [(t["name"], t["length"]) for t in manifest["layout"]["text"]] == [("t5", 16), ("clip_pooled", 0)]
    rows = cache_sets.generation_text(manifest)
    assert rows and all(r["t5_len"] == 16 and len(r["t5"]) == 16 * r["t5_dim"] * 4 for r in rows)


def test_summary_reports_what_the_remainder_rule_dropped(finished_run):
    import dataclasses

    summary, _ = finished_run
    assert sorted(summary.dropped) == [0, 1]  # one count per epoch, from the training plan
    line = [x for x in dataclasses.replace(summary, dropped={0: 3, 1: 0}).lines() if x.startswith("remainder:")]
    assert len(line) == 1 and line[0].endswith("per epoch: 3, 0 (data.bucket_step)")


def test_summary_reports_what_the_last_epoch_s_reads_cost(finished_run):
    summary, _ = finished_run
    last = summary.history[-1]
    assert last["epoch_tensor_bytes"] > 0 and last["requests_per_sample"] > 0
    line = [x for x in summary.lines() if x.startswith("reads:")]
    assert line == [
        f"reads:      {last['requests_per_sample']:.2f} requests per sample, "
        f"{last['read_amplification']:.2f}x the tensors' bytes (epoch {last['epoch'] + 1})"
    ]
