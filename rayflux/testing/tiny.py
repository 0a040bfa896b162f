"""A tiny FLUX-shaped model and demo images, built locally from seeded random weights.

Nothing here downloads anything: the tokenizers are trained in memory on a small corpus, every weight is drawn from a
fixed seed, and the result is written as an ordinary diffusers-format directory. The job then loads it through the
same ``from_pretrained`` path as real FLUX.1-dev, so the demo and the tests exercise the production code.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

TINY_SEED = 1234
# Bumped whenever the tiny configs change, so an old directory is rebuilt rather than silently reused.
TINY_VERSION = "3"
_MARKER = "rayflux_tiny.json"

# Words the demo captions are made of; the tokenizers are trained on these plus a little filler text.
_COLOURS = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
_SHAPES = ["circle", "square", "triangle", "stripe", "ring", "cross"]
_CORPUS_EXTRA = (
    "a photo of an image with the on in at and sks dog cat style painting picture of a small large "
    "bright dark background foreground pattern drawing illustration rayflux flux lora"
)


def default_home() -> Path:
    """Where generated demo assets live: ``$RAYFLUX_HOME`` or ``~/.cache/rayflux``."""
    return Path(os.environ.get("RAYFLUX_HOME", Path.home() / ".cache" / "rayflux")).expanduser()


def caption_corpus() -> list[str]:
    """The small text corpus every tiny tokenizer is trained on: the demo captions' words plus filler."""
    lines = [f"a {c} {s} on a {b} background" for c in _COLOURS for s in _SHAPES for b in _COLOURS]
    lines.append(_CORPUS_EXTRA)
    return lines


def train_bpe(special_tokens: list[str], end_of_word_suffix: str | None = None, vocab_size: int = 400):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on :func:`caption_corpus`. ``end_of_word_suffix`` is
    CLIP's ``</w>``; GPT-style tokenizers (Qwen, Mistral) use none."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    suffix = {"end_of_word_suffix": end_of_word_suffix} if end_of_word_suffix else {}
    bpe = Tokenizer(models.BPE(**suffix))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
        **suffix,
    )
    bpe.train_from_iterator(caption_corpus(), trainer)
    return bpe


def bpe_vocab_merges(bpe) -> tuple[dict, list[tuple[str, str]]]:
    """``(vocab, merges)`` of a trained BPE, as the ``transformers`` tokenizer constructors take them."""
    state = json.loads(bpe.to_str())
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["model"]["merges"]]
    return state["model"]["vocab"], merges


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    vocab, merges = bpe_vocab_merges(train_bpe(["<|startoftext|>", "<|endoftext|>"], end_of_word_suffix="</w>"))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)


def _t5_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5TokenizerFast

    uni = Tokenizer(models.Unigram())
    uni.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=200, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False
    )
    uni.train_from_iterator(caption_corpus(), trainer)
    vocab = [(piece, score) for piece, score in json.loads(uni.to_str())["model"]["vocab"]]
    return T5TokenizerFast(vocab=vocab, extra_ids=0, model_max_length=512)


@dataclass(frozen=True)
class TinySpec:
    """Sizes of the tiny model. The defaults keep the whole directory around a megabyte."""

    latent_channels: int = 4
    """VAE latent channels; the transformer's input is 4x this after 2x2 packing."""
    text_dim: int = 32
    """Hidden size of both text encoders (joint_attention_dim and pooled_projection_dim)."""
    t5_layers: int = 2
    """T5 encoder depth. Raise it to make the text encoders heavier than the transformer (memory tests)."""
    t5_ff: int = 37
    """T5 feed-forward width; raise it with ``t5_layers`` for a heavier text encoder."""
    t5_extra_mb: int = 0
    """Pad T5's embedding table with this many MiB of unused rows: a text encoder heavy in memory but not in
    compute, so memory tests can tell "never loaded" from "loaded and freed" at a glance."""
    guidance_embeds: bool = True
    """Like FLUX.1-dev (guidance-distilled); False behaves like schnell."""
    flux_vae: bool = False
    """Use FLUX.1's real VAE architecture (16 latent channels, 128-512 wide blocks; random weights) for benchmarks."""
    num_layers: int = 1
    """Double-stream transformer blocks."""
    num_single_layers: int = 1
    """Single-stream transformer blocks."""
    attention_head_dim: int = 16
    """Transformer head width; its sum of ``axes_dims_rope`` must equal it."""
    num_attention_heads: int = 2
    """Transformer heads."""
    dtype: str = "float32"
    """Weight dtype the pipeline is built and written in (a ``torch`` dtype name). ``bfloat16`` halves the memory,
    time and disk a model at real widths needs (FLUX.1-dev's transformer: 24 GB instead of 48)."""


def build_pipeline(spec: TinySpec = TinySpec()):
    """Build the tiny ``FluxPipeline`` in memory from a fixed seed, in ``spec.dtype``."""
    import torch

    previous = torch.get_default_dtype()
    # Built straight in the target dtype: a real-width transformer never exists in fp32 on the way there.
    torch.set_default_dtype(getattr(torch, spec.dtype))
    try:
        return _build_pipeline(spec)
    finally:
        torch.set_default_dtype(previous)


