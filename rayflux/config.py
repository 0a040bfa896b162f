"""Typed job configuration: dataclasses, YAML files, dotted ``--set`` overrides and generated help.

Each field's docstring (the string literal under it) is the documentation users see in ``--help``; it is read from
the source with ``ast`` so that the code and the help can never disagree.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import json
import textwrap
import typing
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml


@dataclass
class DatasetConfig:
    """One folder of training images: how it is captioned, cropped, and mixed into each epoch."""

    name: str = ""
    """Short name (letters, digits, ``.``, ``_``, ``-``) shown in summaries. In ``data.datasets`` it also prefixes the
    dataset's sample paths in the cache, so it must be unique there. Empty: the last folder name of ``images_dir``."""
    images_dir: str = ""
    """Folder or URI (``s3://bucket/prefix``, or any pyarrow/fsspec filesystem) of training images. Empty: the
    generated demo images."""
    caption_strategy: str = "sidecar"
    """Where captions come from: ``sidecar`` files, the ``filename``, a ``metadata`` table (``metadata.jsonl``,
    ``.csv`` or ``.parquet`` with ``file_name`` and ``text`` columns, as Hugging Face imagefolder) or the fixed
    ``instance`` prompt."""
    caption_ext: str = ".txt"
    """Sidecar caption extension. Several lines in one file are several captions; one is chosen per generation."""
    metadata_file: str = ""
    """For ``caption_strategy=metadata``: the table's path relative to ``images_dir`` (or a URI). Empty: every
    ``metadata.jsonl``, ``metadata.csv`` or ``metadata.parquet`` in the tree, each naming files relative to its own
    folder."""
    caption_column: str = "text"
    """Metadata column holding the caption: a string, or a list of strings (one chosen per generation)."""
    missing_caption: str = "filename"
    """When an image has no caption: ``skip`` it, use an ``empty`` caption, its ``filename``, or ``instance``."""
    instance_prompt: str = ""
    """Fixed caption for ``caption_strategy=instance`` and ``missing_caption=instance``; the prefix for
    ``prepend_instance_prompt``."""
    prepend_instance_prompt: bool = False
    """Put ``instance_prompt`` and a space in front of every caption (e.g. a trigger word)."""
    resolution: int = 512
    """Target size in pixels: the shorter edge, or the square root of the area (see ``resolution_type``)."""
    resolution_type: str = "area"
    """``area`` keeps about resolution² pixels per image (SimpleTuner's ``pixel_area``, not its megapixel ``area``);
    ``shorter_edge`` fixes the shorter side."""
    bucket_step: int = 64
    """Bucket sides are multiples of this many pixels (kohya's ``bucket_reso_steps``): fewer, fuller buckets than the
    model's 16. Rounded down to the model's alignment and capped at ``resolution / 8``."""
    alignment: int = 0
    """Exact bucket granularity in pixels, overriding ``bucket_step``; a multiple of the model's own alignment, 2 x its
    VAE downscale (16 for FLUX). 0: use ``bucket_step``."""
    crop: str = "center"
    """How an image is cut to its bucket's aspect ratio: ``center`` or ``random`` (seeded per generation)."""
    max_aspect: float = 2.5
    """Aspect ratios beyond this (either way) are cropped down to it."""
    min_image_size: int = 64
    """Images whose shorter edge is below this many pixels are skipped with a reason."""
    repeats: int = 1
    """Times each cached sample of this dataset appears in every epoch."""
    max_samples: int = 0
    """Use at most this many images of the dataset (a stable choice by path hash). 0: all of them."""
    regularisation: bool = False
    """A regularisation (prior-preservation) set: its samples' loss is weighted by ``data.reg_loss_weight``."""
    reference_dir: str = ""
    """Edit pairs: a folder or URI of reference images with the same relative paths as ``images_dir`` (any image
    extension). Each training image is the edit's result, its caption the instruction; an image without its reference
    is skipped with the reason. Empty: no references (unless ``reference_column`` names them)."""
    reference_column: str = ""
    """Edit pairs from a metadata table (``caption_strategy=metadata``): the column naming each image's reference
    file, or a list of them (FLUX.2 takes several), relative to ``reference_dir`` when it is set, else to the table's
    folder. Files named there are references only, never training images themselves."""


# Keys a dataset mapping may set; they decide what is cached, except these, which only shape the epoch.
TRAINING_ONLY_KEYS = ("repeats", "regularisation")


