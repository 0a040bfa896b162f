"""``train.optim.ema_decay`` in-process (no Ray): the EMA resumes bitwise, is exported beside the plain LoRA in both formats
(the diffusers file loads with ``load_lora_weights``), and the eval loss and the best file use it while the training
weights come back exactly; its config names and its memory."""

import pytest
import torch
from safetensors.torch import load_file

import train_data
from rayflux import config, families, gpu_memory
from rayflux.config import ConfigError
from rayflux.train.adapter import kohya, lora, lora_files
from rayflux.train.observe import evaluation
from rayflux.train.resume import checkpoint
from rayflux.train.trainer import LoraTrainer

# A fast decay, so that 4 steps leave the average clearly apart from the weights; dropout draws from the saved RNGs.
EMA = (
    "train.optim.ema_decay=0.5",
    "train.optim.learning_rate=0.01",
    "train.optim.lr_scheduler=cosine",
    "train.gradient_accumulation=2",
    "train.adapter.lora_dropout=0.2",
)


def _weights(trainer) -> dict:
    return {k: v.detach().clone() for k, v in lora.lora_state_dict(trainer.transformer).items()}


def _averaged(trainer) -> dict:
    with trainer.eval_weights():
        return _weights(trainer)


def _run(trainer, groups) -> None:
    for g in groups:
        trainer.train_step(g)


def test_ema_resumes_bitwise_and_is_exported_beside_the_lora(tiny_model, tmp_path):
    """4 steps straight == 2 steps, checkpoint, a fresh trainer restored from it, 2 more: bitwise equal LoRA and EMA.
    The checkpoint's ``ema/`` files (diffusers and kohya) hold the average, and become the ``-ema`` step file."""
    cfg = train_data.job(tiny_model, *EMA, "train.checkpoint.output_format=kohya", "run.name=e")
    groups = train_data.groups(train_data.items(8), 2)

    def fresh():
        return LoraTrainer(cfg, "cpu", total_steps=4, empty=train_data.empty_caption())

    straight = fresh()
    _run(straight, groups)
    assert straight.ema.steps == 4
    trained, averaged = _weights(straight), _averaged(straight)
    assert all(not torch.equal(averaged[k], v) for k, v in trained.items())  # the average is not the weights

    first = fresh()
    _run(first, groups[:2])
    checkpoint.save(str(tmp_path), first, 0, checkpoint.Progress(step=2, batches_done=4, world_size=1), "kohya")
    at_two = _averaged(first)
    del first
    torch.manual_seed(12345)  # whatever the process did in between must not matter

    resumed = fresh()
    checkpoint.restore(str(tmp_path), resumed, 0, world_size=1)
    assert resumed.ema.steps == 2
    _run(resumed, groups[2:])
    for k in trained:
        assert torch.equal(_weights(resumed)[k], trained[k]), k
        assert torch.equal(_averaged(resumed)[k], averaged[k]), k

    # The checkpoint's EMA files: the diffusers one holds the average at step 2 (alpha == rank: no scale to bake)...
    probe = fresh()
    lora.load_into(probe.transformer, tmp_path / checkpoint.EMA_DIR / lora.WEIGHT_NAME)
    assert all(torch.equal(_weights(probe)[k], v) for k, v in at_two.items())
    # ...and the kohya one is what the user gets per checkpoint, beside the plain step file.
    dest = lora_files.keep_step(str(tmp_path), cfg, str(tmp_path / "run"), {"step": 2, "epoch": 0})
    ema_file = tmp_path / "run" / "lora" / "e-step00000002-ema.safetensors"
    plain, ema = load_file(dest), load_file(ema_file)
    assert plain.keys() == ema.keys() and any(not torch.equal(plain[k], ema[k]) for k in plain)
    assert load_file(tmp_path / checkpoint.EMA_DIR / kohya.KOHYA_NAME).keys() == ema.keys()
    # (The kohya file comes from the plain files' kohya.save; diffusers' kohya converter needs real widths to load
    # one, which tests/test_kohya_real_width.py covers.)


def _deltas(transformer, adapter: str) -> dict:
    from peft.tuners.lora import LoraLayer

    return {
        n: m.get_delta_weight(adapter)
        for n, m in transformer.named_modules()
        if isinstance(m, LoraLayer) and adapter in m.lora_A
    }


