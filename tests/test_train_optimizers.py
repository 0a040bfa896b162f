"""``train.optim.name`` in-process (no Ray): exact resume for every optimizer that runs on CPU, schedule-free's
eval/train swap, the refusals (GPU-only on CPU, a missing package) and the memory model.

prodigyopt and schedulefree come from the ``test`` extra; without them their cases are skipped.
"""

import importlib.util

import pytest
import torch

import train_data
from rayflux import config, families, gpu_memory
from rayflux.config import ConfigError
from rayflux.config.optimizer import OPTIMIZERS
from rayflux.config.placement import Cluster, validate_for_cluster
from rayflux.train import optim
from rayflux.train.adapter import lora
from rayflux.train.resume import checkpoint
from rayflux.train.trainer import LoraTrainer

OPTIONS = ("train.gradient_accumulation=2", "train.adapter.lora_dropout=0.2")
SCHEDULE_FREE = ("train.optim.lr_scheduler=constant_with_warmup", "train.optim.warmup_steps=1")  # its own warmup
SETTINGS = {
    "adamw": ("train.optim.learning_rate=0.01", "train.optim.lr_scheduler=cosine"),
    "prodigy": ("train.optim.learning_rate=1.0", "train.optim.lr_scheduler=cosine"),
    "adafactor": ("train.optim.learning_rate=0.01", "train.optim.lr_scheduler=cosine"),
    "schedulefree_adamw": ("train.optim.learning_rate=0.01", *SCHEDULE_FREE),
}


def _needs(name: str):
    package = OPTIMIZERS[name].package
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package} is not installed")


def _weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in lora.lora_state_dict(trainer.transformer).items()}


def _run(trainer, groups) -> None:
    for g in groups:
        trainer.train_step(g)


@pytest.mark.parametrize("name", [pytest.param(n, marks=_needs(n)) for n in SETTINGS])
def test_each_optimizer_resumes_bitwise(name, tiny_model, tmp_path):
    """4 steps straight == 2 steps, checkpoint, a fresh trainer restored from it, 2 more: bitwise equal LoRA."""
    cfg = train_data.job(tiny_model, *OPTIONS, f"train.optim.name={name}", *SETTINGS[name])
    groups = train_data.groups(train_data.items(8), 2)

    def fresh():
        return LoraTrainer(cfg, "cpu", total_steps=4, empty=train_data.empty_caption())

    straight = fresh()
    start = _weights(straight)
    _run(straight, groups)
    assert all(not torch.equal(start[k], v) for k, v in _weights(straight).items())  # every tensor trained

    first = fresh()
    _run(first, groups[:2])
    checkpoint.save(str(tmp_path), first, 0, checkpoint.Progress(step=2, batches_done=4, world_size=1), "diffusers")
    del first
    torch.manual_seed(12345)  # whatever the process did in between must not matter

    resumed = fresh()
    checkpoint.restore(str(tmp_path), resumed, 0, world_size=1)
    if name == "prodigy":  # its step-size estimate's running sums are part of the restored state
        assert resumed.optimizer.param_groups[0]["d_numerator"] > 0
    _run(resumed, groups[2:])
    if name == "prodigy":  # and its estimate grew after the resume
        assert resumed.optimizer.param_groups[0]["d"] > resumed.optimizer.param_groups[0]["d0"]
    for k, v in _weights(straight).items():
        assert torch.equal(_weights(resumed)[k], v), k