@dataclass
class DataConfig(DatasetConfig):
    """Where the training images and their captions come from.

    The ``data.*`` keys inherited from a dataset describe the single dataset ``data.images_dir``; with
    ``data.datasets`` they are the defaults every listed dataset starts from.
    """

    datasets: list = field(default_factory=list)
    """Several datasets in one job: a list of mappings with the dataset keys above (``images_dir``, ``name``,
    ``caption_strategy``, ``resolution``, ``repeats``, ``max_samples``, ``regularisation``...). A key a mapping leaves
    out takes its ``data.*`` value. Empty: the one dataset ``data.images_dir``."""
    reg_loss_weight: float = 1.0
    """Loss weight of samples from regularisation datasets (1.0: weighted like any other sample)."""
    max_image_pixels: int = 178_956_970
    """Images with more pixels than this are refused as decompression bombs (Pillow's own default limit)."""


@dataclass
class ModelConfig:
    """Which FLUX model to fine-tune."""

    path: str = ""
    """A diffusers-format directory or hub id (e.g. black-forest-labs/FLUX.1-dev). Empty: the embedded tiny model."""
    revision: str = ""
    """Hub revision, when ``path`` is a hub id."""
    dtype: str = "auto"
    """Weight dtype for the frozen parts: ``auto`` (bf16 on GPU, fp32 on CPU), ``bfloat16`` or ``float32``. Not
    ``float16``: FLUX's transformer and T5 overflow in it."""
    vae_dtype: str = ""
    """The VAE's dtype in the cache stage, when it should differ from ``dtype`` (``float16`` is allowed here)."""


@dataclass
class CacheConfig:
    """The cache stage: VAE latents and text embeddings written as Parquet shards."""

    dir: str = ""
    """Where cache generations are written. Empty: ``<run.output_dir>/cache``."""
    batch_size: int = 8
    """Images per VAE call in an encoder actor."""
    text_batch_size: int = 16
    """Unique captions per text-encoder call."""
    vae_actors: Any = "auto"
    """VAE encoder actors: a number, all started at once, or ``auto``: one per ``cache.gpus_per_actor`` share of the
    cluster's GPUs (scaling up to the autoscaler's maximum), or on a CPU-only cluster the CPUs that preparation and
    writing leave, in actors of up to 8 CPUs. A request that cannot fit fails before the stage starts."""
    text_actors: Any = "auto"
    """Text encoder actors: a number or ``auto`` (as ``vae_actors`` on GPUs; one actor on CPU, as T5-XXL takes about
    19 GB per copy there). Text work scales with unique captions, not images."""
    actor_cpus: Any = "auto"
    """CPUs reserved by each encoder actor: a number, or ``auto``: 1 with GPUs (or a named node type), else the
    pool's share of the CPUs preparation and writing leave. Torch in the actor runs that many threads (rounded up)."""
    gpus_per_actor: float = 1.0
    """GPU share of each GPU encoder actor, e.g. 0.25 to run four VAE actors on one card; above 1, a whole number."""
    stall_seconds: float = 600.0
    """Fail a cache pipeline that makes no progress (no task output, no finished task) for this long, naming what
    Ray Data reports as pending. Loading or downloading an encoder counts as no progress: raise it for slow hubs."""
    rows_per_shard: int = 256
    """Rows per Parquet shard file (a shard never mixes more than one writer's batch)."""
    dtype: str = "auto"
    """Stored tensor dtype: ``auto`` (``bfloat16`` when the encoders run on GPUs, else ``float32``), ``float32``,
    ``float16`` or ``bfloat16``."""
    refresh: str = "never"
    """Build a new cache generation ``never``, ``every_epoch``, or every N epochs (an integer)."""
    strict: bool = False
    """Fail the job on the first bad input instead of skipping it with a recorded reason."""
    seed: int = 0
    """Seed for random crops and caption choice; each generation derives its own from it."""
    use_gpu: str = "auto"
    """Encoder actors on GPUs: ``auto`` (when the cluster has GPUs or ``cache.accelerator_type`` is set), ``true`` or
    ``false``. Set ``true`` on an autoscaling cluster whose GPU nodes are not up yet when the job starts."""
    accelerator_type: str = ""
    """GPU type each encoder actor needs (e.g. ``L4``, ``A10G``), so encoding runs on cheaper GPU nodes than training.
    Empty: any GPU. Implies GPU encoders."""
    actor_resources: dict = field(default_factory=dict)
    """Extra Ray resources each encoder actor reserves, e.g. ``{encode_node: 1}`` for a node type that declares that
    custom resource in ``cluster.yaml``."""


