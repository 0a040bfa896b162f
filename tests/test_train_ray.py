"""Training on a real local Ray with 2 workers: uneven buckets, checkpoints, exact resume, images, metrics, eval loss.

Five short TorchTrainer runs share one cache whose buckets hold 7, 5, 1 and 1 images:

- ``full``: 4 optimizer steps straight, with validation images, kohya output of every block layer (``targets=all``)
  and a checkpoint every step;
- ``resumed``: the same training stopped after step 1 (``max_steps=1``), then rerun under the same Ray Train run
  name, which restores the latest checkpoint and continues to step 4;
- ``evaluated``: 3 samples held out for the eval loss, steps 1-3, then resumed to step 6.

The first two train with schedule-free AdamW (the ``test`` extra installs it; plain AdamW where it is missing): its
eval/train swap around every checkpoint and render runs in the real loop, and the resumed run must still match the
straight one.
"""

import importlib.util
import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rayflux.cache.layout import decode_planned
from rayflux import config, datasets, job, models
from rayflux.cache import generations
from rayflux.testing.images import write_images
from rayflux.train import plan, stage
from rayflux.train.adapter import kohya, lora
from rayflux.train.data import batching, elastic
from rayflux.train.resume import checkpoint, commits
from rayflux.train.plan import FeedPlan

# 64x64, 80x48, 48x80 and 96x48 buckets at data.resolution=64.
SIZES = [(512, 512)] * 7 + [(640, 384)] * 5 + [(384, 640)] + [(768, 256)]
PROMPTS = ["a red circle", "a blue square", "a green ring"]
OPTIMIZER = "schedulefree_adamw" if importlib.util.find_spec("schedulefree") else "adamw"
WANDB = importlib.util.find_spec("wandb") is not None  # with the test extra; offline (tests/conftest.py)
COMMON = [
    "data.resolution=64",
    "train.workers.num_workers=2",
    "train.epochs=2",
    "train.batch_size=2",
    "train.gradient_accumulation=2",
    "train.optim.lr_scheduler=constant_with_warmup",
    "train.optim.warmup_steps=3",  # the resume lands inside warmup: the scheduler (or optimizer) state must come back too
    f"train.optim.name={OPTIMIZER}",
    "train.optim.learning_rate=0.01",
    "train.adapter.lora_dropout=0.1",  # draws from the global RNG: the saved RNG states must come back too
    "train.flow.caption_dropout=0.3",
    "train.flow.guidance_max=4.0",
    "train.flow.sigma_sampling=flux_shift",
    "train.flow.loss_weighting=cosmap",
    "train.checkpoint.every=1",
    "train.checkpoint.keep=2",
    "train.adapter.targets=all",  # 20 modules on the tiny model: peft shortens its target_modules from there on
]


def _cfg(base: list[str], *overrides: str) -> config.JobConfig:
    return config.load(None, [*base, *COMMON, *overrides])