@_needs("schedulefree_adamw")
def test_schedulefree_evaluates_and_exports_its_average_and_trains_on_unchanged(tiny_model, tmp_path):
    """optimizer_eval swaps schedule-free's averaged weights in (what renders and checkpoints' LoRA files get) and
    puts the exact training weights back; a checkpoint's LoRA file holds the average."""
    cfg = train_data.job(tiny_model, *OPTIONS, "train.optim.name=schedulefree_adamw", *SETTINGS["schedulefree_adamw"])
    groups = train_data.groups(train_data.items(4), 2)
    trainer = LoraTrainer(cfg, "cpu", total_steps=2, empty=train_data.empty_caption())
    _run(trainer, groups)
    training = _weights(trainer)
    with trainer.optimizer_eval():
        assert trainer.optimizer.param_groups[0]["train_mode"] is False
        averaged = _weights(trainer)
    assert trainer.optimizer.param_groups[0]["train_mode"] is True
    assert any(not torch.equal(averaged[k], v) for k, v in training.items())  # the average is not the train point
    assert all(torch.equal(_weights(trainer)[k], v) for k, v in training.items())  # put back exactly

    checkpoint.save(str(tmp_path), trainer, 0, checkpoint.Progress(step=2, world_size=1), "diffusers")
    assert all(torch.equal(_weights(trainer)[k], v) for k, v in training.items())
    fresh = LoraTrainer(cfg, "cpu", total_steps=2, empty=train_data.empty_caption())
    lora.load_into(fresh.transformer, tmp_path / lora.WEIGHT_NAME)
    for k, v in averaged.items():
        assert torch.equal(_weights(fresh)[k], v), k
    state = torch.load(tmp_path / checkpoint.STATE_FILE, map_location="cpu", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["train_mode"] is True


def test_adamw8bit_is_refused_on_cpu_before_any_work():
    with pytest.raises(ConfigError, match="adamw8bit needs a CUDA GPU"):
        config.load(None, ["train.optim.name=adamw8bit", "train.workers.on_gpu=false"])
    cfg = config.load(None, ["train.optim.name=AdamW8bit"])  # kohya's spelling
    assert cfg.train.optim.name == "adamw8bit"
    with pytest.raises(ValueError, match="adamw8bit needs a CUDA GPU"):
        validate_for_cluster(cfg, Cluster(gpus=False))  # the driver, before the cache stage
    validate_for_cluster(cfg, Cluster(gpus=True))
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        optim.check_worker("adamw8bit", "cpu")


def test_a_worker_refuses_before_loading_the_model(tmp_path):
    # A model.path that does not exist: loading first would fail on it; the refusal comes before any load.
    cfg = config.load(None, [f"model.path={tmp_path / 'absent'}", "train.optim.name=adamw8bit"])
    with pytest.raises(RuntimeError, match="^train.optim.name=adamw8bit needs a CUDA GPU"):
        LoraTrainer(cfg, "cpu", total_steps=1)


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None, reason="bitsandbytes is installed")
def test_a_missing_optimizer_package_names_its_extra():
    with pytest.raises(RuntimeError, match=r"bitsandbytes, which is not installed: pip install 'rayflux\[adamw8bit"):
        optim.check_worker("adamw8bit", "cuda")  # the package check needs no GPU to fail


def test_optimizer_config_names_and_rules():
    cfg = config.load(None, ["train.optimizer_type=AdamWScheduleFree", "train.optim.lr_scheduler=constant_with_warmup"])
    assert cfg.train.optim.name == "schedulefree_adamw"
    assert config.load(None, ["train.optim.name=prodigyopt.Prodigy"]).train.optim.name == "prodigy"
    with pytest.raises(ConfigError, match="replaces the LR schedule"):
        config.load(None, ["train.optim.name=schedulefree_adamw", "train.optim.lr_scheduler=cosine"])
    with pytest.raises(ConfigError, match="train.optim.name must be one of"):
        config.load(None, ["train.optim.name=lion"])
    text = config.help_text()
    assert "train.optim.name = 'adamw'" in text and "1.0 by its convention" in text
    assert "train.optimizer_type -> train.optim.name" in text and "adamwschedulefree -> schedulefree_adamw" in text


def test_the_memory_model_counts_each_optimizers_state():
    per = {n: gpu_memory.lora_bytes_per_param(n, rank=16) for n in OPTIMIZERS}
    assert per["adamw"] == 16 and per["schedulefree_adamw"] == 16 and per["prodigy"] == 24
    assert 10 < per["adamw8bit"] < 10.1 and per["adafactor"] == 8.25
    tc = families.BUILT_IN[families.DEFAULT_BUILT_IN][0]
    est = gpu_memory.estimate(tc, 0, 1000, 512, 1, True, optimizer="prodigy")
    assert est.lora_optimizer == 24000


@_needs("schedulefree_adamw")
def test_schedulefree_eval_loss_scores_its_average_and_training_goes_on_unchanged(tiny_model):
    """The eval loss (and the best file behind it) scores the LoRA as it is used, schedule-free's average, not the
    interpolation it trains at; the training weights come back exactly."""
    from rayflux.train.observe import evaluation

    cfg = train_data.job(tiny_model, *OPTIONS, "train.optim.name=schedulefree_adamw", *SETTINGS["schedulefree_adamw"])
    groups = train_data.groups(train_data.items(4), 2)
    trainer = LoraTrainer(cfg, "cpu", total_steps=2, empty=train_data.empty_caption())
    _run(trainer, groups)
    rows = train_data.items(2, seed=7)
    held = [
        evaluation.EvalBatch(b, [f"held-{i}-{j}" for j in range(2)])
        for i, b in enumerate(train_data.groups(rows, 1)[k][0] for k in range(2))
    ]
    training = _weights(trainer)
    with trainer.optimizer_eval():
        averaged = evaluation.score(trainer, held, 1)["eval_loss"]
    interpolated = evaluation.score(trainer, held, 1)["eval_loss"]
    assert averaged != interpolated  # the two weights differ, so the choice shows in the number

    evaluator = evaluation.Evaluator(trainer, [], rank=0, world=1, every=0, final_segment=True)
    evaluator.batches = held  # the held-out batches, as a worker reads them from the cache
    progress, kept = checkpoint.Progress(step=2), []
    record = {"step": 2}
    evaluator.run(record, progress, lambda r: kept.append(_weights(trainer)))
    assert record["eval_loss"] == averaged and progress.best_step == 2
    assert any(not torch.equal(kept[0][k], v) for k, v in training.items())  # the best file got the average
    for k, v in _weights(trainer).items():
        assert torch.equal(training[k], v), k