@dataclass
class TrainConfig:
    """The LoRA training stage."""

    epochs: int = 2
    """Passes over the cached samples."""
    max_steps: int = 0
    """Stop after this many optimizer steps per worker (0: run all epochs). Also the LR schedule's horizon."""
    num_workers: Any = 2
    """Ray Train workers: an integer, or ``[min, max]`` for an elastic run."""
    cpus_per_worker: float = 0.5
    """CPUs reserved per worker. Fractional values let two workers share a small machine."""
    use_gpu: str = "auto"
    """``auto`` (use GPUs when the cluster has them or ``train.accelerator_type`` is set), ``true`` or ``false``."""
    accelerator_type: str = ""
    """GPU type every train worker needs (e.g. ``H100``), so workers go only to such nodes. Empty: any. Implies GPU
    training."""
    worker_resources: dict = field(default_factory=dict)
    """Extra Ray resources each train worker reserves, e.g. ``{train_node: 1}`` to keep training on a node type that
    declares that custom resource."""
    max_failures: int = 3
    """Restarts after a worker or node failure before the job gives up (-1: no limit). Each resumes from the latest
    checkpoint. Announced preemptions (node drains) are not counted here: Ray Train retries those without limit."""
    resize_check_seconds: float = 60.0
    """How often an elastic run (``num_workers: [min, max]``) looks for room for more workers. Growing restarts the
    worker group from the latest checkpoint."""
    batch_size: int = 1
    """Samples per batch on each worker. A batch always holds one bucket."""
    gradient_accumulation: int = 1
    """Batches per optimizer step on each worker."""
    batches_per_read: int = 8
    """Planned batches that one Ray Data read task loads and stacks for a worker. Larger reads cost the worker less
    scheduling per step (its share of the feed runs beside the step); the first step waits for one whole read."""
    prefetch_reads: int = 2
    """Reads each worker's feed keeps ahead of the step it is training (0: none), so the Parquet reads of the next
    batches overlap the current step. Host memory held: about ``prefetch_reads × batches_per_read`` batches."""
    learning_rate: float = 1e-4
    """AdamW learning rate (the peak, after warmup)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    lr_scheduler: str = "constant"
    """Learning-rate schedule, by diffusers' names and meanings (``diffusers.optimization.get_scheduler``):
    ``constant`` (no warmup), ``constant_with_warmup``, ``linear``, ``cosine`` (to 0 at the last step),
    ``cosine_with_restarts`` or ``polynomial``."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 up to ``learning_rate`` (every schedule but ``constant``)."""
    lr_cycles: int = 1
    """Hard restarts of ``cosine_with_restarts`` (kohya's ``lr_scheduler_num_cycles``)."""
    lr_power: float = 1.0
    """Power of the ``polynomial`` decay (kohya's ``lr_scheduler_power``); 1 is linear."""
    max_grad_norm: float = 1.0
    """Clip the LoRA gradient norm to this (0 disables clipping; the norm is still reported)."""
    mixed_precision: str = "auto"
    """``auto`` (bf16 autocast on GPU, fp32 on CPU), ``bf16`` (autocast everywhere) or ``fp32`` (no autocast)."""
    gradient_checkpointing: Any = "auto"
    """Recompute block activations in the backward pass: ``auto`` (on for GPU runs at 768 px or more, or when the
    memory estimate printed at start exceeds 90% of the GPU), ``true`` or ``false``."""
    rank: int = 4
    """LoRA rank."""
    alpha: float = 4.0
    """LoRA alpha; the update is scaled by alpha / rank."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA branch's input during training."""
    targets: str = "attention"
    """LoRA target preset (``attention``, ``attention+ffs``, ``all``) or a comma-separated module list."""
    init_lora: str = ""
    """Start from this LoRA file (diffusers or kohya keys, local or URI) instead of a fresh adapter."""
    guidance: float = 1.0
    """Guidance value fed to guidance-distilled models (ignored when the model has no guidance embedding)."""
    guidance_max: float = 0.0
    """When above ``guidance``, each sample's guidance is drawn uniformly from [guidance, guidance_max]."""
    sigma_sampling: str = "logit_normal"
    """How σ is drawn: ``logit_normal``, ``uniform``, ``sigmoid``, ``shift`` or ``flux_shift``."""
    logit_mean: float = 0.0
    """Mean of the normal behind ``logit_normal``."""
    logit_std: float = 1.0
    """Standard deviation of the normal behind ``logit_normal``; the scale for ``sigmoid``."""
    shift: float = 3.0
    """The fixed shift for ``sigma_sampling=shift``."""
    loss_weighting: str = "none"
    """Per-sample loss weight: ``none``, ``sigma_sqrt`` (σ⁻²) or ``cosmap``."""
    caption_dropout: float = 0.0
    """Probability of training a sample on the cached empty-caption embedding instead of its caption."""
    seed: int = 0
    """Seed for noise, σ and the batch order. Every rank derives its own stream from it."""
    log_every: int = 1
    """Report metrics to Ray Train no more often than every this many steps (and ``report_seconds``; the later of
    the two wins). Per-step metrics go to TensorBoard and ``metrics/steps.jsonl`` at every step regardless."""
    report_seconds: float = 30.0
    """Wall-clock seconds between metrics reports to Ray Train (checkpoints report whenever they are due). Each
    report is a barrier of all ranks that costs tens of milliseconds, and Ray Train collects reports only every 2 s,
    so reporting every step would stall a fast step for up to 2 s; 30 s keeps the cost under 1% of the time at any
    step time. 0: report every step."""
    checkpoint_every: int = 0
    """Checkpoint every this many optimizer steps (0: only at the end; the last step always checkpoints)."""
    checkpoints_to_keep: int = 2
    """How many of the newest checkpoints to keep in storage."""
    output_format: str = "diffusers"
    """Exported LoRA keys: ``diffusers`` (``transformer.*``, in ``lora/pytorch_lora_weights.safetensors``) or
    ``kohya`` (``lora_unet_*`` with sd-scripts' ``ss_*`` metadata, for ComfyUI, in ``lora/<output_name>.safetensors``).
    Every checkpoint also leaves ``lora/<output_name>-step00000500.safetensors`` in this format."""
    output_name: str = ""
    """Stem of the exported LoRA file names (kohya's ``output_name``). Empty: ``run.name``."""
    validation_prompts: list[str] = field(default_factory=list)
    """Prompts rank 0 renders with the current LoRA (a YAML list). Empty: no validation images."""
    validation_references: list = field(default_factory=list)
    """Edit models (FLUX.1 Kontext, FLUX.2): each validation prompt's reference image (a path or URI; for FLUX.2 also
    a list of them), in the prompts' order; the renders are then edits of them. Empty: plain renders."""
    validation_every: int = 0
    """Render validation images every this many steps (0: only at the end)."""
    validation_inference_steps: int = 20
    """Denoising steps per validation image."""
    validation_guidance: float = 3.5
    """Guidance scale for validation images."""


