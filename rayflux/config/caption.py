"""The ``caption`` section: the vision-language model that captions images before the cache stage.

Used when a dataset has ``caption_strategy=vlm`` (every image) or ``missing_caption=vlm`` (the images without a
caption of their own). Every field is :func:`~rayflux.config.identity.added`: while it holds its default it enters no
hash, so configs written before captioning existed keep their cache keys and run identities.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayflux.config.identity import CAPTIONS, UNTRACKED, added
from rayflux.config.values import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class CaptionConfig:
    """The captioner: a ``transformers`` image-text-to-text model run by a Ray Data actor pool."""

    model: str = field(default="", metadata=added(CAPTIONS))
    """A ``transformers`` model directory or hub id that ``AutoModelForImageTextToText`` and ``AutoProcessor`` load
    (Qwen2.5-VL, Qwen3-VL, LLaVA-style JoyCaption...). Empty: the tiny random captioner (tests and the demo only:
    its captions are noise)."""
    prompt: str = field(default="Describe this image in one detailed sentence.", metadata=added(CAPTIONS))
    """The instruction the model gets beside each image, through its processor's chat template."""
    max_new_tokens: int = field(default=128, metadata=added(CAPTIONS))
    """Most tokens generated per caption. Generation is greedy, so a caption is the same on every run."""
    dtype: str = field(default="auto", metadata=added(CAPTIONS))
    """Weight dtype of the captioner: ``auto`` (bf16 on a GPU, fp32 on CPU), ``float32``, ``bfloat16`` or
    ``float16``. Part of the captioner's identity: another dtype may word a caption differently."""
    prefix: str = field(default="", metadata=added(CAPTIONS))
    """Put this and a space in front of every VLM caption when the cache reads it (e.g. a trigger word). Applied at
    read time: changing it captions nothing again."""
    batch_size: int = field(default=8, metadata=added(UNTRACKED))
    """Images per generate call in a captioner actor."""
    actors: int = field(default=0, metadata=added(UNTRACKED))
    """Captioner actors: a number, or 0 for one per ``gpus_per_actor`` share of the cluster's GPUs (one on a CPU-only
    cluster). A request that cannot fit fails before the stage starts."""
    gpus_per_actor: float = field(default=1.0, metadata=added(UNTRACKED))
    """GPUs each captioner actor holds when captioning runs on GPUs (a 7B VLM in bf16 needs about 16 GB; 0.5 runs two
    actors per 80 GB card); above 1, a whole number."""
    accelerator_type: str = field(default="", metadata=added(UNTRACKED))
    """GPU type each captioner actor needs (e.g. ``L4``), so captioning runs on cheaper nodes. Empty: any GPU (or the
    CPUs on a cluster without GPUs)."""
    cpus_per_actor: float = field(default=1.0, metadata=added(UNTRACKED))
    """CPUs each captioner actor reserves; on a CPU-only cluster torch runs that many threads."""


def check_caption(c: CaptionConfig) -> None:
    """Range and choice checks of the ``caption`` section; raise ConfigError naming the key."""
    if c.dtype not in DTYPES:
        raise ConfigError(f"caption.dtype must be one of {', '.join(DTYPES)}; got {c.dtype!r}")
    for key in ("max_new_tokens", "batch_size", "cpus_per_actor"):
        if getattr(c, key) <= 0:
            raise ConfigError(f"caption.{key} must be positive, got {getattr(c, key)}")
    if c.actors < 0:
        raise ConfigError(f"caption.actors must be >= 0 (0: auto), got {c.actors}")
    if c.gpus_per_actor <= 0 or (c.gpus_per_actor > 1 and c.gpus_per_actor != int(c.gpus_per_actor)):
        raise ConfigError(
            f"caption.gpus_per_actor must be a fraction of one GPU or a whole number of them, got {c.gpus_per_actor}"
        )
    if not c.prompt.strip():
        raise ConfigError("caption.prompt is empty: the captioner needs an instruction")
