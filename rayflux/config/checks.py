"""Whole-job validation: each key's range and choice, and the checks that span sections."""

from __future__ import annotations

from rayflux.config.base_dtype import refusal
from rayflux.config.optimizer import OPTIMIZERS, canonical, refusal as optimizer_refusal
from rayflux.config.cache import check_pools, refresh_interval
from rayflux.config.data import datasets_of
from rayflux.config import targets
from rayflux.config.caption import check_caption
from rayflux.config.job import JobConfig
from rayflux.config.token_routing import parse as parse_routing
from rayflux.config.train import checkpointing_setting, worker_range
from rayflux.config.values import ConfigError, resource_map


_CHOICES = {
    ("model", "dtype"): ("auto", "bfloat16", "float16", "float32"),
    ("model", "vae_dtype"): ("", "auto", "bfloat16", "float16", "float32"),
    ("cache", "dtype"): ("auto", "float32", "float16", "bfloat16"),
    ("train", "workers.on_gpu"): ("auto", "true", "false"),
    ("cache", "encoders_on_gpu"): ("auto", "true", "false"),
    ("train", "flow.sigma_sampling"): (
        "logit_normal",
        "uniform",
        "sigmoid",
        "shift",
        "flux_shift",
        "flux2_shift",
        "auto",
    ),
    ("train", "flow.timestep_bias"): ("balanced", "content", "style"),
    ("train", "flow.loss_weighting"): ("none", "sigma_sqrt", "cosmap"),
    ("train", "optim.lr_scheduler"): (
        "constant",
        "constant_with_warmup",
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
    ),
    ("train", "mixed_precision"): ("auto", "bf16", "fp32"),
    ("train", "checkpoint.output_format"): ("diffusers", "kohya"),
    ("train", "adapter.kind"): ("lora", "dora", "lokr"),
    ("train", "workers.base_fsdp"): ("none", "node", "auto"),
    ("train", "base_dtype"): ("bf16", "fp8", "nf4"),
    ("train", "optim.name"): tuple(OPTIMIZERS),
}
_POSITIVE = {
    ("data", "max_image_pixels"),
    ("cache", "batch_size"),
    ("cache", "text_batch_size"),
    ("cache", "rows_per_shard"),
    ("train", "epochs"),
    ("train", "batch_size"),
    ("train", "adapter.rank"),
    ("train", "adapter.alpha"),
    ("train", "optim.learning_rate"),
    ("train", "optim.lr_cycles"),
    ("train", "optim.lr_power"),
    ("train", "gradient_accumulation"),
    ("train", "feed.batches_per_read"),
    ("train", "feed.shuffle_block"),
    ("train", "log_every"),
    ("train", "checkpoint.keep"),
    ("run", "lease_seconds"),
}


PRESERVATION_MODES = ("none", "class", "blank")
"""``train.flow.preservation``'s choices (issue 45, :mod:`rayflux.preservation`)."""


def _check_preservation(cfg: JobConfig) -> None:
    """``train.flow.preservation`` and its keys agree: a choice of :data:`PRESERVATION_MODES`, a weight >= 0, and with
    ``class`` a ``trigger_word`` for every dataset."""
    t = cfg.train
    if t.flow.preservation not in PRESERVATION_MODES:
        raise ConfigError(
            f"train.flow.preservation must be one of {', '.join(PRESERVATION_MODES)}; got {t.flow.preservation!r}"
        )
    if t.flow.preservation_weight < 0:
        raise ConfigError(f"train.flow.preservation_weight must be >= 0, got {t.flow.preservation_weight}")
    if t.flow.preservation != "class":
        return
    for i, ds in enumerate(datasets_of(cfg.data)):
        if not ds.trigger_word.strip():
            where = f"data.datasets[{i}].trigger_word" if cfg.data.datasets else "data.trigger_word"
            raise ConfigError(
                f"train.flow.preservation=class replaces each caption's trigger word by its class word, but {where} is "
                "empty; set it (and class_word), or use train.flow.preservation=blank"
            )