def test_the_exported_ema_loads_in_diffusers_as_the_average(tiny_model, tmp_path):
    from diffusers import FluxPipeline

    cfg = train_data.job(
        tiny_model, *EMA, "train.adapter.alpha=8", "run.name=e"
    )  # alpha != rank: the scale is baked in
    trainer = LoraTrainer(cfg, "cpu", total_steps=2, empty=train_data.empty_caption())
    _run(trainer, train_data.groups(train_data.items(4), 2))
    checkpoint.save(str(tmp_path), trainer, 0, checkpoint.Progress(step=2, world_size=1), "diffusers")
    plain = lora_files.export_final(str(tmp_path), cfg, str(tmp_path / "out"))
    exported = tmp_path / "out" / "lora" / "e-ema.safetensors"
    assert plain.endswith(lora.WEIGHT_NAME) and exported.is_file()
    with trainer.eval_weights():
        want = lora.delta_weights(trainer.transformer)

    pipe = FluxPipeline.from_pretrained(tiny_model)
    pipe.load_lora_weights(str(exported.parent), weight_name=exported.name, adapter_name="ema")
    got = _deltas(pipe.transformer, "ema")
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-7)


def test_eval_loss_and_best_file_use_the_ema_and_training_goes_on_unchanged(tiny_model):
    cfg = train_data.job(tiny_model, *EMA, "train.eval.sigmas=2")
    trainer = LoraTrainer(cfg, "cpu", total_steps=2, empty=train_data.empty_caption())
    _run(trainer, train_data.groups(train_data.items(4), 2))
    rows = train_data.items(2, seed=7)
    held = [
        evaluation.EvalBatch(b, [f"held-{i}-{j}" for j in range(2)])
        for i, b in enumerate(train_data.groups(rows, 1)[k][0] for k in range(2))
    ]
    training, averaged = _weights(trainer), _averaged(trainer)
    plain = evaluation.score(trainer, held, 1)["eval_loss"]

    evaluator = evaluation.Evaluator(trainer, [], rank=0, world=1, every=0, final_segment=True)
    evaluator.batches = held  # the held-out batches, as a worker reads them from the cache
    progress, kept, record = checkpoint.Progress(step=2), [], {"step": 2}
    evaluator.run(record, progress, lambda r: kept.append(_weights(trainer)))
    with trainer.eval_weights():
        assert record["eval_loss"] == evaluation.score(trainer, held, 1)["eval_loss"] != plain
    assert all(torch.equal(kept[0][k], v) for k, v in averaged.items())  # the best file got the average
    for k, v in _weights(trainer).items():
        assert torch.equal(training[k], v), k  # the training weights, exactly


def test_ema_config_names_refusals_and_memory():
    assert config.load(None, ["train.use_ema=true"]).train.optim.ema_decay == 0.995  # SimpleTuner's default
    assert config.load(None, ["train.use_ema=true", "train.optim.ema_decay=0.999"]).train.optim.ema_decay == 0.999
    assert config.load(None, ["train.optim.ema_decay=0.9", "train.use_ema=false"]).train.optim.ema_decay == 0
    with pytest.raises(ConfigError, match=r"ema_decay must be in \[0, 1\)"):
        config.load(None, ["train.optim.ema_decay=1"])
    with pytest.raises(ConfigError, match="already evaluates and exports an average"):
        config.load(
            None,
            [
                "train.optim.ema_decay=0.9",
                "train.optim.name=schedulefree_adamw",
                "train.optim.lr_scheduler=constant_with_warmup",
            ],
        )
    text = config.help_text()
    assert "train.optim.ema_decay = 0.0" in text and "train.use_ema: true -> train.optim.ema_decay=0.995" in text
    assert gpu_memory.lora_bytes_per_param("adamw", ema=True) == gpu_memory.lora_bytes_per_param("adamw") + 4
    tc = families.BUILT_IN[families.DEFAULT_BUILT_IN][0]
    assert gpu_memory.estimate(tc, 0, 1000, 512, 1, True, ema=True).lora_optimizer == 20000