@pytest.fixture(scope="module")
def cache(ray_session, tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("train-ray")
    write_images(root / "images", sizes=SIZES)
    base = [f"model.path={tiny_model}", f"data.images_dir={root / 'images'}", f"cache.dir={root / 'cache'}"]
    summary = job.run(_cfg(base, f"run.output_dir={root / 'cache-run'}"), only="cache")
    manifest = generations.load_manifest(summary.cache_dir)
    assert sorted(b["rows"] for b in manifest["buckets"].values()) == [1, 1, 5, 7]
    return root, base, manifest, models.model_facts(_cfg(base).model)


class _Lines(logging.Handler):
    """The driver's ``rayflux`` log lines (the plan line, the bar's plain lines when stdout is not a terminal)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def full_run(cache):
    """The ``full`` run and the driver's log lines while it ran."""
    root, base, manifest, facts = cache
    out = root / "full"
    cfg = _cfg(
        base,
        "run.name=full",
        "train.validation.every=2",
        "train.validation.inference_steps=2",
        f"train.validation.prompts={json.dumps(PROMPTS)}",
        "train.checkpoint.output_format=kohya",
    )
    logger, handler = logging.getLogger("rayflux"), _Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        result = stage.train(cfg, manifest, facts, str(out), False)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return result, out, handler.lines


@pytest.fixture(scope="module")
def full(full_run):
    return full_run[:2]


@pytest.fixture(scope="module")
def resumed(cache):
    """Step 1, then a second run that resumes there and trains steps 2-4. Ray keeps one checkpoint
    (``checkpoints_to_keep=1``), so the run's four saves also show the step LoRAs outliving pruned checkpoints."""
    root, base, manifest, facts = cache
    out = root / "resumed"
    keep_one = ("run.name=resumed", "train.checkpoint.keep=1")
    first = stage.train(_cfg(base, *keep_one, "train.max_steps=1"), manifest, facts, str(out), False)
    second = stage.train(_cfg(base, *keep_one), manifest, facts, str(out), False)
    return first, second


def test_uneven_buckets_give_both_ranks_the_same_steps_and_pure_batches(cache, full):
    _, _, manifest, _ = cache
    result, _ = full
    refs = batching.index_samples(manifest)
    bucket_of = {r.sample_id: r.bucket for r in refs}
    # 9 batches per epoch, cut to 8 by the remainder rule: 2 steps of 2 batches per rank per epoch, 2 epochs.
    assert [(h["step"], h["epoch"], h["index"], h["span"], h["world"]) for h in result.history] == [
        (1, 0, 0, 4, 2),
        (2, 0, 4, 4, 2),
        (3, 1, 0, 4, 2),
        (4, 1, 4, 4, 2),
    ]
    for epoch in (0, 1):
        planned = batching.plan_epoch(refs, 2, 0, epoch, 2, 2)[0]
        trained = [planned[h["index"] + k] for h in result.history if h["epoch"] == epoch for k in range(h["span"])]
        samples = [s.sample_id for b in trained for s in decode_planned(b["refs"])]
        assert len(samples) == len(set(samples)) == result.epoch_counts[epoch]["samples"]
        assert sum(h["samples"] for h in result.history if h["epoch"] == epoch) == len(samples)
        assert all(len({bucket_of[s.sample_id] for s in decode_planned(b["refs"])}) == 1 for b in trained)
        assert {b["size"] for b in trained} == {1, 2}  # uneven buckets: some batches are a bucket's short remainder
        assert result.epoch_counts[epoch]["batches"] == 8 and result.epoch_counts[epoch]["dropped"] > 0
    digests = checkpoint.read_digests(result.checkpoint_dir)
    assert sorted(digests) == [0, 1] and digests[0] != digests[1]


def test_the_driver_counts_optimizer_steps_with_accumulation(full_run):
    """gradient_accumulation=2: the plan line and the bar's last plain line count the 4 optimizer steps a worker
    trains (2 an epoch), not its 8 batches."""
    result, _, lines = full_run
    assert result.steps == 4
    train = [line for line in lines if line.startswith("train")]
    assert any(", 4 planned steps per worker;" in line for line in train), train
    bar = [line for line in train if line.startswith("train step ")]
    assert bar and bar[-1].startswith("train step 4/4 epoch 2/2 loss "), train


def test_metrics_are_reported_and_checkpoints_rotated(full):
    result, out = full
    assert result.steps == 4 and len(result.losses) == 4
    for key in ("loss", "lr", "grad_norm", "samples_per_s", "step_time"):
        assert isinstance(result.metrics[key], float), key
    assert result.metrics["step"] == 4
    # What the reads cost, per step and summed per epoch: fetched bytes stay within 5% over the tensors used (less
    # once captions come from a worker's cache). A request shared by two batches counts for the first one.
    for epoch in (0, 1):
        steps = [h for h in result.history if h["epoch"] == epoch]
        assert all(h["tensor_bytes"] > 0 for h in steps) and steps[-1]["epoch_read_requests"] >= 1
        assert steps[-1]["epoch_read_bytes"] == sum(h["read_bytes"] for h in steps)
        assert steps[-1]["epoch_tensor_bytes"] == sum(h["tensor_bytes"] for h in steps)
        assert 0 < steps[-1]["read_amplification"] <= 1.05
        assert steps[-1]["requests_per_sample"] == round(
            sum(h["read_requests"] for h in steps) / sum(h["samples"] for h in steps), 4
        )
    kept = [p for p in (out / "checkpoints" / "full").glob("checkpoint_*") if p.is_dir()]
    assert len(kept) == 2  # checkpoint_every=1 wrote 4, checkpoints_to_keep=2 kept the newest
    state = torch.load(Path(result.checkpoint_dir) / checkpoint.STATE_FILE, weights_only=True)
    # Schedule-free's training weights too: its LoRA files hold the average (see test_resumed_run_matches_...).
    kept_weights = {"train_weights"} if OPTIMIZER == "schedulefree_adamw" else set()
    assert {"optimizer", "scheduler"} | kept_weights == state.keys()
    position = json.loads((Path(result.checkpoint_dir) / commits.POSITION_FILE).read_text())
    assert (position["step"], position["epoch"], position["index"], position["world_size"]) == (4, 1, 8, 2)
    assert position["feed_done"] and position["resumed_at"] == [] and len(position["digest"]) == 64
    # Every kept checkpoint is committed: all ranks' files were in storage before the marker.
    assert all((p / commits.COMMIT_FILE).is_file() for p in kept)
    assert all(k.startswith("lora_unet_") for k in load_file(Path(result.checkpoint_dir) / kohya.KOHYA_NAME))


def test_validation_grids_are_written_and_decode(full):
    from PIL import Image

    result, out = full
    written = {h["step"]: h["validation_image"] for h in result.history if "validation_image" in h}
    assert sorted(written) == [2, 4]  # every 2 steps, and the last
    for step, path in written.items():
        assert Path(path) == out / "validation" / f"step-{step:06d}.png"
        with Image.open(path) as img:
            img.load()
            assert img.size == (128, 128)  # 3 prompts at 64 px in a 2x2 grid
            assert len(set(img.crop((0, 0, 128, 64)).getdata())) > 1  # rendered content, not a blank canvas


def test_validation_grids_are_the_in_process_render_of_each_step_lora(full, cache):
    """The render actor's grid of a step is what :func:`validation.render` draws in-process with that step's LoRA
    file on the base model (the training ranks never rendered it)."""
    import numpy as np
    from PIL import Image

    from rayflux.train.observe import validation

    _, out = full
    root, base, _, _ = cache
    cfg = _cfg(
        base,
        "run.name=full",
        "train.validation.inference_steps=2",
        f"train.validation.prompts={PROMPTS}",
        "train.checkpoint.output_format=kohya",
    )
    t = cfg.train
    transformer = models.load_transformer(cfg.model, "cpu", torch.float32)
    lora.add_lora(transformer, t.adapter.rank, t.adapter.alpha, t.adapter.targets, t.adapter.lora_dropout)
    transformer.eval()
    for step in (2, 4):
        lora.load_into(transformer, out / "validation" / f"step-{step:06d}.safetensors")  # kohya run: beside it
        expected = np.asarray(validation.grid(validation.render(transformer, cfg, "cpu", torch.float32)), np.int16)
        with Image.open(out / "validation" / f"step-{step:06d}.png") as img:
            drawn = np.asarray(img.convert("RGB"), np.int16)
        assert np.abs(drawn - expected).max() <= 2, step


def test_a_killed_renderer_never_stops_training(cache):
    """SIGKILL-like ``ray.kill`` of the render actor while it loads or renders step 1: training trains on to its
    last step and LoRA, and the driver logs why the later grids are missing."""
    import threading
    import time

    import ray

    root, base, manifest, facts = cache
    out = root / "killed"
    cfg = _cfg(
        base,
        "run.name=killed",
        "train.validation.every=1",
        "train.validation.inference_steps=2",
        f"train.validation.prompts={json.dumps(PROMPTS)}",
        "run.debug_slow_rank=0:1.5",
    )
    killed: list[float] = []

    def kill_once_rendering() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out / "lora" / "killed-step00000001.safetensors").exists():
            time.sleep(0.1)
        time.sleep(0.5)  # render 1 is queued: the actor is loading the base or rendering
        names = [n for n in ray.util.list_named_actors() if n.startswith("rayflux-renderer-")]
        ray.kill(ray.get_actor(names[0]))
        killed.append(time.time())

    killer = threading.Thread(target=kill_once_rendering, daemon=True)
    logger, handler = logging.getLogger("rayflux"), _Lines()
    logger.addHandler(handler)
    killer.start()
    try:
        result = stage.train(cfg, manifest, facts, str(out), False)
    finally:
        logger.removeHandler(handler)
        killer.join(timeout=130)
    assert result.steps == 4 and killed
    final = out / "lora" / "killed-step00000004.safetensors"
    assert final.stat().st_mtime > killed[0]  # the kill came while training was still running
    assert load_file(Path(result.checkpoint_dir) / lora.WEIGHT_NAME)
    assert not (out / "validation" / "step-000004.png").exists()
    assert any("validation renderer died" in line for line in handler.lines), handler.lines