@dataclass
class RunConfig:
    """Where the run writes its outputs."""

    output_dir: str = "runs/demo"
    """Run directory: LoRA, checkpoints, ledger and logs. A rerun with the same directory continues the run."""
    name: str = "rayflux"
    """Ray Train run name under ``<output_dir>/checkpoints``."""
    ray_address: str = ""
    """Ray cluster to join. Empty: ``RAY_ADDRESS``, else a running local head, else a new local Ray."""
    debug_slow_rank: str = ""
    """``RANK:SECONDS`` delays every step of one training rank, to shake out ordering races. Empty: off."""


@dataclass
class JobConfig:
    """The whole job."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint(self, *sections: str) -> str:
        """A short stable hash of the named sections (all when none are named)."""
        d = self.to_dict()
        chosen = {k: d[k] for k in (sections or d)}
        return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:16]


class ConfigError(ValueError):
    """A configuration problem the user must fix; its message names the key."""


_SECTIONS = {f.name: f.type for f in dataclasses.fields(JobConfig)}


def _section_class(name: str) -> type:
    return {"data": DataConfig, "model": ModelConfig, "cache": CacheConfig, "train": TrainConfig, "run": RunConfig}[
        name
    ]


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Map each field of a dataclass to the docstring written under it in the source (inherited fields included)."""
    docs: dict[str, str] = {}
    for base in cls.__mro__[1:]:
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _coerce(key: str, value: Any, default: Any, annotation: Any) -> Any:
    """Turn a YAML/CLI value into the field's type, or raise a ConfigError naming the key."""
    if annotation in ("Any", Any) or annotation is typing.Any:
        return value
    kind = type(default)
    try:
        if kind is bool:
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered in ("true", "1", "yes", "on"):
                    return True
                if lowered in ("false", "0", "no", "off"):
                    return False
                raise ValueError(value)
            if isinstance(value, (bool, int)):
                return bool(value)
            raise ValueError(value)
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if kind is float:
            return float(value)
        if kind is str:
            if isinstance(value, bool):  # YAML reads true/false as booleans; choice keys spell them in lower case
                return str(value).lower()
            return "" if value is None else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}") from None
    return value