def _check_optimizer(cfg: JobConfig) -> None:
    """An optimizer CPU training cannot run, and schedule-free with a decaying schedule (it replaces the schedule)."""
    refused = optimizer_refusal(cfg.train.optim.name, gpu=cfg.train.workers.on_gpu != "false")
    if refused:
        raise ConfigError(refused)
    if cfg.train.optim.name == "schedulefree_adamw" and cfg.train.optim.lr_scheduler not in (
        "constant",
        "constant_with_warmup",
    ):
        raise ConfigError(
            f"train.optim.name=schedulefree_adamw replaces the LR schedule (train.optim.lr_scheduler="
            f"{cfg.train.optim.lr_scheduler}); use constant_with_warmup, with train.optim.warmup_steps as its own "
            "warmup"
        )


ADAPTER_SPELLINGS = {"networks.lora": "lora", "networks.lora_flux": "lora"}
"""kohya's ``network_module`` values (its alias of ``train.adapter.kind``) that name one adapter on their own."""


def _adapter(value: str) -> str:
    """``train.adapter.kind`` in rayflux's spelling; LyCORIS's module needs its ``network_args`` to say which."""
    if value == "lycoris.kohya":
        raise ConfigError(
            "train.adapter.kind (network_module) lycoris.kohya: say which LyCORIS algorithm: "
            "train.adapter.kind=dora (algo=lora with dora_wd=True) or train.adapter.kind=lokr (algo=lokr)"
        )
    return ADAPTER_SPELLINGS.get(value, value)


def validate(cfg: JobConfig) -> None:
    """Check value ranges and choices; raise ConfigError naming the first bad key."""
    cfg.train.optim.name = canonical(cfg.train.optim.name)
    cfg.train.adapter.kind = _adapter(cfg.train.adapter.kind)
    _check_ranges(cfg)
    _check_validation(cfg)
    _check_run(cfg)
    _check_resources(cfg)
    check_caption(cfg.caption)
    if cfg.model.dtype == "float16":
        raise ConfigError(
            "model.dtype=float16: FLUX's transformer and T5 overflow in fp16; use bfloat16 "
            "(model.vae_dtype=float16 runs the VAE alone in fp16)"
        )
    if cfg.train.validation.inference_steps < 0 or cfg.train.validation.guidance < 0:
        raise ConfigError(
            "train.validation.inference_steps and train.validation.guidance must be >= 0 (0: the model's own)"
        )
    if cfg.model.text_tokens < 0:
        raise ConfigError(f"model.text_tokens must be >= 0 (0: the model's default), got {cfg.model.text_tokens}")
    check_pools(cfg.cache)
    # What is known before any work: CPU training by setting, or a sharding it cannot combine with.
    refused = refusal(
        cfg.train.base_dtype, gpu=cfg.train.workers.on_gpu != "false", sharding=cfg.train.workers.base_fsdp
    )
    if refused:
        raise ConfigError(refused)
    _check_optimizer(cfg)
    adapter_refusal(cfg)
    lora_plus_refusal(cfg.train)
    targets.parse(cfg.train.adapter.targets)  # its grammar now; the modules it names once the model is known
    _check_patterns(cfg.train.adapter)
    _check_ema_compile(cfg)
    _check_token_routing(cfg)
    cfg.train.gradient_checkpointing = checkpointing_setting(cfg.train.gradient_checkpointing)
    if cfg.data.reg_loss_weight < 0:
        raise ConfigError(f"data.reg_loss_weight must be >= 0, got {cfg.data.reg_loss_weight}")
    datasets_of(cfg.data)  # every dataset, listed or single, checked like a section of its own
    _check_preservation(cfg)


def _check_ranges(cfg: JobConfig) -> None:
    """Choices, positive values and ranges of single keys."""
    for (section, key), choices in _CHOICES.items():
        value = _value(cfg, section, key)
        if value not in choices:
            raise ConfigError(f"{section}.{key} must be one of {', '.join(choices)}; got {value!r}")
    for section, key in _POSITIVE:
        value = _value(cfg, section, key)
        if value <= 0:
            raise ConfigError(f"{section}.{key} must be positive, got {value}")
    if cfg.data.alignment < 0:
        raise ConfigError(f"data.alignment must be 0 (the model's) or positive, got {cfg.data.alignment}")
    for key in (
        "max_steps",
        "optim.warmup_steps",
        "checkpoint.every",
        "validation.every",
        "optim.max_grad_norm",
        "feed.prefetch_reads",
        "report_seconds",
        "eval.every",
    ):
        if _value(cfg, "train", key) < 0:
            raise ConfigError(f"train.{key} must be >= 0")
    if cfg.data.eval_samples < 0:
        raise ConfigError(f"data.eval_samples must be >= 0 (0: no eval loss), got {cfg.data.eval_samples}")
    if cfg.train.eval.sigmas < 1:
        raise ConfigError(f"train.eval.sigmas must be positive, got {cfg.train.eval.sigmas}")
    for key in ("adapter.lora_dropout", "flow.caption_dropout"):
        if not 0 <= _value(cfg, "train", key) < 1:
            raise ConfigError(f"train.{key} must be in [0, 1), got {_value(cfg, 'train', key)}")
    if cfg.train.flow.guidance_max and cfg.train.flow.guidance_max < cfg.train.flow.guidance:
        raise ConfigError("train.flow.guidance_max must be 0 (constant guidance) or >= train.flow.guidance")