def test_tensorboard_events_hold_the_reported_metrics(full):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result, out = full
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx(result.losses, rel=1e-6)
    for key in ("lr", "grad_norm", "samples_per_s", "step_time"):
        assert len(events.Scalars(f"train/{key}")) == 4, key
    assert [e.step for e in events.Images("validation")] == [2, 4]


def test_resumed_run_matches_the_straight_run(full, resumed):
    straight, _ = full
    first, second = resumed
    assert (first.steps, second.steps) == (1, 4)
    assert second.position["resumed_at"] == [1]  # the second run restored step 1 instead of starting over
    assert second.position["restarts"][0]["step"] == 1
    # Every rank trained the same batches in the same order as in the straight run, and so did the run as a whole.
    assert checkpoint.read_digests(second.checkpoint_dir) == checkpoint.read_digests(straight.checkpoint_dir)
    assert second.position["digest"] == straight.position["digest"]
    a = load_file(Path(straight.checkpoint_dir) / lora.WEIGHT_NAME)
    b = load_file(Path(second.checkpoint_dir) / lora.WEIGHT_NAME)
    assert a.keys() == b.keys()
    assert max(float(v.abs().max()) for k, v in a.items() if "lora_B" in k) > 1e-3  # it trained: B left zero
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)
    assert second.losses == pytest.approx(straight.losses, rel=1e-5)
    state = torch.load(Path(straight.checkpoint_dir) / checkpoint.STATE_FILE, map_location="cpu", weights_only=True)
    if OPTIMIZER == "schedulefree_adamw":  # the LoRA file is its average; the training point is kept for resume
        assert state["optimizer"]["param_groups"][0]["train_mode"] is True
        trained = sum(float(w.abs().sum()) for w in state["train_weights"])
        assert trained > 0 and abs(trained - sum(float(v.abs().sum()) for v in a.values())) > 1e-6