ALIASES = {
    ("train", "network_dim"): "rank",  # kohya
    ("train", "lora_rank"): "rank",  # SimpleTuner
    ("train", "network_alpha"): "alpha",  # kohya
    ("train", "lora_alpha"): "alpha",  # SimpleTuner
    ("train", "train_batch_size"): "batch_size",
    ("train", "gradient_accumulation_steps"): "gradient_accumulation",
    ("train", "max_train_steps"): "max_steps",
    ("train", "max_train_epochs"): "epochs",  # kohya
    ("train", "num_train_epochs"): "epochs",  # SimpleTuner
    ("train", "lr_warmup_steps"): "warmup_steps",
    ("train", "lr_scheduler_num_cycles"): "lr_cycles",  # kohya
    ("train", "lr_num_cycles"): "lr_cycles",  # SimpleTuner
    ("train", "lr_scheduler_power"): "lr_power",  # kohya
    ("train", "caption_dropout_rate"): "caption_dropout",  # kohya
    ("train", "caption_dropout_probability"): "caption_dropout",  # SimpleTuner
    ("train", "save_every_n_steps"): "checkpoint_every",  # kohya
    ("train", "checkpointing_steps"): "checkpoint_every",  # SimpleTuner
    ("train", "checkpoints_total_limit"): "checkpoints_to_keep",  # SimpleTuner
    ("train", "validation_steps"): "validation_every",  # SimpleTuner
    ("data", "bucket_reso_steps"): "bucket_step",  # kohya
}
"""kohya (sd-scripts) and SimpleTuner names accepted for keys that mean exactly the same thing here."""


def apply(cfg: JobConfig, updates: dict, prefix: str = "") -> JobConfig:
    """Apply a nested dict of updates (from YAML or ``--set``) to ``cfg`` in place, checking every key."""
    for name, value in updates.items():
        if name not in _SECTIONS:
            raise ConfigError(f"unknown config section {prefix}{name!r}; expected one of {sorted(_SECTIONS)}")
        if not isinstance(value, dict):
            raise ConfigError(f"config section {name!r} must be a mapping")
        section = getattr(cfg, name)
        fields = {f.name: f for f in dataclasses.fields(section)}
        value = _resolve_aliases(name, value)
        for key, raw in value.items():
            if key not in fields:
                raise ConfigError(f"unknown config key {name}.{key}; known keys: {', '.join(sorted(fields))}")
            current = getattr(section, key)
            setattr(section, key, _coerce(f"{name}.{key}", raw, current, fields[key].type))
    return cfg


def _resolve_aliases(section: str, values: dict) -> dict:
    """Rename aliased keys to their own names; an alias beside its key (or another alias of it) is an error."""
    out: dict = {}
    said: dict = {}
    for key, raw in values.items():
        own = ALIASES.get((section, key), key)
        if own in out:
            raise ConfigError(f"{section}.{said[own]} and {section}.{key} both set {section}.{own}; keep one")
        out[own], said[own] = raw, key
    return out


def parse_set(item: str) -> dict:
    """``train.epochs=3`` -> ``{"train": {"epochs": 3}}``; the value is parsed as YAML (so ``[1, 4]`` is a list)."""
    if "=" not in item:
        raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2:
        raise ConfigError(f"--set key must look like section.key, got {key!r}")
    section = _section_class(parts[0]) if parts[0] in _SECTIONS else None
    default = getattr(section(), ALIASES.get((parts[0], parts[1]), parts[1]), None) if section else None
    # String keys take the text as written: YAML would turn "1:0.4" into 60.4 (sexagesimal) or "off" into False.
    if isinstance(default, str):
        return {parts[0]: {parts[1]: raw}}
    value = yaml.safe_load(raw) if raw.strip() else ""
    return {parts[0]: {parts[1]: value}}


