"""The GPU memory of one training process: the frozen base for each ``train.base_dtype`` and
``train.workers.base_fsdp``, the LoRA with its ``train.optim.name`` state, and the activations with and without gradient
checkpointing.

``python -m rayflux plan`` prints these figures for a model's transformer config (:mod:`rayflux.plan`); every
training worker computes the same ones for its own run and turns ``train.gradient_checkpointing=auto`` on from them
(:func:`gradient_checkpointing`).

**The frozen base**, with the constants below:

- ``bf16``: the model dtype's bytes for every parameter (2; 4 for ``model.dtype=float32``).
- ``fp8`` (torchao's float8 training): the Linear weights stay in the model dtype. Each matmul casts its weight to
  fp8 (1 byte a parameter, ``FP8_CAST_BYTES``) with one fp32 tensorwise scale (``FP8_SCALE_BYTES``) for the length
  of that matmul, so the peak adds the largest Linear's fp8 copy and its scale. fp8 speeds the matmuls; it does not
  shrink the base.
- ``nf4`` (bitsandbytes): 4 bits a Linear weight plus one fp32 absmax per block of 64 weights (``NF4_BLOCK``, no
  double quantization): 0.5 + 4/64 = 0.5625 bytes (``NF4_BYTES``); biases and norms stay in the model dtype.
- ``base_sharding=node`` over W workers of a node: 1/W of the base, plus the blocks FSDP2 gathers whole while it
  computes: the running block and the prefetched next one (``GATHERED_BLOCKS`` x the largest block, model dtype).

**The LoRA** is held in fp32 with its fp32 gradient (8 bytes a parameter) and the ``train.optim.name``'s state
(``OPTIMIZER_STATE_BYTES``, counted from each package's ``step``): AdamW two fp32 moments (8); bitsandbytes' 8-bit
AdamW two 1-byte moments plus an fp32 absmax per block of 256 (about 2); Prodigy ``exp_avg``, ``exp_avg_sq``, ``s``
and ``p0`` (16, at its default ``slice_p=1``); schedule-free AdamW ``z`` and ``exp_avg_sq`` (8); Adafactor (no first
moment at its default ``beta1=None``) a row and a column of second moments per matrix, ``(r + n) x 4`` bytes for an
``r x n`` LoRA matrix: about ``4 / rank`` a parameter (the LoRA's matrices are rank wide on one side). An EMA
(``train.optim.ema_decay``) adds its fp32 copy (``EMA_BYTES``, 4).

**The activations** count, per token and per block, the tensors autograd keeps for the backward pass, in the autocast
dtype (bf16 on GPU). A block keeps ``a*h + b*m`` elements a token, with ``h`` the hidden width (heads x head dim),
``m`` the MLP width (``mlp_ratio`` x h) and ``(a, b)`` what the model's family declares for its double-stream and
single-stream blocks (:attr:`rayflux.families.Family.block_activations`, where each term is derived). With
checkpointing each block keeps only its input (h per token) and one block at a time is recomputed, so the peak is
(double + single blocks) x h plus the larger block's full set. Attention itself runs through SDPA's fused kernels,
which keep no L x L matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayflux import families

DTYPES = ("bf16", "fp8", "nf4")
SHARDINGS = ("none", "node")
NF4_BLOCK = 64
"""Weights per absmax block in bitsandbytes' 4-bit formats (its default blocksize)."""
NF4_BYTES = 0.5 + 4 / NF4_BLOCK
"""Bytes per NF4 Linear weight: half a byte of code plus its share of the block's fp32 absmax."""
FP8_CAST_BYTES = 1
"""Bytes per parameter of a weight's transient float8 (e4m3) copy."""
FP8_SCALE_BYTES = 4
"""One fp32 scale per cast tensor (tensorwise scaling)."""
GATHERED_BLOCKS = 2
"""Blocks an FSDP2-sharded base holds whole at once: the one computing and the one its prefetch gathers."""
PIXELS_PER_TOKEN = 16
"""VAE downscale (8) times the 2x2 latent packing: one image token per 16x16 pixels."""
GIB = 2**30
PARAM_GRAD_BYTES = 8
"""A LoRA parameter's fp32 weight and fp32 gradient."""
BNB_BLOCK = 256
"""Values per fp32 absmax block of bitsandbytes' 8-bit optimizer states."""
OPTIMIZER_STATE_BYTES = {
    "adamw": 8.0,
    "adamw8bit": 2 * (1 + 4 / BNB_BLOCK),
    "prodigy": 16.0,
    "schedulefree_adamw": 8.0,
}
"""Bytes of optimizer state per LoRA parameter (see the module docstring); Adafactor's depends on the rank."""
EMA_BYTES = 4
"""``train.optim.ema_decay``: the fp32 moving average of every trainable parameter, on every worker's device."""


def lora_bytes_per_param(optimizer: str = "adamw", rank: int = 4, ema: bool = False) -> float:
    """Bytes per trainable parameter: weight, gradient and the ``optimizer``'s state (LoRA ``rank`` for Adafactor),
    and the EMA's copy when ``ema``."""
    extra = EMA_BYTES if ema else 0
    if optimizer == "adafactor":
        return PARAM_GRAD_BYTES + 4 / max(rank, 1) + extra
    return PARAM_GRAD_BYTES + OPTIMIZER_STATE_BYTES[optimizer] + extra


