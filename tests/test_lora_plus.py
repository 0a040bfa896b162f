"""LoRA+ (``train.lora_plus_ratio``, issue 45 item 4): the optimizer's groups and the step each matrix takes."""

import importlib.util

import pytest
import torch

import train_data
from rayflux import config
from rayflux.config import ConfigError
from rayflux.config.optimizer import OPTIMIZERS
from rayflux.train.adapter import lora
from rayflux.train.trainer import LoraTrainer

RATIO = 4.0
SETTINGS = {
    "adamw": ("train.optim.learning_rate=0.01", "train.optim.lr_scheduler=cosine"),
    "adafactor": ("train.optim.learning_rate=0.01", "train.optim.lr_scheduler=linear"),
    "schedulefree_adamw": ("train.optim.learning_rate=0.01", "train.optim.lr_scheduler=constant"),
}


def _needs(name: str):
    package = OPTIMIZERS[name].package
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package} is not installed")


def _step_deltas(tiny_model, name: str, adapter: str, ratio: float) -> dict:
    cfg = train_data.job(
        tiny_model,
        f"train.optim.name={name}",
        *SETTINGS[name],
        f"train.adapter.kind={adapter}",
        f"train.optim.lora_plus_ratio={ratio}",
        "train.optim.max_grad_norm=0",
    )
    trainer = LoraTrainer(cfg, "cpu", total_steps=4, empty=train_data.empty_caption())
    if ratio:
        lrs = [g["lr"] for g in trainer.optimizer.param_groups]
        assert lrs == pytest.approx([0.01, 0.01 * RATIO])
        b_ids = {id(p) for n, p in trainer.transformer.named_parameters() if ".lora_B." in n}
        assert {id(p) for p in trainer.optimizer.param_groups[1]["params"]} == b_ids
    # B starts at zero, which leaves A without a gradient on the first step: give both a seeded start.
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in sorted(trainer.transformer.named_parameters()):
            if ".lora_B." in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    before = {k: v.detach().clone() for k, v in lora.lora_state_dict(trainer.transformer).items()}
    trainer.train_step(train_data.groups(train_data.items(1), 1)[0])
    return {k: v - before[k] for k, v in lora.lora_state_dict(trainer.transformer).items()}


@pytest.mark.parametrize("name", [pytest.param(n, marks=_needs(n)) for n in SETTINGS])
def test_b_steps_ratio_times_as_far_as_without_lora_plus(tiny_model, name):
    """One step from the same start: A (and DoRA's magnitudes) move exactly as without LoRA+, B ratio times as far."""
    adapter = "dora" if name == "adamw" else "lora"
    off, on = (_step_deltas(tiny_model, name, adapter, r) for r in (0.0, RATIO))
    b_keys = [k for k in off if ".lora_B." in k]
    assert b_keys and len(b_keys) < len(off)
    for k in off:
        expected = off[k] * (RATIO if k in b_keys else 1.0)
        assert off[k].abs().max() > 0, k
        torch.testing.assert_close(on[k], expected, rtol=1e-3, atol=1e-7)


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (["train.adapter.kind=lokr", "train.checkpoint.output_format=kohya"], "Kronecker"),
        (["train.optim.name=prodigy", "train.optim.learning_rate=1.0"], "Prodigy"),
        ([], None),
    ],
)
def test_lora_plus_is_refused_where_it_cannot_apply(overrides, reason):
    if reason is None:
        with pytest.raises(ConfigError, match="0 \\(off\\) or positive"):
            config.load(None, ["train.lora_plus_ratio=-2"])
        return
    with pytest.raises(ConfigError, match=reason):
        config.load(None, ["train.lora_plus_ratio=16", *overrides])
    config.load(None, ["train.lora_plus_ratio=0", *overrides])  # off: the same settings load
    assert config.load(None, ["train.loraplus_lr_ratio=4"]).train.optim.lora_plus_ratio == 4  # kohya's name