def _value(cfg: JobConfig, section: str, path: str):
    """The value of key ``path`` (dotted within its section: ``optim.learning_rate``) of ``section``."""
    obj = getattr(cfg, section)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _check_validation(cfg: JobConfig) -> None:
    """Validation prompts and their reference images."""
    true_cfg = cfg.train.validation.true_cfg
    if true_cfg != 0 and not true_cfg > 1:  # diffusers guides only above 1: a smaller scale would do nothing
        raise ConfigError(f"train.validation.true_cfg must be 0 (off) or above 1, got {true_cfg}")
    prompts = cfg.train.validation.prompts
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ConfigError(f"train.validation.prompts must be a YAML list of strings, e.g. ['a cat']; got {prompts!r}")
    refs = cfg.train.validation.references
    if refs and (
        not isinstance(refs, list)
        or len(refs) != len(prompts)
        or not all(
            isinstance(r, str) or (isinstance(r, list) and r and all(isinstance(x, str) for x in r)) for r in refs
        )
    ):
        raise ConfigError(
            "train.validation.references must list one reference image (or a list of them) per "
            f"validation prompt; got {refs!r} for {len(prompts)} prompt(s)"
        )


def _check_run(cfg: JobConfig) -> None:
    """The schedule, the output's name, the workers and the refresh interval."""
    if cfg.train.optim.lr_scheduler == "constant" and cfg.train.optim.warmup_steps:
        raise ConfigError(
            "train.optim.lr_scheduler=constant has no warmup (as in diffusers); for train.optim.warmup_steps="
            f"{cfg.train.optim.warmup_steps} use constant_with_warmup"
        )
    stem = cfg.train.checkpoint.output_name or cfg.run.name
    if not stem or any(c in stem for c in '/\\:*?"<>|') or stem.startswith("."):
        raise ConfigError(f"train.checkpoint.output_name (else run.name) must be a plain file-name stem; got {stem!r}")
    if cfg.train.workers.cpus_per_worker <= 0:
        raise ConfigError("train.workers.cpus_per_worker must be positive")
    refresh_interval(cfg.cache.refresh)
    worker_range(cfg.train.workers.num_workers)
    if cfg.train.workers.max_failures < -1:
        raise ConfigError("train.workers.max_failures must be -1 (no limit) or >= 0")
    if cfg.train.workers.resize_check_seconds < 0:
        raise ConfigError("train.workers.resize_check_seconds must be >= 0")


def _check_resources(cfg: JobConfig) -> None:
    """Ray resources asked for by the train workers, the cache's actors and the render actor."""
    resource_map("train.workers.worker_resources", cfg.train.workers.worker_resources)
    resource_map("cache.actor_resources", cfg.cache.actor_resources)
    custom = (
        {k: v for k, v in cfg.train.validation.resources.items() if k not in ("CPU", "GPU")}
        if isinstance(cfg.train.validation.resources, dict)
        else cfg.train.validation.resources
    )
    resource_map("train.validation.resources", custom)
    if cfg.train.validation.queue < 1 or cfg.train.validation.wait_seconds < 0:
        raise ConfigError("train.validation.queue must be >= 1 and train.validation.wait_seconds >= 0")