def load(config_file: str | None = None, overrides: list[str] = ()) -> JobConfig:
    """Build a JobConfig from defaults, then an optional YAML file, then ``--set`` overrides in order."""
    cfg = JobConfig()
    if config_file:
        text = Path(config_file).read_text()
        data = yaml.safe_load(text) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{config_file}: top level must be a mapping of sections")
        apply(cfg, data)
    for item in overrides:
        apply(cfg, parse_set(item))
    validate(cfg)
    return cfg


def worker_range(num_workers: Any) -> tuple[int, int]:
    """Normalise ``train.num_workers`` (int or [min, max]) to a (min, max) pair."""
    if isinstance(num_workers, bool):
        raise ConfigError("train.num_workers must be an integer or [min, max]")
    if isinstance(num_workers, int):
        lo = hi = num_workers
    elif isinstance(num_workers, (list, tuple)) and len(num_workers) == 2 and all(
        isinstance(n, int) and not isinstance(n, bool) for n in num_workers
    ):
        lo, hi = num_workers
    else:
        raise ConfigError(f"train.num_workers must be an integer or [min, max], got {num_workers!r}")
    if lo < 1 or hi < lo:
        raise ConfigError(f"train.num_workers needs 1 <= min <= max, got {num_workers!r}")
    return lo, hi


