"""The ``model`` section: which model to fine-tune, and in which dtypes."""

from __future__ import annotations

from dataclasses import dataclass, field

from rayflux.config.identity import TRAINED, UNTRACKED, added


@dataclass
class ModelConfig:
    """Which FLUX model to fine-tune."""

    path: str = field(default="", metadata=TRAINED)
    """A diffusers-format directory or hub id (e.g. black-forest-labs/FLUX.1-dev). Empty: the embedded tiny model."""
    revision: str = field(default="", metadata=TRAINED)
    """Hub revision, when ``path`` is a hub id."""
    dtype: str = field(default="auto", metadata=TRAINED)
    """Weight dtype for the frozen parts: ``auto`` (bf16 on GPU, fp32 on CPU), ``bfloat16`` or ``float32``. Not
    ``float16``: FLUX's transformer and T5 overflow in it."""
    vae_dtype: str = field(default="", metadata=TRAINED)
    """The VAE's dtype in the cache stage, when it should differ from ``dtype`` (``float16`` is allowed here). With
    both left at their defaults the VAE encodes in bf16 on GPUs and on CPUs that compute bf16 natively (AVX512-BF16,
    AMX: twice as fast as fp32 there), else in fp32; ``float32`` keeps it in fp32 everywhere."""
    text_tokens: int = field(default=0, metadata=TRAINED)
    """Text tokens the encoders keep per caption; 0: the family's default (FLUX.1: T5's 512 for [dev], 256 for
    [schnell]; FLUX.2: 512). Fewer make smaller text caches and shorter steps; prompts longer than this are cut.
    Part of the cache key; validation renders encode their prompts to the same length."""

    # issue 45: FLUX.2 [klein] right by default (item 5)
    allow_distilled: bool = field(default=False, metadata=added(UNTRACKED))
    """Train on a step-distilled FLUX.2 [klein] (``is_distilled: true``) without the warning that names its base
    checkpoint."""
