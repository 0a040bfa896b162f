"""The trainer in-process (no Ray): the step's options, gradient checkpointing, precision and exact resume."""

import dataclasses
import json
import time

import pytest
import torch

import train_data
from rayflux import phases
from rayflux.cache import shards, tensors
from rayflux.families import flux1
from rayflux.discovery.caption_hash import caption_id
from rayflux.train import step
from rayflux.train.adapter import lora
from rayflux.train.data import captions
from rayflux.train.resume import checkpoint
from rayflux.train.data.feed import FirstRow
from rayflux.train.trainer import LoraTrainer

FULL = (
    "train.gradient_accumulation=2",
    "train.optim.lr_scheduler=cosine",
    "train.optim.warmup_steps=1",
    "train.optim.learning_rate=0.01",
    "train.adapter.lora_dropout=0.2",
    "train.flow.caption_dropout=0.5",
    "train.flow.guidance_max=4.0",
    "train.flow.sigma_sampling=flux_shift",
    "train.flow.loss_weighting=cosmap",
)


def _weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in lora.lora_state_dict(trainer.transformer).items()}


def _run(trainer, groups) -> list[float]:
    return [trainer.train_step(g).loss for g in groups]


def test_gradient_checkpointing_changes_memory_not_maths(tiny_model):
    groups = train_data.groups(train_data.items(4), 2)
    runs = []
    for flag in ("false", "true"):
        # One after the other: each trainer seeds the process-wide RNG that LoRA dropout draws from.
        cfg = train_data.job(tiny_model, *FULL, f"train.gradient_checkpointing={flag}")
        trainer = LoraTrainer(cfg, "cpu", total_steps=2, empty=train_data.empty_caption())
        assert trainer.transformer.is_gradient_checkpointing == (flag == "true")
        runs.append((_run(trainer, groups), _weights(trainer)))
    (plain_losses, plain), (ckpt_losses, ckpt) = runs
    assert ckpt_losses == pytest.approx(plain_losses, rel=1e-6)
    for k, v in plain.items():
        torch.testing.assert_close(ckpt[k], v, rtol=1e-5, atol=1e-7)


def test_resume_from_a_checkpoint_continues_exactly(tiny_model, tmp_path):
    """4 steps straight == 2 steps, checkpoint, a fresh trainer restored from it, 2 more steps."""
    cfg = train_data.job(tiny_model, *FULL)
    groups = train_data.groups(train_data.items(8), 2)

    def fresh():
        return LoraTrainer(cfg, "cpu", total_steps=4, empty=train_data.empty_caption())

    straight = fresh()
    _run(straight, groups)

    first = fresh()
    _run(first, groups[:2])
    progress = checkpoint.Progress(step=2, batches_done=4, world_size=1)
    checkpoint.save(str(tmp_path), first, 0, progress, output_format="diffusers")
    del first
    torch.manual_seed(12345)  # whatever the process did in between must not matter

    resumed = fresh()
    restored = checkpoint.restore(str(tmp_path), resumed, 0, world_size=1)
    assert (restored.step, restored.batches_done) == (2, 4)
    # Only this worker's own accelerator RNG is saved (none on CPU), never every visible device's: a restart may
    # place workers on other devices.
    rng = torch.load(tmp_path / checkpoint.rng_file(0), map_location="cpu", weights_only=True)
    assert set(rng) == {"torch", "device", "python", "numpy"} and rng["device"].numel() == 0
    _run(resumed, groups[2:])
    for k, v in _weights(straight).items():
        torch.testing.assert_close(_weights(resumed)[k], v, rtol=0, atol=1e-7)

    # Control: the same restore without the saved RNG state (LoRA dropout draws from it) ends elsewhere.
    unseeded = fresh()
    checkpoint.restore(str(tmp_path), unseeded, 0, world_size=1)
    torch.manual_seed(0)
    _run(unseeded, groups[2:])
    assert any(not torch.allclose(_weights(unseeded)[k], v) for k, v in _weights(straight).items())


def test_dropped_captions_train_on_the_empty_embedding(tiny_model):
    empty = train_data.empty_caption()
    batch = train_data.groups(train_data.items(1), 1)[0][0]
    trainer = LoraTrainer(train_data.job(tiny_model), "cpu", total_steps=1)
    t = trainer.cfg.train
    # p = 0.999 with this batch's seed drops both samples (seeded, so not a matter of luck).
    dropped_cfg = dataclasses.replace(t, flow=dataclasses.replace(t.flow, caption_dropout=0.999))
    with torch.no_grad():
        args = (step.Runtime("cpu", torch.float32, trainer.family),)
        dropped = step.flow_loss(trainer.model, batch, dropped_cfg, True, empty, *args)
        by_hand = step.Batch(batch.latents, {n: empty.text[n].expand_as(x) for n, x in batch.text.items()}, batch.seed)
        expected = step.flow_loss(trainer.model, by_hand, t, True, None, *args)
        kept = step.flow_loss(trainer.model, batch, t, True, None, *args)
    assert float(dropped) == pytest.approx(float(expected), rel=1e-6)
    assert float(dropped) != pytest.approx(float(kept), rel=1e-3)


