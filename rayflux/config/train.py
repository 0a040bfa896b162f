"""The ``train`` section: the training loop's own keys, and one sub-section per component of it.

``train.workers`` (how many workers, where, on what), ``train.feed`` (how batches reach them), ``train.optim`` (the
optimizer and its learning-rate schedule), ``train.adapter`` (what is trained), ``train.flow`` (the flow-matching
objective), ``train.checkpoint`` (what is saved and exported), ``train.eval`` (the held-out loss) and
``train.validation`` (the rendered images), as torchtitan keeps one dataclass per component. The keys of the flat
``train`` section that came before the split still load (``train.learning_rate`` is ``train.optim.learning_rate``):
each moved field names its old key in its metadata (:func:`rayflux.config.identity.moved`), which the loader reads as
an alias and the identities read as the name they hash, so no cache key or run identity changed with the split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayflux.config.identity import SECTION, TRAINED, UNTRACKED, added, moved
from rayflux.config.values import ConfigError


@dataclass
class WorkersConfig:
    """The Ray Train workers: how many, their resources and device, failures and elastic resizes."""

    num_workers: Any = field(default=2, metadata=moved(UNTRACKED, "num_workers"))
    """Ray Train workers: an integer, or ``[min, max]`` for an elastic run."""
    cpus_per_worker: float = field(default=0.5, metadata=moved(UNTRACKED, "cpus_per_worker"))
    """CPUs reserved per worker. Fractional values let two workers share a small machine."""
    on_gpu: str = field(default="auto", metadata=moved(UNTRACKED, "use_gpu"))
    """Train on GPUs: ``auto`` (when the cluster has them or ``train.workers.accelerator_type`` is set), ``true`` or
    ``false``. (Was ``train.use_gpu``.)"""
    accelerator_type: str = field(default="", metadata=moved(UNTRACKED, "accelerator_type"))
    """GPU type every train worker needs (e.g. ``H100``), so workers go only to such nodes. Empty: any. Implies GPU
    training."""
    worker_resources: dict = field(default_factory=dict, metadata=moved(UNTRACKED, "worker_resources"))
    """Extra Ray resources each train worker reserves, e.g. ``{train_node: 1}`` to keep training on a node type that
    declares that custom resource."""
    max_failures: int = field(default=3, metadata=moved(UNTRACKED, "max_failures"))
    """Restarts after a worker or node failure before the job gives up (-1: no limit). Each resumes from the latest
    checkpoint. Announced preemptions (node drains) are not counted here: Ray Train retries those without limit."""
    resize_check_seconds: float = field(default=60.0, metadata=moved(UNTRACKED, "resize_check_seconds"))
    """How often an elastic run (``num_workers: [min, max]``) looks for room for more workers. Growing restarts the
    worker group from the latest checkpoint."""
    base_fsdp: str = field(default="none", metadata=moved(TRAINED, "base_sharding"))
    """How the frozen transformer is held across workers: ``none`` (every worker holds all of it, as DDP does),
    ``node`` (FSDP2 splits it across the workers of each node and replicates across nodes; the LoRA and its AdamW
    state stay whole on every worker) or ``auto`` (``node`` when the memory plan says the whole base does not fit
    beside the activations on one GPU). (Was ``train.base_sharding``.)"""
    start_during_cache: bool = field(default=True, metadata=added(moved(UNTRACKED, "start_during_cache")))
    """Start the worker group, and load the base and attach the LoRA, while the cache stage runs; the workers then
    wait for the committed generation, and the plan follows from its manifest. Only where the workers fit beside the
    encoders (:mod:`rayflux.train.early`): on GPUs of their own, or sharing each training GPU with one encoder actor
    where the memory plan says both fit (:mod:`rayflux.train.gpu_sharing`); otherwise, and with ``false``, the cache
    stage runs first, then the group.
    (Also ``train.start_during_cache``.)"""


@dataclass
class FeedConfig:
    """How the cached samples reach each worker: Ray Data reads, prefetch and the block shuffle."""

    batches_per_read: int = field(default=8, metadata=moved(UNTRACKED, "batches_per_read"))
    """Planned batches that one Ray Data read task loads and stacks for a worker. Larger reads cost the worker less
    scheduling per step (its share of the feed runs beside the step); the first step waits for one whole read."""
    prefetch_reads: int = field(default=2, metadata=moved(UNTRACKED, "prefetch_reads"))
    """Reads each worker's feed keeps ahead of the step it is training (0: none), so the Parquet reads of the next
    batches overlap the current step; the feed runs at most ``prefetch_reads + 1`` read tasks at once. Host memory
    held: about ``(prefetch_reads + 1) × batches_per_read`` batches."""
    shuffle_block: int = field(default=4, metadata=moved(TRAINED, "read_run"))
    """Batches are filled with shuffled blocks of up to this many neighbouring rows of one Parquet file (a block
    shuffle, as MosaicML Streaming and WebDataset do), so a block's latents are one read: ``1 + 1/shuffle_block``
    requests per sample when every caption differs, against 2 for a per-sample shuffle (``1``). Larger blocks mean
    fewer requests and less varied batches (a batch holds ``batch_size / shuffle_block`` groups of storage
    neighbours). Blocks save requests only within a batch: they pay off when ``train.batch_size`` is at least
    ``shuffle_block``. (Was ``train.read_run``.)"""


@dataclass
class OptimConfig:
    """The LoRA's optimizer, its learning-rate schedule, gradient clipping and the weights' moving average."""

    name: str = field(default="adamw", metadata=moved(TRAINED, "optimizer"))
    """The optimizer: ``adamw`` (torch), ``adamw8bit`` (bitsandbytes' 8-bit AdamW: a quarter of AdamW's state;
    CUDA GPUs only; extra ``rayflux[adamw8bit]``), ``prodigy`` (prodigyopt: estimates its own step size, so
    ``learning_rate`` is a multiplier, 1.0 by its convention; extra ``rayflux[prodigy]``), ``adafactor``
    (transformers' Adafactor with a fixed ``learning_rate``: factored second moments, the smallest state) or
    ``schedulefree_adamw`` (schedulefree: no LR schedule, so ``lr_scheduler`` must be ``constant`` or
    ``constant_with_warmup`` and ``warmup_steps`` is its own warmup; validation images and every saved LoRA use its
    averaged weights; extra ``rayflux[schedulefree]``). Each package is imported only when chosen. (Was
    ``train.optimizer``.)"""
    learning_rate: float = field(default=1e-4, metadata=moved(TRAINED, "learning_rate"))
    """The optimizer's learning rate (the peak, after warmup). ``prodigy``: a multiplier of its own estimate, 1.0 by
    convention."""
    weight_decay: float = field(default=0.0, metadata=moved(TRAINED, "weight_decay"))
    """The optimizer's weight decay (decoupled, as AdamW's)."""
    lr_scheduler: str = field(default="constant", metadata=moved(TRAINED, "lr_scheduler"))
    """Learning-rate schedule, by diffusers' names and meanings (``diffusers.optimization.get_scheduler``):
    ``constant`` (no warmup), ``constant_with_warmup``, ``linear``, ``cosine`` (to 0 at the last step),
    ``cosine_with_restarts`` or ``polynomial``."""
    warmup_steps: int = field(default=0, metadata=moved(TRAINED, "warmup_steps"))
    """Optimizer steps of linear warmup from 0 up to ``learning_rate`` (every schedule but ``constant``;
    ``schedulefree_adamw`` warms up by itself)."""
    lr_cycles: int = field(default=1, metadata=moved(TRAINED, "lr_cycles"))
    """Hard restarts of ``cosine_with_restarts`` (kohya's ``lr_scheduler_num_cycles``)."""
    lr_power: float = field(default=1.0, metadata=moved(TRAINED, "lr_power"))
    """Power of the ``polynomial`` decay (kohya's ``lr_scheduler_power``); 1 is linear."""
    max_grad_norm: float = field(default=1.0, metadata=moved(TRAINED, "max_grad_norm"))
    """Clip the LoRA gradient norm to this (0 disables clipping; the norm is still reported)."""
    ema_decay: float = field(default=0.0, metadata=moved(TRAINED, "ema_decay"))
    """Keep an exponential moving average (EMA) of the adapter's weights with this decay (0: off; 0.999 is a common
    choice; SimpleTuner's ``use_ema: true`` means 0.995). Each step moves the average ``1 - decay`` of the way to the
    new weights, with diffusers' ``EMAModel`` warmup: the decay at optimizer step ``n`` is
    ``min(ema_decay, n / (n + 9))``
    (0 at step 1, so the average starts at the first step's weights and the untrained init fades fast);
    ``ema_decay`` itself applies from step ``9 * ema_decay / (1 - ema_decay)`` on (891 for 0.99, 8991 for 0.999), and
    before that the average spans about the last tenth of the steps. The average is exported beside the
    plain LoRA as ``lora/<output_name>-ema.safetensors`` (and ``-step<step>-ema`` per checkpoint), and the eval loss,
    the best-LoRA file and validation images use it. 4 bytes a trainable parameter on each worker's device. Not with
    ``schedulefree_adamw``, which already evaluates an average of its own."""

    # issue 45: LoRA+ (item 4)
    lora_plus_ratio: float = field(default=0.0, metadata=added(moved(TRAINED, "lora_plus_ratio")))
    """LoRA+: the ``B`` matrices train at this many times ``learning_rate`` (the LoRA+ paper suggests 16 for wide
    layers); 0 turns it off. Two parameter groups of the optimizer (``A`` and DoRA's magnitudes at
    ``learning_rate``, ``B`` at the multiple), both following the schedule. Refused with ``train.adapter.kind:
    lokr`` (no A/B pair) and ``train.optim.name: prodigy`` (one step size for every group). (Also
    ``train.lora_plus_ratio``.)"""


@dataclass
class AdapterConfig:
    """What is trained on the frozen transformer: the adapter's kind, size and targets."""

    kind: str = field(default="lora", metadata=moved(TRAINED, "adapter"))
    """What is trained on each target: ``lora``, ``dora`` (peft's ``use_dora``: LoRA plus a learned magnitude per
    output row, about the same size) or ``lokr`` (peft's ``LoKrConfig``: ``kron(w1, w2)``, w2 of rank
    ``train.adapter.rank`` when that is under half its larger side). kohya's ``network_module`` is accepted for it:
    ``networks.lora``/``networks.lora_flux`` mean ``lora``; ``lycoris.kohya`` needs its ``network_args`` to say
    which, so it is refused with the choice: ``algo=lora`` and ``dora_wd=True`` is ``dora``, ``algo=lokr``
    ``lokr``. LoKr exports only with ``train.checkpoint.output_format=kohya`` (LyCORIS keys), has no
    ``train.adapter.lora_dropout`` and cannot start from ``train.adapter.init_lora``. DoRA and LoKr need
    ``train.workers.base_fsdp: none`` (``auto`` keeps the base whole). (Was ``train.adapter``.)"""
    rank: int = field(default=4, metadata=moved(TRAINED, "rank"))
    """LoRA rank (LoKr: the rank of its factored w2)."""
    alpha: float = field(default=4.0, metadata=moved(TRAINED, "alpha"))
    """LoRA alpha; the update is scaled by alpha / rank."""
    lora_dropout: float = field(default=0.0, metadata=moved(TRAINED, "lora_dropout"))
    """Dropout on the LoRA branch's input during training."""
    targets: str = field(default="attention", metadata=moved(TRAINED, "targets"))
    """What the adapter trains, as comma-separated terms: presets (``attention``, ``attention+ffs``: attention and
    feed-forward, ``context``: the double blocks' text stream, ``all``: every Linear of the blocks), module names
    (a name matches itself or any module ending in ``.name``) or globs over full names, excludes (``-name``), and
    block ranges (``double 0-9, single all``: only these blocks; with no preset or name, their attention).
    ``python -m rayflux plan`` lists the modules and parameters a spec selects."""
    init_lora: str = field(default="", metadata=moved(TRAINED, "init_lora"))
    """Start from this LoRA file (diffusers or kohya keys, local or URI) instead of a fresh adapter."""

    # issue 45: per-block rank and alpha (item 4)
    rank_pattern: dict = field(default_factory=dict, metadata=added(moved(TRAINED, "rank_pattern")))
    """Other ranks for some targets (peft's ``rank_pattern``), as ``{target spec: rank}`` with the keys in
    ``train.adapter.targets``' terms: ``{"single 20-37": 16, "double all": 8}`` (block terms alone mean every trained
    module of those blocks; a later key wins where keys overlap). LoRA and DoRA; with ``output_format: kohya`` the
    parts of one fused kohya layer (a block's to_q/to_k/to_v) must share a rank. The exported files keep each
    module's rank, and kohya and diffusers loaders read it from the tensors' shapes. (Also ``train.rank_pattern``.)"""
    alpha_pattern: dict = field(default_factory=dict, metadata=added(moved(TRAINED, "alpha_pattern")))
    """Other alphas for some targets (peft's ``alpha_pattern``), keyed as ``rank_pattern``. (Also
    ``train.alpha_pattern``.)"""


@dataclass
class FlowConfig:
    """The flow-matching objective: how σ is drawn, the guidance fed in, the loss weight and caption dropout."""

    guidance: float = field(default=1.0, metadata=moved(TRAINED, "guidance"))
    """Guidance value fed to guidance-distilled models (ignored when the model has no guidance embedding)."""
    guidance_max: float = field(default=0.0, metadata=moved(TRAINED, "guidance_max"))
    """When above ``guidance``, each sample's guidance is drawn uniformly from [guidance, guidance_max]."""
    sigma_sampling: str = field(default="auto", metadata=moved(TRAINED, "sigma_sampling"))
    """How σ is drawn: ``logit_normal``, ``uniform``, ``sigmoid``, ``shift``, ``flux_shift`` (a logit-normal draw
    shifted as FLUX.1's pipelines shift their schedule, by a μ linear in the image's token count, from the model's
    ``scheduler_config.json``), ``flux2_shift`` (the same with FLUX.2's pipelines' μ, fitted in the token count and
    the model's denoising steps: 4 for step-distilled [klein], else 50) or ``auto`` (the model family's own
    pipeline's: ``flux2_shift`` for FLUX.2, ``flux_shift`` for FLUX.1 and Kontext; the default). Before ``auto`` was
    the default it was ``logit_normal``: a run directory started then keeps that schedule when it is continued
    (:func:`rayflux.job.open_ledger`)."""
    logit_mean: float = field(default=0.0, metadata=moved(TRAINED, "logit_mean"))
    """Mean of the normal behind ``logit_normal``."""
    logit_std: float = field(default=1.0, metadata=moved(TRAINED, "logit_std"))
    """Standard deviation of the normal behind ``logit_normal``; the scale for ``sigmoid``."""
    shift: float = field(default=3.0, metadata=moved(TRAINED, "shift"))
    """The fixed shift for ``sigma_sampling=shift``."""
    loss_weighting: str = field(default="none", metadata=moved(TRAINED, "loss_weighting"))
    """Per-sample loss weight: ``none``, ``sigma_sqrt`` (σ⁻²) or ``cosmap``."""
    caption_dropout: float = field(default=0.0, metadata=moved(TRAINED, "caption_dropout"))
    """Probability of training a sample on the cached empty-caption embedding instead of its caption."""
    # issue 45: output preservation (rayflux.preservation, rayflux.train.preserve)
    preservation: str = field(default="none", metadata=added(moved(TRAINED, "preservation")))
    """Output preservation without a regularisation set (ai-toolkit's differential output preservation): on every
    step each sample's noisy latent also goes through the base model (the adapter switched off) on a preservation
    prompt, and the LoRA model's prediction on that prompt is pulled towards the base's. ``none``; ``class``: the
    caption with the dataset's ``trigger_word`` replaced by its ``class_word`` (cached beside the captions);
    ``blank``: the empty prompt. Costs two more forwards a batch (one without gradients) and one more backward.
    ``train.preservation`` is accepted for it."""
    preservation_weight: float = field(default=1.0, metadata=added(moved(TRAINED, "preservation_weight")))
    """Weight of the preservation term added to the loss (ai-toolkit's ``diff_output_preservation_multiplier``);
    ``train.preservation_weight`` is accepted for it."""

    # issue 45: timestep presets (item 3)
    timestep_bias: str = field(default="balanced", metadata=added(moved(TRAINED, "timestep_bias")))
    """Moves the ``sigma_sampling`` draws (and the eval grid) towards low or high noise: ``balanced`` (as drawn),
    ``content`` (``logit(σ) - 1``: lower noise, for likeness and detail) or ``style`` (``logit(σ) + 1``: higher
    noise, for composition and colour). With ``logit_normal`` this is exactly ``logit_mean`` moved by -1 or +1.
    (Also ``train.timestep_bias``.)"""


@dataclass
class CheckpointConfig:
    """Checkpoints in storage and the LoRA files exported from them."""

    every: int = field(default=0, metadata=moved(UNTRACKED, "checkpoint_every"))
    """Checkpoint every this many optimizer steps (0: only at the end; the last step always checkpoints). (Was
    ``train.checkpoint_every``.)"""
    keep: int = field(default=2, metadata=moved(UNTRACKED, "checkpoints_to_keep"))
    """How many of the newest checkpoints to keep in storage. (Was ``train.checkpoints_to_keep``.)"""
    output_format: str = field(default="diffusers", metadata=moved(UNTRACKED, "output_format"))
    """Exported LoRA keys: ``diffusers`` (``transformer.*``, in ``lora/pytorch_lora_weights.safetensors``) or
    ``kohya`` (``lora_unet_*`` with sd-scripts' ``ss_*`` metadata, for ComfyUI, in ``lora/<output_name>.safetensors``;
    DoRA adds LyCORIS's ``dora_scale``; LoKr writes LyCORIS's ``lycoris_*`` keys and needs this format).
    Every checkpoint also leaves ``lora/<output_name>-step00000500.safetensors`` in this format."""
    output_name: str = field(default="", metadata=moved(TRAINED, "output_name"))
    """Stem of the exported LoRA file names (kohya's ``output_name``). Empty: ``run.name``."""


@dataclass
class EvalConfig:
    """The eval loss on held-out samples (``data.eval_samples``)."""

    every: int = field(default=0, metadata=moved(UNTRACKED, "eval_every"))
    """With ``data.eval_samples``: score the eval loss every this many steps, besides before the first step (the
    base model's baseline) and at the end (0: only those two). The LoRA with the lowest eval loss so far is kept as
    ``lora/<output_name>-best.safetensors``. (Was ``train.eval_every``.)"""
    sigmas: int = field(default=5, metadata=moved(UNTRACKED, "eval_sigmas"))
    """Noise levels each held-out sample is scored at: the quantiles of the training σ density, with fixed noise.
    (Was ``train.eval_sigmas``.)"""


@dataclass
class ValidationConfig:
    """Validation images: rendered off the training ranks by a render actor while training goes on."""

    prompts: list[str] = field(default_factory=list, metadata=moved(UNTRACKED, "validation_prompts"))
    """Prompts rendered with the LoRA of every ``train.validation.every``-th step (a YAML list), by a render actor
    beside the training workers, while training goes on. Empty: no validation images. (Was
    ``train.validation_prompts``.)"""
    references: list = field(default_factory=list, metadata=moved(TRAINED, "validation_references"))
    """Edit models (FLUX.1 Kontext, FLUX.2): each validation prompt's reference image (a path or URI; for FLUX.2 also
    a list of them), in the prompts' order; the renders are then edits of them. Empty: plain renders."""
    every: int = field(default=0, metadata=moved(UNTRACKED, "validation_every"))
    """Render validation images every this many steps (0: only at the end)."""
    inference_steps: int = field(default=0, metadata=moved(UNTRACKED, "validation_inference_steps"))
    """Denoising steps per validation image; 0: what the model is meant to run with (its family says: FLUX.2
    [klein] 4 when step-distilled, 50 for [klein] base; 20 otherwise)."""
    guidance: float = field(default=0.0, metadata=moved(UNTRACKED, "validation_guidance"))
    """Guidance scale for validation images; 0: the model's own (FLUX.2 [klein] base: classifier-free guidance 4;
    distilled [klein]: none; 3.5 otherwise)."""
    true_cfg: float = field(default=0.0, metadata=added(moved(UNTRACKED, "validation_true_cfg")))
    """Classifier-free guidance for a FLUX.1 model that embeds no guidance value ([schnell]-like, as the world base):
    each denoising step also predicts for ``train.validation.negative_prompt`` and moves the prediction away from it
    by this scale, above 1 (diffusers' ``true_cfg_scale``; twice the transformer's work per step). 0: off. A model made with
    caption dropout follows its prompts better with it (docs/quality.md, "The world base")."""
    negative_prompt: str = field(default="", metadata=added(moved(UNTRACKED, "validation_negative_prompt")))
    """What ``train.validation.true_cfg`` guides away from (empty: the empty caption, the unconditional branch that
    caption dropout trains)."""
    resources: dict = field(default_factory=dict, metadata=moved(TRAINED, "validation_resources"))
    """Ray resources of the render actor, e.g. ``{GPU: 1, "accelerator_type:L4": 0.001}`` (a cheaper GPU type),
    ``{GPU: 0.25}`` (a share of a training node's GPU: each worker then takes the rest of its GPU) or ``{CPU: 0.5}``.
    Empty: what fits the cluster (a CPU share on a CPU cluster; else a ``cache.accelerator_type`` GPU, else a spare
    GPU, else a quarter of a training GPU); the job logs what it chose."""
    queue: int = field(default=2, metadata=moved(TRAINED, "validation_queue"))
    """Renders that may be pending at once; a step due while this many are still pending is skipped (logged), so a
    slow renderer never holds training back. The last step's render is always queued."""
    wait_seconds: float = field(default=900.0, metadata=moved(TRAINED, "validation_wait_seconds"))
    """How long the end of a trainer segment (one ``TorchTrainer.fit``) waits for the renders still due before it
    abandons them (logged)."""
    # issue 45: FLUX.2 [klein] right by default (item 5)
    model: str = field(default="", metadata=added(moved(UNTRACKED, "validation_model")))
    """Render validation images with this model (a directory or hub id of the same family and transformer shape,
    e.g. the step-distilled FLUX.2 [klein] while training on its base) instead of ``model.path``; its own steps and
    guidance apply. Empty: ``model.path``. (Also ``train.validation_model``.)"""


@dataclass
class TrainConfig:
    """The LoRA training stage: the loop's own keys here, each component in a ``train.<part>`` section below."""

    epochs: int = field(default=2, metadata=UNTRACKED)
    """Passes over the cached samples."""
    max_steps: int = field(default=0, metadata=UNTRACKED)
    """Stop after this many optimizer steps per worker (0: run all epochs). Also the LR schedule's horizon."""
    batch_size: int = field(default=1, metadata=TRAINED)
    """Samples per batch on each worker. A batch always holds one bucket."""
    gradient_accumulation: int = field(default=1, metadata=TRAINED)
    """Batches per optimizer step on each worker."""
    seed: int = field(default=0, metadata=TRAINED)
    """Seed for noise, σ and the batch order. Every rank derives its own stream from it."""
    mixed_precision: str = field(default="auto", metadata=TRAINED)
    """``auto`` (bf16 autocast on GPU, fp32 on CPU), ``bf16`` (autocast everywhere) or ``fp32`` (no autocast)."""
    base_dtype: str = field(default="bf16", metadata=TRAINED)
    """How the frozen transformer's Linear layers are held and multiplied: ``bf16`` (``model.dtype``), ``fp8``
    (torchao's float8 matmuls over the kept bf16 weights: faster, not smaller; GPUs of compute capability 8.9 or
    more; extra ``rayflux[fp8]``) or ``nf4`` (bitsandbytes 4-bit at load, the QLoRA recipe: about a quarter of bf16;
    extra ``rayflux[nf4]``). fp8 and nf4 need CUDA GPUs and ``train.workers.base_fsdp: none``; where they cannot run
    the job stops with the reason. The LoRA trains and saves in full precision and loads on the bf16 base."""
    gradient_checkpointing: Any = field(default="auto", metadata=TRAINED)
    """Recompute block activations in the backward pass: ``auto`` (on for GPU runs at 768 px or more, or when the
    memory estimate printed at start exceeds 90% of the GPU), ``true`` or ``false``."""
    compile: bool = field(default=False, metadata=TRAINED)
    """``torch.compile`` the transformer's repeated blocks (regional compilation, as diffusers'
    ``compile_repeated_blocks``): one compiled graph shared by all double-stream and one by all single-stream blocks.
    The first step pays the compile (tens of seconds on a GPU, minutes on CPU; a new bucket shape may compile again,
    then shapes turn dynamic); the later steps are what it speeds up (the GPU benchmark's compiled rows measure it).
    Works with the LoRA adapters, gradient checkpointing and DDP; needs ``train.workers.base_fsdp: none``. Compiled
    kernels round differently from eager ones (the LoRA after a few steps agrees to well under 1%), and compiled LoRA
    dropout draws other random numbers."""
    log_every: int = field(default=1, metadata=UNTRACKED)
    """Report metrics to Ray Train no more often than every this many steps (and ``report_seconds``; the later of
    the two wins). Per-step metrics go to TensorBoard and ``metrics/steps.jsonl`` at every step regardless."""
    report_seconds: float = field(default=30.0, metadata=UNTRACKED)
    """Wall-clock seconds between metrics reports to Ray Train (checkpoints report whenever they are due). Each
    report is a barrier of all ranks that costs tens of milliseconds, and Ray Train collects reports only when it polls
    the workers (every 0.5 s; Ray's default is 2 s), so reporting every step would stall a fast step that long;
    30 s keeps the cost under 1% of the time at any step time. 0: report every step."""
    workers: WorkersConfig = field(default_factory=WorkersConfig, metadata=SECTION)
    """How many workers train, where, on what, and how failures and resizes are handled."""
    feed: FeedConfig = field(default_factory=FeedConfig, metadata=SECTION)
    """How the cached samples reach each worker."""
    optim: OptimConfig = field(default_factory=OptimConfig, metadata=SECTION)
    """The optimizer and its learning-rate schedule."""
    adapter: AdapterConfig = field(default_factory=AdapterConfig, metadata=SECTION)
    """What is trained: the adapter's kind, size and targets."""
    flow: FlowConfig = field(default_factory=FlowConfig, metadata=SECTION)
    """The flow-matching objective."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata=SECTION)
    """Checkpoints and the exported LoRA files."""
    eval: EvalConfig = field(default_factory=EvalConfig, metadata=SECTION)
    """The eval loss on held-out samples."""
    validation: ValidationConfig = field(default_factory=ValidationConfig, metadata=SECTION)
    """Validation images."""

    # issue 45: TREAD token routing (item 2)
    token_routing: str = field(default="", metadata=added(TRAINED))
    """TREAD: during training, a random share of the image tokens skips a span of transformer blocks and rejoins
    after it, written ``RATIO:FIRST-LAST`` (``0.5:2-8``: half the image tokens skip blocks 2 to 8, counted from 0
    over the double-stream blocks and then the single-stream ones). The other tokens go through the span, so its
    LoRA targets still train; eval loss and renders run the whole model. Fewer tokens through the span make a
    cheaper step (``benchmarks/bench_tread.py``). Empty: off. Not with ``train.compile`` or a sharded base
    (``train.workers.base_fsdp: node``)."""


def worker_range(num_workers: Any) -> tuple[int, int]:
    """Normalise ``train.workers.num_workers`` (int or [min, max]) to a (min, max) pair."""
    if isinstance(num_workers, bool):
        raise ConfigError("train.workers.num_workers must be an integer or [min, max]")
    if isinstance(num_workers, int):
        lo = hi = num_workers
    elif (
        isinstance(num_workers, (list, tuple))
        and len(num_workers) == 2
        and all(isinstance(n, int) and not isinstance(n, bool) for n in num_workers)
    ):
        lo, hi = num_workers
    else:
        raise ConfigError(f"train.workers.num_workers must be an integer or [min, max], got {num_workers!r}")
    if lo < 1 or hi < lo:
        raise ConfigError(f"train.workers.num_workers needs 1 <= min <= max, got {num_workers!r}")
    return lo, hi


def checkpointing_setting(value):
    """Normalise ``train.gradient_checkpointing`` (``auto``, a bool, or its text from ``--set``)."""
    if isinstance(value, bool) or value == "auto":
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"train.gradient_checkpointing must be auto, true or false; got {value!r}")
