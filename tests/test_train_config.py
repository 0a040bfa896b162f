"""Validation of the training keys: each bad value is refused with a message naming its key."""

import pytest

from rayflux import config


@pytest.mark.parametrize(
    "item, message",
    [
        (
            "train.optim.lr_scheduler=cosine_annealing",
            "train.optim.lr_scheduler must be one of constant, constant_with_warmup",
        ),
        ("train.optim.warmup_steps=10", "lr_scheduler=constant has no warmup.*use constant_with_warmup"),
        ("train.optim.lr_cycles=0", "train.optim.lr_cycles must be positive"),
        ("train.mixed_precision=fp16", "train.mixed_precision must be one of auto, bf16, fp32"),
        ("train.checkpoint.output_format=comfy", "train.checkpoint.output_format must be one of diffusers, kohya"),
        ("train.gradient_accumulation=0", "train.gradient_accumulation must be positive"),
        ("train.checkpoint.keep=0", "train.checkpoint.keep must be positive"),
        ("train.adapter.alpha=0", "train.adapter.alpha must be positive"),
        ("train.optim.warmup_steps=-1", "train.optim.warmup_steps must be >= 0"),
        ("train.checkpoint.every=-2", "train.checkpoint.every must be >= 0"),
        ("train.feed.batches_per_read=0", "train.feed.batches_per_read must be positive"),
        ("train.feed.prefetch_reads=-1", "train.feed.prefetch_reads must be >= 0"),
        ("train.flow.caption_dropout=1", r"train.flow.caption_dropout must be in \[0, 1\)"),
        ("train.adapter.lora_dropout=-0.1", r"train.adapter.lora_dropout must be in \[0, 1\)"),
        ("train.flow.guidance_max=0.5", "train.flow.guidance_max must be 0"),
        ("train.validation.prompts=a cat", "train.validation.prompts must be a YAML list of strings"),
        ("train.validation.prompts=[1, 2]", "train.validation.prompts must be a YAML list of strings"),
    ],
)
def test_bad_training_values_name_the_key(item, message):
    with pytest.raises(config.ConfigError, match=message):
        config.load(None, [item])


def test_training_values_that_are_fine():
    cfg = config.load(
        None,
        [
            "train.flow.guidance=1.0",
            "train.flow.guidance_max=4.0",
            'train.validation.prompts=["a cat", "a dog"]',
            "train.mixed_precision=fp32",
            "train.gradient_checkpointing=yes",
        ],
    )
    assert cfg.train.validation.prompts == ["a cat", "a dog"]
    assert cfg.train.gradient_checkpointing is True and cfg.train.flow.guidance_max == 4.0