def test_every_checkpoint_leaves_a_named_kohya_lora(full):
    from safetensors import safe_open

    _, out = full
    names = sorted(p.name for p in (out / "lora").glob("full-step*.safetensors"))
    assert names == [f"full-step{s:08d}.safetensors" for s in (1, 2, 3, 4)]
    with safe_open(str(out / "lora" / names[-1]), "pt") as f:
        meta = f.metadata()
        assert all(k.startswith("lora_unet_") for k in f.keys())
    assert (meta["ss_steps"], meta["ss_epoch"], meta["ss_num_epochs"]) == ("4", "2", "2")
    assert meta["ss_network_dim"] == "4" and meta["modelspec.architecture"] == "flux-1-dev/lora"
    classes = {"adamw": "torch.optim.AdamW", "schedulefree_adamw": "schedulefree.AdamWScheduleFree"}
    assert meta["ss_optimizer"] == classes[OPTIMIZER]
    tags = json.loads(meta["ss_tag_frequency"])["full"]
    assert tags and all(count > 0 for count in tags.values())


def test_step_loras_outlive_pruned_checkpoints(cache, resumed, tiny_model):
    """checkpoints_to_keep=1 and four saves over two runs (the resumed fixture): Ray keeps one checkpoint, the run
    keeps all four LoRAs, each its own step's weights, loadable."""
    from diffusers import FluxPipeline

    root = cache[0]
    out = root / "resumed"
    assert len([p for p in (out / "checkpoints" / "resumed").glob("checkpoint_*") if p.is_dir()]) == 1
    names = sorted(p.name for p in (out / "lora").iterdir())
    assert names == [f"resumed-step{s:08d}.safetensors" for s in (1, 2, 3, 4)]
    files = [load_file(out / "lora" / n) for n in names]
    for a, b in zip(files, files[1:]):  # each is its own step's weights
        assert any(not torch.equal(a[k], b[k]) for k in a)
    pipe = FluxPipeline.from_pretrained(tiny_model)
    pipe.load_lora_weights(str(out / "lora"), weight_name=names[1])


EVAL = (
    "train.gradient_accumulation=1",
    "data.eval_samples=3",
    "train.eval.every=2",
    "train.checkpoint.every=2",
    *(["run.wandb_project=rayflux-test"] if WANDB else []),
)


@pytest.fixture(scope="module")
def evaluated(cache):
    """Eval loss on 3 held-out samples: steps 1-3 (evals at 0, 2, 3), then a resumed run to step 6 (evals at 4, 6).
    11 trained samples make 6 batches (3 steps) an epoch on 2 workers."""
    root, base, manifest, facts = cache
    out = root / "evaluated"
    first = stage.train(_cfg(base, "run.name=evaluated", *EVAL, "train.max_steps=3"), manifest, facts, str(out), False)
    second = stage.train(_cfg(base, "run.name=evaluated", *EVAL), manifest, facts, str(out), False)
    return first, second, out