def _check_ema_compile(cfg: JobConfig) -> None:
    """``train.optim.ema_decay``'s range and the combinations of it and ``train.compile`` that are refused."""
    t = cfg.train
    if not 0 <= t.optim.ema_decay < 1:
        raise ConfigError(f"train.optim.ema_decay must be in [0, 1) (0: no EMA), got {t.optim.ema_decay}")
    if t.optim.ema_decay and t.optim.name == "schedulefree_adamw":
        raise ConfigError(
            "train.optim.ema_decay: schedulefree_adamw already evaluates and exports an average of its "
            "iterates; an EMA on top of it is not supported (set train.optim.ema_decay=0)"
        )
    if t.compile and t.workers.base_fsdp != "none":
        # FSDP2's per-block gathers would have to be traced into the compiled blocks; untested, so refused.
        raise ConfigError(
            f"train.compile needs the whole base on every worker (train.workers.base_fsdp: none), got "
            f"train.workers.base_fsdp={t.workers.base_fsdp}"
        )


def _check_patterns(t) -> None:
    """``train.adapter.rank_pattern``/``alpha_pattern`` (``t``: the adapter section): target-spec keys, positive
    values, and an adapter that takes them."""
    for what in ("rank_pattern", "alpha_pattern"):
        pattern = getattr(t, what)
        if not isinstance(pattern, dict):
            raise ConfigError(f"train.adapter.{what} must be a mapping of target spec -> value, got {pattern!r}")
        if not pattern:
            continue
        if t.kind == "lokr" or t.init_lora:
            raise ConfigError(
                f"train.adapter.{what} applies to a fresh LoRA or DoRA: not with train.adapter.kind=lokr (its export scales every "
                "module alike) nor train.adapter.init_lora (the file's ranks decide)"
            )
        for key, value in pattern.items():
            targets.parse(str(key))
            kind = int if what == "rank_pattern" else float
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or kind(value) != value:
                raise ConfigError(f"train.adapter.{what}[{key!r}] must be a positive {kind.__name__}, got {value!r}")


def lora_plus_refusal(t) -> None:
    """``train.optim.lora_plus_ratio`` (:mod:`rayflux.train.adapter.lora_plus`) where it cannot apply, refused with the reason."""
    ratio = t.optim.lora_plus_ratio
    if ratio == 0:
        return
    if ratio < 0:
        raise ConfigError(f"train.optim.lora_plus_ratio must be 0 (off) or positive, got {ratio}")
    if t.adapter.kind == "lokr":
        raise ConfigError(
            "train.optim.lora_plus_ratio needs LoRA's A and B matrices; LoKr trains two Kronecker factors (w1, w2) "
            "instead: set train.optim.lora_plus_ratio=0 or train.adapter.kind=lora/dora"
        )
    if t.optim.name == "prodigy":
        raise ConfigError(
            "train.optim.lora_plus_ratio with train.optim.name=prodigy: Prodigy estimates one step size for all parameters "
            "and refuses parameter groups with different learning rates; use adamw, adafactor or schedulefree_adamw"
        )


def _check_token_routing(cfg: JobConfig) -> None:
    """``train.token_routing``'s form, and the combinations refused with it."""
    t = cfg.train
    if parse_routing(t.token_routing) is None:
        return
    # Hooks on the blocks would be traced into compiled blocks or FSDP2's gathers: untested, so refused.
    if t.compile:
        raise ConfigError("train.token_routing does not run with train.compile (set one of them off)")
    if t.workers.base_fsdp == "node":
        raise ConfigError("train.token_routing needs the whole base on every worker (train.workers.base_fsdp: none)")


def adapter_refusal(cfg: JobConfig) -> None:
    """``train.adapter.kind`` combinations that could not be used or loaded, refused before any work with the reason."""
    t = cfg.train
    if t.adapter.kind == "lora":
        return
    if t.adapter.kind == "lokr":
        if t.checkpoint.output_format != "kohya":
            raise ConfigError(
                "train.adapter.kind=lokr has no diffusers format (diffusers' FLUX.1 pipelines load no LoKr); "
                "set train.checkpoint.output_format=kohya (LyCORIS lokr_w1/lokr_w2 keys, which ComfyUI loads)"
            )
        if t.adapter.lora_dropout:
            raise ConfigError("train.adapter.kind=lokr has no input dropout; set train.adapter.lora_dropout=0")
        if t.adapter.init_lora:
            raise ConfigError("train.adapter.init_lora starts a LoRA or DoRA from a LoRA file; a LoKr cannot hold one")
    if t.workers.base_fsdp == "node":
        raise ConfigError(
            f"train.adapter.kind={t.adapter.kind} needs the whole base on every worker (train.workers.base_fsdp: "
            "none); a sharded base is supported with lora only"
        )
