"""Golden losses: the first steps of seeded tiny runs, recorded in tests/assets/golden_losses.json.

A change to the step (noise, σ sampling, weighting, guidance, caption dropout, LoRA init, optimizer, schedule)
moves these numbers far beyond the tolerance; float noise from another CPU or thread count stays well inside it.
After an intended change, rerecord with ``RAYFLUX_UPDATE_GOLDEN=1 pytest tests/test_train_golden.py`` and say why
in the commit.
"""

import json
import os
from pathlib import Path

import pytest

import train_data
from rayflux.train.trainer import LoraTrainer

ASSET = Path(__file__).parent / "assets" / "golden_losses.json"
SCENARIOS = {
    "defaults": {"overrides": [], "batches": 4},
    "full_step": {
        "overrides": [
            "train.gradient_accumulation=2",
            "train.optim.lr_scheduler=cosine",
            "train.optim.warmup_steps=1",
            "train.optim.learning_rate=0.02",
            "train.adapter.rank=8",
            "train.adapter.alpha=4",
            "train.adapter.lora_dropout=0.1",
            "train.flow.caption_dropout=0.3",
            "train.flow.guidance_max=4.0",
            "train.flow.sigma_sampling=flux_shift",
            "train.flow.loss_weighting=cosmap",
            "train.adapter.targets=all",
            "train.optim.max_grad_norm=0.01",
        ],
        "batches": 10,
    },
}
# Relative: recorded values are O(1), and reordered float32 sums drift by about 1e-6 over a few steps.
RTOL = 1e-4


def _losses(tiny_model, scenario: dict) -> list[float]:
    cfg = train_data.job(tiny_model, *scenario["overrides"])
    accumulation = cfg.train.gradient_accumulation
    groups = train_data.groups(train_data.items(scenario["batches"]), accumulation)
    trainer = LoraTrainer(cfg, "cpu", total_steps=len(groups), empty=train_data.empty_caption())
    return [trainer.train_step(g).loss for g in groups]


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_golden_losses(tiny_model, name):
    scenario = SCENARIOS[name]
    losses = _losses(tiny_model, scenario)
    if os.environ.get("RAYFLUX_UPDATE_GOLDEN"):
        recorded = json.loads(ASSET.read_text()) if ASSET.exists() else {}
        recorded[name] = {"overrides": scenario["overrides"], "batches": scenario["batches"], "losses": losses}
        ASSET.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    golden = json.loads(ASSET.read_text())[name]
    assert golden["overrides"] == scenario["overrides"] and golden["batches"] == scenario["batches"]
    assert losses == pytest.approx(golden["losses"], rel=RTOL)