@dataclass(frozen=True)
class BaseCounts:
    """Parameter counts of a frozen transformer that the options need (elements, not bytes)."""

    total: int
    """All parameters."""
    linear: int
    """Weights of its Linear layers: what fp8 casts and nf4 quantizes."""
    largest_linear: int = 0
    """The largest single Linear weight (fp8's transient copy)."""
    largest_block: int = 0
    """The largest transformer block (what FSDP2 gathers whole)."""


def weight_bytes(counts: BaseCounts, base_dtype: str, float_bytes: int = 2) -> float:
    """Peak bytes of the whole frozen base on one GPU for ``base_dtype`` (see the module docstring)."""
    if base_dtype == "nf4":
        return counts.linear * NF4_BYTES + (counts.total - counts.linear) * float_bytes
    stored = counts.total * float_bytes
    if base_dtype == "fp8":
        stored += counts.largest_linear * FP8_CAST_BYTES + FP8_SCALE_BYTES
    return stored


def per_gpu_weight_bytes(
    counts: BaseCounts, base_dtype: str, sharding: str, workers: int, float_bytes: int = 2
) -> float:
    """Bytes of the base on each GPU: whole, or sharded over the ``workers`` of a node (``sharding="node"``)."""
    whole = weight_bytes(counts, base_dtype, float_bytes)
    if sharding != "node" or workers <= 1:
        return whole
    return whole / workers + GATHERED_BLOCKS * counts.largest_block * float_bytes


def tokens(pixels: int, text: int) -> int:
    """Sequence length of a square ``pixels`` image: image tokens plus ``text`` tokens."""
    return (pixels // PIXELS_PER_TOKEN) ** 2 + text


def widths(tc: dict) -> tuple[int, int]:
    """(hidden width, MLP width) of transformer config ``tc``."""
    h = tc["num_attention_heads"] * tc["attention_head_dim"]
    return h, int(tc.get("mlp_ratio", families.of_transformer_config(tc).mlp_ratio) * h)


def per_token_elements(tc: dict, checkpointing: bool) -> int:
    """Activation elements kept per token for one sample, summed over all blocks (see the module docstring)."""
    h, m = widths(tc)
    (dh, dm), (sh, sm) = families.of_transformer_config(tc).block_activations
    double, single = dh * h + dm * m, sh * h + sm * m
    if checkpointing:
        return (tc["num_layers"] + tc["num_single_layers"]) * h + max(double, single)
    return tc["num_layers"] * double + tc["num_single_layers"] * single


@dataclass(frozen=True)
class Estimate:
    """Bytes of one training process's GPU memory."""

    weights: int
    """The frozen base on this GPU (:func:`per_gpu_weight_bytes`)."""
    lora_optimizer: int
    """The trainable LoRA parameters with their gradients and the optimizer's state."""
    activations: int
    """What autograd keeps for the backward pass of one optimizer micro-step."""

    @property
    def total(self) -> int:
        return self.weights + self.lora_optimizer + self.activations


def estimate(
    tc: dict,
    weight_bytes: int,
    trainable: int,
    pixels: int,
    batch: int,
    checkpointing: bool,
    *,
    activation_bytes: int = 2,
    text: int | None = None,
    optimizer: str = "adamw",
    rank: int = 4,
    ema: bool = False,
) -> Estimate:
    """Memory of one process: ``weight_bytes`` of frozen base on its GPU (:func:`per_gpu_weight_bytes`),
    ``trainable`` LoRA parameters of ``rank`` trained by ``optimizer`` (with an EMA when ``ema``:
    :func:`lora_bytes_per_param`), and ``text``
    text tokens per sample (None: the length the family pads to for this transformer config)."""
    if text is None:
        text = families.of_transformer_config(tc).text_length_of(tc)
    acts = batch * tokens(pixels, text) * per_token_elements(tc, checkpointing) * activation_bytes
    return Estimate(int(weight_bytes), int(trainable * lora_bytes_per_param(optimizer, rank, ema)), acts)


def gradient_checkpointing(setting, on_gpu: bool, pixels: int, need_without: int, device_bytes: int) -> bool:
    """``train.gradient_checkpointing``: True/False as set; ``auto`` turns it on for GPU runs at 768 px or more, or
    when the estimate without it exceeds 90% of the device's memory."""
    if setting != "auto":
        return bool(setting)
    return on_gpu and (pixels >= 768 or (device_bytes > 0 and need_without > 0.9 * device_bytes))


def run_estimates(
    cfg, tc: dict, weight_bytes: int, trainable: int, *, text: int, activation_bytes: int, device_bytes: int
) -> tuple[Estimate, Estimate, bool]:
    """A job's training process (``cfg``: its ``JobConfig``) on a ``device_bytes`` GPU (0: the CPU): the estimates
    without and with gradient checkpointing at its largest resolution and ``train.batch_size`` (times the graphs
    preservation holds), and whether ``train.gradient_checkpointing`` turns it on. The worker decides with it, and
    the driver weighs a GPU shared with the encoders with it (:mod:`rayflux.train.gpu_sharing`)."""
    from rayflux import datasets, preservation

    t = cfg.train
    pixels = max(ds.resolution for ds in datasets.datasets_of(cfg.data))
    batch = t.batch_size * preservation.graphs(t.flow.preservation)  # issue 45: preservation's second graph
    opt = {"text": text, "optimizer": t.optim.name, "rank": t.adapter.rank, "ema": bool(t.optim.ema_decay)}
    without, with_ = (
        estimate(tc, weight_bytes, trainable, pixels, batch, c, activation_bytes=activation_bytes, **opt)
        for c in (False, True)
    )
    on = gradient_checkpointing(t.gradient_checkpointing, device_bytes > 0, pixels, without.total, device_bytes)
    return without, with_, on
