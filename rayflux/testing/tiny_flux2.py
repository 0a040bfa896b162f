"""Tiny FLUX.2 models ([klein] with a Qwen3 text encoder, [dev] with Mistral3), built locally from seeded weights.

Like :mod:`rayflux.testing.tiny`, nothing is downloaded: the tokenizers are byte-level BPEs trained in memory on the
demo captions, each with a chat template of the real model's shape, and the result is an ordinary diffusers
directory that ``Flux2KleinPipeline`` / ``Flux2Pipeline.from_pretrained`` load exactly as they load the real models.

The text encoders are narrow but deep: the pipelines stack hidden states 9/18/27 (Qwen3) and 10/20/30 (Mistral) by
default, so the tiny encoders have more layers than the highest index and every code path keeps the real defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rayflux.testing.tiny import TINY_SEED, bpe_vocab_merges, default_home, ensure_pipeline_dir, train_bpe

# Bumped whenever a tiny FLUX.2 config changes, so an old directory is rebuilt rather than silently reused.
TINY_FLUX2_VERSION = "2"

# Qwen3's chat template reduced to what FLUX.2 [klein] uses: user turns, the assistant header and, with thinking
# off, the empty think block the real template inserts.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# Mistral Small 3.1's layout: bos, the system prompt in [SYSTEM_PROMPT] tags, user text in [INST] tags. Message
# content is a list of typed parts (FLUX.2 [dev] passes ``[{"type": "text", "text": ...}]``).
MISTRAL3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- set text = message['content'] if message['content'] is string else "
    "message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}"
    "{%- endfor %}"
)


@dataclass(frozen=True)
class TinyFlux2Spec:
    """Sizes of a tiny FLUX.2 model. The defaults keep each directory around a megabyte."""

    latent_channels: int = 4
    """VAE latent channels; the transformer's input is 4x this after the 2x2 patchify (real FLUX.2: 32 -> 128)."""
    text_dim: int = 16
    """Text encoder hidden size; the transformer's joint_attention_dim is 3x this (three stacked layers)."""
    text_layers: int = 0
    """Text encoder depth; 0 takes one more than the pipeline's highest default layer (Qwen3: 28, Mistral: 31)."""
    distilled: bool = False
    """[klein] only: a step-distilled model like FLUX.2-klein-4B (``model_index.json`` says ``is_distilled: true``;
    renders in 4 steps without guidance); False is [klein] base like FLUX.2-klein-base-4B, whose
    ``model_index.json`` has no ``is_distilled`` (the pipeline's default, False: classifier-free guidance)."""


def _flux2_transformer(spec: TinyFlux2Spec, guidance_embeds: bool):
    from diffusers import Flux2Transformer2DModel

    # One block of each kind, two heads of 16: the four rotary axes (t, h, w, l) take 4 dims each.
    return Flux2Transformer2DModel(
        in_channels=4 * spec.latent_channels,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=3 * spec.text_dim,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )


def _flux2_vae(spec: TinyFlux2Spec):
    import torch
    from diffusers import AutoencoderKLFlux2

    # Four down blocks give vae_scale_factor 8, as in FLUX.2, so bucket math is the real one.
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=spec.latent_channels,
        norm_num_groups=4,
        sample_size=64,
    )
    # A fresh BatchNorm holds mean 0 / var 1, which would make the latent normalisation an identity and hide any
    # mistake in it; give the running statistics seeded values of a trained VAE's kind instead.
    channels = vae.bn.running_mean.numel()
    vae.bn.running_mean.copy_(0.5 * torch.randn(channels))
    vae.bn.running_var.copy_(0.5 + torch.rand(channels))
    return vae


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")


def _assemble(pipeline_cls, spec: TinyFlux2Spec, text_encoder, tokenizer, guidance_embeds: bool, **extra):
    # Built after the text encoder, under the same seed: VAE, then transformer.
    vae = _flux2_vae(spec)
    transformer = _flux2_transformer(spec, guidance_embeds)
    return pipeline_cls(
        scheduler=_scheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        **extra,
    )


def _llm_sizes(spec: TinyFlux2Spec, tok, default_layers: int) -> dict:
    """Config fields both tiny LLMs share: narrow, deep enough for the pipeline's layers, the tokenizer's ids."""
    return dict(
        vocab_size=len(tok),
        hidden_size=spec.text_dim,
        intermediate_size=2 * spec.text_dim,
        num_hidden_layers=spec.text_layers or default_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=512,
        pad_token_id=tok.pad_token_id,
    )


