"""A tiny vision-language captioner: a LLaVA-shaped model from seeded random weights and a locally trained tokenizer.

Like the tiny FLUX models (:mod:`rayflux.testing.tiny`), nothing is downloaded: the tokenizer is a byte-level BPE
trained in memory on the demo captions' corpus, the weights come from a fixed seed, and the directory is an ordinary
``transformers`` one that ``AutoModelForImageTextToText`` and ``AutoProcessor`` load offline, so the caption stage
runs the same loading and generation code on it as on Qwen2.5-VL or JoyCaption. Its captions are random words of the
corpus, but greedy decoding makes them the same on every run.
"""

from __future__ import annotations

from pathlib import Path

from rayflux.testing.tiny import TINY_SEED, default_home, ensure_pipeline_dir, train_bpe

TINY_VLM_VERSION = "1"
IMAGE_TOKEN = "<image>"
EOS_TOKEN = "<|endoftext|>"
_SIZE = 32  # image side the vision tower sees
_PATCH = 8
_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


class TinyVlm:
    """The tiny model and its processor, saved together as one ``transformers`` directory."""

    def __init__(self, model, processor):
        self.model, self.processor = model, processor

    def save_pretrained(self, path) -> None:
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)


def _processor():
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    bpe = train_bpe([EOS_TOKEN, IMAGE_TOKEN])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, padding_side="left"
    )
    images = CLIPImageProcessor(
        size={"shortest_edge": _SIZE}, crop_size={"height": _SIZE, "width": _SIZE}, do_center_crop=True
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=_PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token, which the "default" strategy drops
        chat_template=_CHAT_TEMPLATE,
    )


def build_tiny_vlm() -> TinyVlm:
    """Build the tiny captioner in memory from a fixed seed."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    processor = _processor()
    tok = processor.tokenizer
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=_SIZE,
        patch_size=_PATCH,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.eos_token_id,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    torch.manual_seed(TINY_SEED)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return TinyVlm(model, processor)


def ensure_tiny_vlm(path: str | Path | None = None) -> Path:
    """Return a directory holding the current tiny captioner, building it once if it is missing or stale."""
    path = Path(path) if path else default_home() / f"tiny-vlm-v{TINY_VLM_VERSION}"
    info = {"family": "vlm", "version": TINY_VLM_VERSION, "seed": TINY_SEED}
    return ensure_pipeline_dir(path, build_tiny_vlm, info)