def test_held_out_samples_are_listed_and_never_trained(cache, evaluated):
    _, base, manifest, _ = cache
    first, second, out = evaluated
    listed = (out / plan.EVAL_FILE).read_text().splitlines()
    refs = datasets.mix(batching.index_samples(manifest), datasets.sample_weights(_cfg(base).data))
    assert len(listed) == 3 and set(listed) <= {r.source for r in refs} and second.eval_samples == 3
    # Rebuild each rank's digest of trained batches from a plan without the listed sources: it must be the one the
    # workers chained over every batch they trained, across the resume.
    train_refs = [r for r in refs if r.source not in listed]
    rows = elastic.plan_rows(train_refs, FeedPlan(batch_size=2, seed=0, epochs=(0, 2), total_epochs=2), 2)
    want = {}
    for rank, mine in enumerate(rows):
        digest = ""
        for row in mine:
            row = {**row, "sample_ids": json.dumps([ref.sample_id for ref in decode_planned(row["refs"])])}
            digest = checkpoint.chain(digest, checkpoint.batch_key(row["step"], row))
        want[rank] = digest
    assert (first.steps, second.steps) == (3, 6)
    assert checkpoint.read_digests(second.checkpoint_dir) == want


def test_eval_loss_is_fixed_and_falls_with_training(cache, evaluated, tmp_path_factory):
    """The logged evals: a baseline at step 0, every 2 steps and at each run's end, per σ as well; the LoRA of step 3
    scored again in this process (one worker, not two) gives the logged number, and the same number twice."""
    from rayflux.train.observe import evaluation
    from rayflux.train.trainer import LoraTrainer

    root, base, manifest, _ = cache
    first, second, out = evaluated
    evals = second.evals
    assert [e["step"] for e in evals] == [0, 2, 3, 4, 6] and "loss" not in evals[0]
    assert all(len(e["eval_loss_sigmas"]) == 5 and e["eval_samples"] == 3 for e in evals)
    assert min(e["eval_loss"] for e in evals[1:]) < evals[0]["eval_loss"]  # it learned something that generalises
    cfg = _cfg(base, "run.name=evaluated", *EVAL)
    refs = datasets.mix(batching.index_samples(manifest), datasets.sample_weights(cfg.data))
    plan = batching.plan_eval(batching.split_held_out(refs, 3, cfg.cache.seed)[1], cfg.train.batch_size)
    trainer = LoraTrainer(cfg, "cpu", total_steps=1)
    lora.load_into(trainer.transformer, out / "lora" / "evaluated-step00000003.safetensors")
    evaluator = evaluation.Evaluator(trainer, plan, 0, 1, every=2, final_segment=True)
    a, b = evaluation.score(trainer, evaluator.batches, 1), evaluation.score(trainer, evaluator.batches, 1)
    assert a["eval_loss_sigmas"] == b["eval_loss_sigmas"] and a["eval_loss"] == b["eval_loss"]  # bitwise
    logged = next(e for e in evals if e["step"] == 3)
    assert a["eval_loss_sigmas"] == pytest.approx(logged["eval_loss_sigmas"], rel=1e-5)  # 2 workers vs 1
    # A sharded base runs a forward on every rank alike: a rank without a batch of its own scores an uncounted repeat.
    padded = evaluation.load(plan, 4, 5, pad=True)
    assert len(padded) == 1 and padded[0].live == 0 and padded[0].sample_ids
    assert evaluation.score(trainer, padded, 1)["eval_samples"] == 0
    # A restored checkpoint knows the best so far: an eval above it leaves the best (and its file) alone.
    saved = tmp_path_factory.mktemp("eval-ckpt")
    checkpoint.save(str(saved), trainer, 0, checkpoint.Progress(step=3, best_eval_loss=0.5, best_step=2), "diffusers")
    restored, written = checkpoint.restore(str(saved), trainer, 0, 1), []
    evaluator.run({"step": 4}, restored, written.append)
    assert (restored.best_step, restored.best_eval_loss, written) == (2, 0.5, [])
    evaluator.run(record := {"step": 5}, checkpoint.Progress(step=4, best_eval_loss=9.0, best_step=2), written.append)
    assert written == [record] and record["best_step"] == 5