def test_bf16_autocast_runs_close_to_fp32(tiny_model):
    groups = train_data.groups(train_data.items(2), 2)
    losses = {}
    for precision in ("fp32", "bf16"):
        trainer = LoraTrainer(train_data.job(tiny_model, f"train.mixed_precision={precision}"), "cpu", total_steps=1)
        assert trainer.autocast is (torch.bfloat16 if precision == "bf16" else None)
        losses[precision] = _run(trainer, groups)
    assert losses["bf16"] != losses["fp32"]  # autocast really ran in bf16
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.05)


def test_empty_caption_is_read_from_where_the_index_says(tmp_path):
    from rayflux.cache import index, writer

    def row(caption, value):
        t5, clip = torch.full((3, 2), value), torch.full((2,), value + 1)
        return {
            "caption_id": caption_id(caption),
            "caption": caption,
            "t5_len": 3,
            "t5_dim": 2,
            "clip_dim": 2,
            "text_dtype": "float16",
            "t5": tensors.to_bytes(t5, "float16"),
            "clip_pooled": tensors.to_bytes(clip, "float16"),
            "encode_id": "e",
        }

    rows = [row("a cat", 1.0), row("", 5.0)]
    layout = shards.ShardLayout("text", "float16", latent_channels=16, vae_scale_factor=8, text=flux1.text_tensors(3))
    meta = writer.write_text({k: [r[k] for r in rows] for k in rows[0]}, str(tmp_path / "g00000-x"), layout, 0)
    (entry,) = [e for e in index.from_ipc(meta["index"][0]).to_pylist() if e["caption"] == ""]
    where = {**entry, "file": str(tmp_path / entry["file"]), "text_dtype": "float16", "text": layout.text}
    empty = captions.load_empty(where)
    assert torch.equal(empty.text["t5"], torch.full((3, 2), 5.0))
    assert torch.equal(empty.text["clip_pooled"], torch.full((2,), 6.0))
    with pytest.raises(ValueError, match="empty-caption"):
        captions.load_empty([])


def test_models_without_guidance_embedding_train_without_guidance(tmp_path):
    """A schnell-like model gets no guidance input (its time embedding would reject one)."""
    from rayflux.testing.tiny import TinySpec, ensure_tiny_model

    schnell = ensure_tiny_model(tmp_path / "tiny-schnell", TinySpec(guidance_embeds=False))
    trainer = LoraTrainer(train_data.job(schnell, "train.flow.guidance_max=4.0"), "cpu", total_steps=1)
    assert not trainer.guidance_embeds
    assert torch.isfinite(torch.tensor(_run(trainer, train_data.groups(train_data.items(2), 2)))).all()


def test_the_memory_estimate_uses_the_text_length_the_driver_passes(tiny_model):
    from rayflux import datasets, models
    from rayflux import gpu_memory

    cfg = train_data.job(tiny_model)
    given = LoraTrainer(cfg, "cpu", total_steps=1, text_length=7)  # as the Ray loop passes the driver's facts
    read = LoraTrainer(cfg, "cpu", total_steps=1)  # in-process without it: read from model.path
    length = models.model_facts(cfg.model).text_length
    assert read.text_length == length != 7 and given.text_length == 7
    pixels = max(ds.resolution for ds in datasets.datasets_of(cfg.data))
    per_token = gpu_memory.per_token_elements(dict(read.transformer.config), read.checkpointing)
    per_token *= cfg.train.batch_size * 4
    assert given.memory.activations == gpu_memory.tokens(pixels, 7) * per_token  # fp32 activations on CPU
    assert read.memory.activations == gpu_memory.tokens(pixels, length) * per_token


def test_the_model_loads_while_the_first_batch_is_still_being_read(tiny_model, tmp_path, monkeypatch):
    """The training loop's feed start overlaps the model load: the first planned row, read by a thread of its own
    (``FirstRow``), arrives here only once the model is loaded, and the trainer's LR horizon is still that row's."""
    marks = tmp_path / "phases.jsonl"
    monkeypatch.setenv(phases.ENV, str(marks))

    def rows():  # a read that ends only after the model has loaded; one after the other, it would wait its bound out
        end = time.monotonic() + 120
        while time.monotonic() < end and "model_load_end" not in (marks.read_text() if marks.exists() else ""):
            time.sleep(0.05)
        phases.mark("first_read_end")
        yield {"total_steps": 3}

    ahead = FirstRow(rows())
    cfg = train_data.job(tiny_model, "train.optim.lr_scheduler=linear")
    trainer = LoraTrainer(cfg, "cpu", total_steps=lambda: ahead.get()["total_steps"])
    order = [json.loads(x)["phase"] for x in marks.read_text().splitlines()]
    assert order == ["model_load_start", "model_load_end", "first_read_end"]
    for _ in range(3):
        trainer.optimizer.step()
        trainer.scheduler.step()
    assert trainer.scheduler.get_last_lr()[0] == 0.0  # the linear schedule ends at the row's 3 steps
