"""Validation of the training keys: each bad value is refused with a message naming its key."""

import pytest

from rayflux import config


@pytest.mark.parametrize(
    "item, message",
    [
        ("train.lr_scheduler=cosine_annealing", "train.lr_scheduler must be one of constant, constant_with_warmup"),
        ("train.warmup_steps=10", "lr_scheduler=constant has no warmup.*use constant_with_warmup"),
        ("train.lr_cycles=0", "train.lr_cycles must be positive"),
        ("train.mixed_precision=fp16", "train.mixed_precision must be one of auto, bf16, fp32"),
        ("train.output_format=comfy", "train.output_format must be one of diffusers, kohya"),
        ("train.gradient_accumulation=0", "train.gradient_accumulation must be positive"),
        ("train.checkpoints_to_keep=0", "train.checkpoints_to_keep must be positive"),
        ("train.alpha=0", "train.alpha must be positive"),
        ("train.warmup_steps=-1", "train.warmup_steps must be >= 0"),
        ("train.checkpoint_every=-2", "train.checkpoint_every must be >= 0"),
        ("train.batches_per_read=0", "train.batches_per_read must be positive"),
        ("train.prefetch_reads=-1", "train.prefetch_reads must be >= 0"),
        ("train.caption_dropout=1", r"train.caption_dropout must be in \[0, 1\)"),
        ("train.lora_dropout=-0.1", r"train.lora_dropout must be in \[0, 1\)"),
        ("train.guidance_max=0.5", "train.guidance_max must be 0"),
        ("train.validation_prompts=a cat", "train.validation_prompts must be a YAML list of strings"),
        ("train.validation_prompts=[1, 2]", "train.validation_prompts must be a YAML list of strings"),
    ],
)
def test_bad_training_values_name_the_key(item, message):
    with pytest.raises(config.ConfigError, match=message):
        config.load(None, [item])


def test_training_values_that_are_fine():
    cfg = config.load(
        None,
        [
            "train.guidance=1.0",
            "train.guidance_max=4.0",
            'train.validation_prompts=["a cat", "a dog"]',
            "train.mixed_precision=fp32",
            "train.gradient_checkpointing=yes",
        ],
    )
    assert cfg.train.validation_prompts == ["a cat", "a dog"]
    assert cfg.train.gradient_checkpointing is True and cfg.train.guidance_max == 4.0