def test_eval_loss_shows_in_tensorboard_and_the_summary(evaluated):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first, second, out = evaluated
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/eval_loss")] == [0, 2, 3, 4, 6]
    assert [e.value for e in events.Scalars("eval/loss_q0.1")] == pytest.approx(
        [e["eval_loss_sigmas"][0] for e in second.evals], rel=1e-6
    )
    summary = job.Summary(
        steps=6, losses=second.losses, eval_samples=3, eval_file="e.txt", best=(*second.best, "best.safetensors")
    )
    lines = summary.lines()
    assert "eval:       3 samples held out of training (e.txt)" in lines
    assert f"best:       eval loss {second.best[1]:.4f} at step {second.best[0]}: best.safetensors" in lines


@pytest.mark.skipif(not WANDB, reason="wandb is not installed")
def test_rank0_logs_steps_and_eval_loss_to_one_wandb_run_across_the_resume(evaluated):
    from wandb_support import offline_runs

    from rayflux.train.observe import wandb_log

    first, second, out = evaluated
    run_id = wandb_log.run_id(commits.run_storage(str(out), "evaluated"), "evaluated")
    runs = offline_runs(os.environ["WANDB_DIR"], run_id)  # offline, each trainer run writes its own part
    assert [r[0] for r in runs] == [run_id, run_id]
    history = {**runs[0][1], **runs[1][1]}
    assert [s for s in sorted(history) if "train/eval_loss" in history[s]] == [0, 2, 3, 4, 6]
    assert [history[s]["train/eval_loss"] for s in (0, 2, 3, 4, 6)] == pytest.approx(
        [e["eval_loss"] for e in second.evals], rel=1e-6
    )
    assert history[6]["eval/loss_q0.1"] == pytest.approx(second.evals[-1]["eval_loss_sigmas"][0], rel=1e-6)
    assert [history[h["step"]]["train/loss"] for h in second.history] == pytest.approx(second.losses, rel=1e-6)


def test_best_lora_is_the_lowest_eval_across_the_resume(evaluated):
    first, second, out = evaluated
    evals = second.evals
    best = min(evals, key=lambda e: e["eval_loss"])
    assert second.best == (best["step"], best["eval_loss"])  # the resumed run compared against the first run's best
    assert first.best == min(((e["step"], e["eval_loss"]) for e in evals if e["step"] <= 3), key=lambda x: x[1])
    note = json.loads((out / "lora" / "evaluated-best.json").read_text())
    assert (note["step"], note["eval_loss"]) == second.best
    got = load_file(out / "lora" / "evaluated-best.safetensors")
    want = load_file(out / "lora" / f"evaluated-step{best['step']:08d}.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_an_ema_run_evaluates_renders_and_exports_its_average(cache):
    """``train.optim.ema_decay`` through the real loop on 2 workers: each rank scores its share of the eval loss with its
    own EMA (the ranks' averages agree without communication), the best file is the EMA at the best step, every
    checkpoint leaves an ``-ema`` step file, and the validation render reads the step's EMA file."""
    root, base, manifest, facts = cache
    out = root / "ema"
    cfg = _cfg(
        base,
        "run.name=ema",
        "train.optim.name=adamw",
        "train.optim.ema_decay=0.5",
        "train.max_steps=2",
        "train.gradient_accumulation=1",
        "train.optim.lr_scheduler=constant",
        "train.optim.warmup_steps=0",
        "data.eval_samples=3",
        "train.eval.sigmas=2",
        "train.validation.inference_steps=1",
        f"train.validation.prompts={json.dumps(PROMPTS[:1])}",
    )
    result = stage.train(cfg, manifest, facts, str(out), False)
    assert result.steps == 2 and [e["step"] for e in result.evals] == [0, 2]
    lora_dir = out / "lora"
    for step in (1, 2):
        plain, ema = (load_file(lora_dir / f"ema-step{step:08d}{s}.safetensors") for s in ("", "-ema"))
        assert plain.keys() == ema.keys()
        # EMAModel's warmup: step 1 copies the weights (decay 0); step 2 averages (decay 2/11).
        assert all(torch.equal(plain[k], ema[k]) for k in plain) == (step == 1), step
    best_step, _ = result.best
    if best_step:  # the untrained baseline (step 0) has no step file to compare with
        best = load_file(lora_dir / "ema-best.safetensors")
        want = load_file(lora_dir / f"ema-step{best_step:08d}-ema.safetensors")
        assert all(torch.equal(best[k], want[k]) for k in want)
    assert (out / "validation" / "step-000002.png").is_file()  # rendered from ema-step00000002-ema.safetensors
    ema_dir = Path(result.checkpoint_dir) / checkpoint.EMA_DIR
    assert (ema_dir / lora.WEIGHT_NAME).is_file()