def _build_pipeline(spec: TinySpec):
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    clip_tok = _clip_tokenizer()
    t5_tok = _t5_tokenizer()
    torch.manual_seed(TINY_SEED)
    latent_channels = 16 if spec.flux_vae else spec.latent_channels
    # Built in this order from one seed: the order decides every weight.
    transformer = _transformer(spec, latent_channels)
    clip = _clip(spec, clip_tok)
    t5 = _t5(spec, t5_tok)
    vae = _vae(spec, latent_channels)
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15, use_dynamic_shifting=True
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=clip_tok,
        text_encoder_2=t5,
        tokenizer_2=t5_tok,
        transformer=transformer,
    )


def _transformer(spec: TinySpec, latent_channels: int):
    from diffusers import FluxTransformer2DModel

    quarter = spec.attention_head_dim // 4
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * latent_channels,
        num_layers=spec.num_layers,
        num_single_layers=spec.num_single_layers,
        attention_head_dim=spec.attention_head_dim,
        num_attention_heads=spec.num_attention_heads,
        joint_attention_dim=spec.text_dim,
        pooled_projection_dim=spec.text_dim,
        guidance_embeds=spec.guidance_embeds,
        # (¼, ¼, ½) of the head's rotary dims for (text, row, column): not FLUX's 16/56/56 of 128, and at 16 dims the
        # rows get one usable frequency. Kept: the golden losses pin these models. The world base can take FLUX's
        # split (rayflux.quality.pretrain.rope_axes).
        axes_dims_rope=(quarter, quarter, spec.attention_head_dim - 2 * quarter),
    )


def _clip(spec: TinySpec, clip_tok):
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(clip_tok),
            hidden_size=spec.text_dim,
            intermediate_size=37,
            num_hidden_layers=5,
            num_attention_heads=4,
            projection_dim=spec.text_dim,
            max_position_embeddings=77,
            bos_token_id=clip_tok.bos_token_id,
            eos_token_id=clip_tok.eos_token_id,
            pad_token_id=clip_tok.pad_token_id,
        )
    )


def _t5(spec: TinySpec, t5_tok):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=len(t5_tok) + spec.t5_extra_mb * 2**20 // (4 * spec.text_dim),
            d_model=spec.text_dim,
            d_kv=8,
            d_ff=spec.t5_ff,
            num_layers=spec.t5_layers,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=t5_tok.pad_token_id,
            eos_token_id=t5_tok.eos_token_id,
            decoder_start_token_id=t5_tok.pad_token_id,
        )
    )


def _vae(spec: TinySpec, latent_channels: int):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512) if spec.flux_vae else (8, 8, 16, 16),
        layers_per_block=2 if spec.flux_vae else 1,
        latent_channels=latent_channels,
        norm_num_groups=32 if spec.flux_vae else 4,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def write_pipeline_dir(path: str | Path, build: Callable[[], Any], info: dict) -> Path:
    """Write ``build()``'s pipeline as a diffusers directory at ``path`` with ``info`` as its marker, atomically
    (temp dir, then rename). Shared by every tiny model family so each is written and recognised the same way."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=path.parent))
    try:
        build().save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps(info))
        try:
            os.rename(tmp, path)
        except OSError:
            # Another process won the race and wrote the same seeded model; keep theirs.
            if not _is_current(path, info):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _is_current(path: Path, info: dict) -> bool:
    marker = path / _MARKER
    if not marker.is_file():
        return False
    return json.loads(marker.read_text()) == info


def ensure_pipeline_dir(path: Path, build: Callable[[], Any], info: dict) -> Path:
    """Return ``path`` holding the pipeline ``build()`` makes, building it once if it is missing or its marker
    differs from ``info`` (an older version or other sizes).

    Every node that needs it can call this: the weights come from a fixed seed, so independent builds agree.
    """
    if _is_current(path, info):
        return path
    if path.exists():
        # Only a directory this module wrote (it carries the marker) is ever replaced.
        if not (path / _MARKER).is_file():
            raise FileExistsError(f"{path} exists and is not a rayflux tiny model; refusing to overwrite it")
        shutil.rmtree(path)
    return write_pipeline_dir(path, build, info)


def _info(spec: TinySpec) -> dict:
    fields = dict(spec.__dict__)
    if fields["dtype"] == "float32":
        # The marker of an fp32 model stays as it was before ``dtype`` existed, so directories already written (and
        # shared by every checkout on a machine) stay current instead of being rebuilt by one and then the other.
        del fields["dtype"]
    return {"version": TINY_VERSION, "seed": TINY_SEED, "spec": fields}


def write_tiny_model(path: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Write the tiny model as a diffusers directory at ``path`` (atomically: temp dir, then rename)."""
    return write_pipeline_dir(path, lambda: build_pipeline(spec), _info(spec))


def ensure_tiny_model(path: str | Path | None = None, spec: TinySpec = TinySpec()) -> Path:
    """Return a directory holding the current tiny model, building it once if it is missing or stale."""
    path = Path(path) if path else default_home() / f"tiny-flux-v{TINY_VERSION}"
    return ensure_pipeline_dir(path, lambda: build_pipeline(spec), _info(spec))