def resource_map(key: str, value: Any) -> dict[str, float]:
    """Check a custom-resource mapping (``{name: amount}``); CPU and GPU have their own keys."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key} must be a mapping of resource name to amount, got {value!r}")
    out = {}
    for name, amount in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{key}: resource names must be non-empty strings, got {name!r}")
        if name in ("CPU", "GPU"):
            raise ConfigError(f"{key}: set {name} through its own key (cpus_per_worker, actor_cpus, use_gpu)")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
            raise ConfigError(f"{key}.{name} must be a positive number, got {amount!r}")
        out[name] = float(amount)
    return out


_CHOICES = {
    ("model", "dtype"): ("auto", "bfloat16", "float16", "float32"),
    ("model", "vae_dtype"): ("", "auto", "bfloat16", "float16", "float32"),
    ("cache", "dtype"): ("auto", "float32", "float16", "bfloat16"),
    ("train", "use_gpu"): ("auto", "true", "false"),
    ("cache", "use_gpu"): ("auto", "true", "false"),
    ("train", "sigma_sampling"): ("logit_normal", "uniform", "sigmoid", "shift", "flux_shift"),
    ("train", "loss_weighting"): ("none", "sigma_sqrt", "cosmap"),
    ("train", "lr_scheduler"): ("constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts",
                                "polynomial"),
    ("train", "mixed_precision"): ("auto", "bf16", "fp32"),
    ("train", "output_format"): ("diffusers", "kohya"),
}
_POSITIVE = {
    ("data", "max_image_pixels"),
    ("cache", "batch_size"),
    ("cache", "text_batch_size"),
    ("cache", "rows_per_shard"),
    ("train", "epochs"),
    ("train", "batch_size"),
    ("train", "rank"),
    ("train", "alpha"),
    ("train", "learning_rate"),
    ("train", "lr_cycles"),
    ("train", "lr_power"),
    ("train", "gradient_accumulation"),
    ("train", "batches_per_read"),
    ("train", "log_every"),
    ("train", "checkpoints_to_keep"),
    ("train", "validation_inference_steps"),
}


def validate(cfg: JobConfig) -> None:
    """Check value ranges and choices; raise ConfigError naming the first bad key."""
    for (section, key), choices in _CHOICES.items():
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            raise ConfigError(f"{section}.{key} must be one of {', '.join(choices)}; got {value!r}")
    for section, key in _POSITIVE:
        value = getattr(getattr(cfg, section), key)
        if value <= 0:
            raise ConfigError(f"{section}.{key} must be positive, got {value}")
    if cfg.data.alignment < 0:
        raise ConfigError(f"data.alignment must be 0 (the model's) or positive, got {cfg.data.alignment}")
    for key in ("max_steps", "warmup_steps", "checkpoint_every", "validation_every", "max_grad_norm",
                "prefetch_reads", "report_seconds"):
        if getattr(cfg.train, key) < 0:
            raise ConfigError(f"train.{key} must be >= 0")
    for key in ("lora_dropout", "caption_dropout"):
        if not 0 <= getattr(cfg.train, key) < 1:
            raise ConfigError(f"train.{key} must be in [0, 1), got {getattr(cfg.train, key)}")
    if cfg.train.guidance_max and cfg.train.guidance_max < cfg.train.guidance:
        raise ConfigError("train.guidance_max must be 0 (constant guidance) or >= train.guidance")
    prompts = cfg.train.validation_prompts
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ConfigError(f"train.validation_prompts must be a YAML list of strings, e.g. ['a cat']; got {prompts!r}")
    refs = cfg.train.validation_references
    if refs and (not isinstance(refs, list) or len(refs) != len(prompts) or not all(
            isinstance(r, str) or (isinstance(r, list) and r and all(isinstance(x, str) for x in r)) for r in refs)):
        raise ConfigError("train.validation_references must list one reference image (or a list of them) per "
                          f"validation prompt; got {refs!r} for {len(prompts)} prompt(s)")  # fmt: skip
    if cfg.train.lr_scheduler == "constant" and cfg.train.warmup_steps:
        raise ConfigError("train.lr_scheduler=constant has no warmup (as in diffusers); for train.warmup_steps="
                          f"{cfg.train.warmup_steps} use constant_with_warmup")  # fmt: skip
    stem = cfg.train.output_name or cfg.run.name
    if not stem or any(c in stem for c in '/\\:*?"<>|') or stem.startswith("."):
        raise ConfigError(f"train.output_name (else run.name) must be a plain file-name stem; got {stem!r}")
    if cfg.train.cpus_per_worker <= 0:
        raise ConfigError("train.cpus_per_worker must be positive")
    refresh_interval(cfg.cache.refresh)
    worker_range(cfg.train.num_workers)
    if cfg.train.max_failures < -1:
        raise ConfigError("train.max_failures must be -1 (no limit) or >= 0")
    if cfg.train.resize_check_seconds < 0:
        raise ConfigError("train.resize_check_seconds must be >= 0")
    resource_map("train.worker_resources", cfg.train.worker_resources)
    resource_map("cache.actor_resources", cfg.cache.actor_resources)
    if cfg.model.dtype == "float16":
        raise ConfigError("model.dtype=float16: FLUX's transformer and T5 overflow in fp16; use bfloat16 "
                          "(model.vae_dtype=float16 runs the VAE alone in fp16)")  # fmt: skip
    from rayflux.cache.fit import check_config  # these build on this module's types
    from rayflux.plan import checkpointing_setting

    check_config(cfg)
    cfg.train.gradient_checkpointing = checkpointing_setting(cfg.train.gradient_checkpointing)
    if cfg.data.reg_loss_weight < 0:
        raise ConfigError(f"data.reg_loss_weight must be >= 0, got {cfg.data.reg_loss_weight}")
    from rayflux.datasets import datasets_of  # it builds on this module's types

    datasets_of(cfg.data)  # every dataset, listed or single, checked like a section of its own


def refresh_interval(refresh: str) -> int:
    """``never`` -> 0, ``every_epoch`` -> 1, ``"3"`` -> 3."""
    if refresh == "never":
        return 0
    if refresh == "every_epoch":
        return 1
    try:
        n = int(refresh)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"cache.refresh must be never, every_epoch or a positive integer; got {refresh!r}")
    return n


def help_text() -> str:
    """Every key with its default and docstring, for ``--help``."""
    lines = ["Config keys (set with --set KEY=VALUE or in a --config YAML file):"]
    defaults = JobConfig()
    for name in _SECTIONS:
        cls = _section_class(name)
        lines.append(f"\n  {name}: {cls.__doc__}")
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, name), f.name)
            lines.append(f"    {name}.{f.name} = {default!r}")
            lines.append(textwrap.fill(docs.get(f.name, ""), 100, initial_indent=" " * 8, subsequent_indent=" " * 8))
    lines.append("\n  Also accepted, with the same meaning (kohya sd-scripts / SimpleTuner names):")
    lines += [f"    {section}.{alias} -> {section}.{own}" for (section, alias), own in ALIASES.items()]
    return "\n".join(lines)


def from_dict(d: dict) -> JobConfig:
    """Rebuild a JobConfig from ``JobConfig.to_dict()`` (how the config travels to Ray workers)."""
    return apply(JobConfig(), d)
