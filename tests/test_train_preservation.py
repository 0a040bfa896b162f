"""Output preservation (``train.preservation``): the class prompts, and the loss term whose target is the base
model's prediction, the adapter switched off."""

import dataclasses

import pytest
import torch
import train_data

from rayflux import config, models, preservation
from rayflux.train import flow, preserve, step, timesteps
from rayflux.train.data import batching
from rayflux.train.trainer import LoraTrainer


def test_class_caption_replaces_the_trigger_word_only():
    assert preservation.class_caption("photo of sks, smiling", "sks", "woman") == "photo of woman, smiling"
    assert preservation.class_caption("sks woman at sea", "sks", "") == "woman at sea"  # the trigger dropped
    assert preservation.class_caption("she asks sks", "sks", "woman") == "she asks woman"  # whole words only
    assert preservation.class_caption("a [t] dog", "[t]", "cat") == "a cat dog"  # a trigger that is no word
    assert preservation.class_caption("no trigger here", "sks", "woman") == "no trigger here"


def test_preservation_class_needs_a_trigger_word():
    with pytest.raises(config.ConfigError, match="data.trigger_word is empty"):
        config.load(None, ["train.preservation=class"])  # the key as issue 45 names it: an alias
    with pytest.raises(config.ConfigError, match="train.flow.preservation must be one of"):
        config.load(None, ["train.flow.preservation=prior"])
    cfg = config.load(None, ["train.flow.preservation=class", "data.trigger_word=sks", "data.class_word=woman"])
    assert preservation.words(cfg) == {"": ("sks", "woman")} and preservation.rule(cfg)
    assert preservation.rule(config.load(None, ["train.flow.preservation=blank"])) == ""  # blank needs no captions


def _items(n: int, seed: int = 0) -> list[dict]:
    """:func:`train_data.items` whose samples also carry a preservation prompt's text tensors, through the feed's
    row format (``preservation_`` prefixed text tensors, :data:`rayflux.cache.layout.SAMPLE_TEXTS`)."""
    g = torch.Generator().manual_seed(seed + 7)
    out = []
    for i, item in enumerate(train_data.items(n, seed=seed)):
        b = item["size"]
        text = {
            "t5": [torch.randn(train_data.T5, generator=g).numpy() for _ in range(b)],
            "clip_pooled": [torch.randn(train_data.CLIP, generator=g).numpy() for _ in range(b)],
        }
        batch = step.from_item(item)
        text.update({f"preservation_{k}": list(v.numpy()) for k, v in batch.text.items()})
        lat = {"latent": list(batch.latents.numpy())}
        plan = {k: item[k] for k in ("epoch", "index", "seed", "step", "total_steps", "bucket")}
        out.append(batching.stack_batch(plan, 0, [f"s{i}-{j}" for j in range(b)], lat, text))
    return out


def _trainer(tiny_model, *sets: str) -> LoraTrainer:
    cfg = train_data.job(tiny_model, "data.trigger_word=sks", "train.flow.preservation_weight=1", *sets)
    return LoraTrainer(cfg, "cpu", total_steps=4, empty=train_data.empty_caption())


def _draws(trainer: LoraTrainer, batch: step.Batch):
    """The noise and σ :func:`rayflux.train.step.flow_loss` draws for ``batch`` (seeded by it, in that order)."""
    t, (b, _, h, w) = trainer.cfg.train.flow, batch.latents.shape
    g = torch.Generator().manual_seed(batch.seed)
    noise = torch.randn(batch.latents.shape, generator=g)
    sigmas = flow.sample_sigmas(
        b,
        timesteps.method(t.sigma_sampling, trainer.family),
        g,
        logit_mean=t.logit_mean,
        logit_std=t.logit_std,
        shift=t.shift,
        seq_len=trainer.family.seq_len(h, w),
        shift_config=trainer.shift_config,
    )
    guidance = flow.sample_guidance(b, t.guidance, t.guidance_max, g) if trainer.guidance_embeds else None
    return noise, sigmas, guidance


@pytest.mark.parametrize("adapter", ["lora", "dora", "lokr"])
def test_the_preservation_target_is_the_base_models_prediction(tiny_model, adapter):
    """The term pulls the LoRA model's prediction on the preservation prompt towards the *base* model's: computed
    here with the base loaded afresh from ``model.path`` (no adapter at all), it is what the step adds. Were the
    adapter not switched off, the target would be the LoRA's own prediction and the term zero."""
    kohya = ["train.checkpoint.output_format=kohya"] if adapter == "lokr" else []  # LoKr exports only as kohya
    trainer = _trainer(tiny_model, "train.flow.preservation=class", f"train.adapter.kind={adapter}", *kohya)
    with torch.no_grad():  # a trained adapter: its predictions differ from the base's
        for k, p in enumerate(trainer.params):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
    batch = step.from_item(_items(1)[0])
    t, rt = trainer.cfg.train, step.Runtime("cpu", trainer.dtype, trainer.family)
    args = (trainer.guidance_embeds, trainer.empty, rt)
    with_term = step.flow_loss(trainer.model, batch, t, *args, shift_config=trainer.shift_config)
    plain_t = dataclasses.replace(t, flow=dataclasses.replace(t.flow, preservation="none"))
    plain = step.flow_loss(trainer.model, batch, plain_t, *args, shift_config=trainer.shift_config)

    noise, sigmas, guidance = _draws(trainer, batch)
    base = models.load_transformer(trainer.cfg.model, "cpu", trainer.dtype)
    kept = {n: x.to(trainer.dtype) for n, x in batch.preservation_text.items()}
    with torch.no_grad():
        want, lora = (
            step.predict(m, batch, batch.latents, noise, sigmas, text=kept, guidance=guidance, rt=rt)[0]
            for m in (base, trainer.model)
        )
    term = flow.flow_loss(lora, want, flow.loss_weights(sigmas, t.flow.loss_weighting))
    # The adapter moves the prediction: a term that can be told from 0.
    assert float(term) > 1e-3 * float(plain.detach())
    assert float(with_term.detach()) == pytest.approx(float(plain.detach()) + float(term), rel=1e-5)
    # The adapter is on again, and trains: the term's gradient reaches it.
    with_term.backward()
    assert all(p.requires_grad and p.grad is not None for p in trainer.params)


@pytest.mark.parametrize("mode", ["class", "blank"])
def test_preservation_at_weight_zero_trains_exactly_as_plain_lora(tiny_model, mode):
    """Its forwards draw nothing and switch the adapter back on: at weight 0 the LoRA after two steps is plain
    training's, bit for bit."""
    items = _items(2)
    trained = []
    for sets in (
        [f"train.flow.preservation={mode}", "train.flow.preservation_weight=0"],
        ["train.flow.preservation=none"],
    ):
        trainer = _trainer(tiny_model, *sets)
        for group in train_data.groups(items, 1):
            trainer.train_step(group)
        trained.append([p.detach().clone() for p in trainer.params])
    assert all(torch.equal(a, b) for a, b in zip(*trained))
    assert any(bool(p.abs().sum()) for p in trained[0])  # the steps trained something


def test_blank_preservation_uses_the_cached_empty_caption(tiny_model):
    """``blank``: every sample's preservation prompt is the cached empty caption (no per-sample text read)."""
    batch = step.from_item(train_data.items(1)[0])
    empty = train_data.empty_caption()
    got = preserve.prompts(batch, "blank", empty)
    assert all(torch.equal(got[n][j], empty.text[n]) for n in got for j in range(batch.latents.shape[0]))
    with pytest.raises(ValueError, match="no preservation prompts"):
        preserve.prompts(batch, "class", empty)