def qwen3_tokenizer():
    """A Qwen2-class byte-level BPE tokenizer with Qwen3's special tokens and chat template."""
    from transformers import Qwen2TokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    vocab, merges = bpe_vocab_merges(train_bpe(specials))
    tok = Qwen2TokenizerFast(vocab=vocab, merges=merges, model_max_length=512)
    tok.add_special_tokens({"additional_special_tokens": specials[1:]})
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


def mistral3_tokenizer():
    """A byte-level BPE tokenizer with Mistral Small 3.1's special tokens and chat layout.

    The real FLUX.2 [dev] ships a ``PixtralProcessor`` here, which ``transformers`` refuses to build without
    torchvision; the text path the pipeline uses (``apply_chat_template`` on text-only messages) is the tokenizer's
    own, so the tiny model stores the tokenizer alone and runs the same code.
    """
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
    image_tokens = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(specials + image_tokens),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=512,
    )
    tok.add_special_tokens({"additional_special_tokens": specials[4:] + image_tokens})
    tok.chat_template = MISTRAL3_CHAT_TEMPLATE
    return tok


def build_klein(spec: TinyFlux2Spec = TinyFlux2Spec()):
    """Build the tiny ``Flux2KleinPipeline`` (Qwen3 text encoder, no guidance embedding) from a fixed seed."""
    import torch
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = qwen3_tokenizer()
    torch.manual_seed(TINY_SEED)
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            **_llm_sizes(spec, tok, 28), tie_word_embeddings=True, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>")
        )
    )
    pipe = _assemble(Flux2KleinPipeline, spec, text_encoder, tok, guidance_embeds=False, is_distilled=spec.distilled)
    if not spec.distilled:
        # The released base checkpoints' model_index.json names no is_distilled; the constructor registered False.
        from diffusers.configuration_utils import FrozenDict

        pipe._internal_dict = FrozenDict({k: v for k, v in pipe.config.items() if k != "is_distilled"})
    return pipe


def build_dev(spec: TinyFlux2Spec = TinyFlux2Spec()):
    """Build the tiny ``Flux2Pipeline`` ([dev]: Mistral3 text encoder, guidance embedding) from a fixed seed."""
    import torch
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, MistralConfig, PixtralVisionConfig

    tok = mistral3_tokenizer()
    torch.manual_seed(TINY_SEED)
    text = MistralConfig(**_llm_sizes(spec, tok, 31), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = PixtralVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=16
    )
    text_encoder = Mistral3ForConditionalGeneration(
        Mistral3Config(
            text_config=text,
            vision_config=vision,
            image_token_index=tok.convert_tokens_to_ids("[IMG]"),
            spatial_merge_size=1,
        )
    )
    return _assemble(Flux2Pipeline, spec, text_encoder, tok, guidance_embeds=True)


def _info(variant: str, spec: TinyFlux2Spec) -> dict:
    return {"family": f"flux2-{variant}", "version": TINY_FLUX2_VERSION, "seed": TINY_SEED, "spec": spec.__dict__}


def ensure_tiny_flux2_klein(path: str | Path | None = None, spec: TinyFlux2Spec = TinyFlux2Spec()) -> Path:
    """Return a directory holding the current tiny FLUX.2 [klein] (base unless ``spec.distilled``), building it once
    if it is missing or stale."""
    name = "klein" if spec.distilled else "klein-base"  # a default directory per kind: neither replaces the other
    path = Path(path) if path else default_home() / f"tiny-flux2-{name}-v{TINY_FLUX2_VERSION}"
    return ensure_pipeline_dir(path, lambda: build_klein(spec), _info("klein", spec))


def ensure_tiny_flux2_dev(path: str | Path | None = None, spec: TinyFlux2Spec = TinyFlux2Spec()) -> Path:
    """Return a directory holding the current tiny FLUX.2 [dev], building it once if it is missing or stale."""
    path = Path(path) if path else default_home() / f"tiny-flux2-dev-v{TINY_FLUX2_VERSION}"
    return ensure_pipeline_dir(path, lambda: build_dev(spec), _info("dev", spec))
