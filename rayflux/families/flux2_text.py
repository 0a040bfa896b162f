"""FLUX.2 caption encoding as small functions: chat-template prompts, tokens, and stacked hidden states.

FLUX.2 conditions on no pooled vector and no dedicated text encoder output: each caption goes through a chat
template, then an LLM, and the embedding is the hidden states of three of its layers side by side
(``[L, 3 * hidden]``). [klein] uses Qwen3 (layers 9/18/27, a user turn with thinking off); [dev] uses Mistral Small
3.1 (layers 10/20/30, FLUX.2's system prompt, then the user turn). Every caption is padded to the same length and
the padding is kept, as the pipelines keep it (the attention mask is used inside the encoder only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

QWEN3_LAYERS = (9, 18, 27)
"""Hidden-state indices FLUX.2 [klein] stacks (``Flux2KleinPipeline``'s ``text_encoder_out_layers``)."""
MISTRAL3_LAYERS = (10, 20, 30)
"""Hidden-state indices FLUX.2 [dev] stacks (``Flux2Pipeline``'s ``text_encoder_out_layers``)."""


def mistral3_system_message() -> str:
    """FLUX.2 [dev]'s system prompt, as diffusers ships it."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

    return SYSTEM_MESSAGE


def qwen3_prompt(tokenizer, caption: str) -> str:
    """The text a Qwen3 tokenizer's chat template makes of one caption: a user turn, then the assistant's header
    with thinking turned off (the empty think block)."""
    messages = [{"role": "user", "content": caption}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)


def mistral3_messages(captions: Sequence[str], system_message: str | None = None) -> list[list[dict]]:
    """One conversation per caption: FLUX.2's system prompt, then the caption as a text-only user turn.

    ``[IMG]`` is removed from captions: it is the image placeholder token, and a caption holding it would make the
    processor look for an image that is not there."""
    system = mistral3_system_message() if system_message is None else system_message
    return [
        [
            {"role": "system", "content": [{"type": "text", "text": system}]},
            {"role": "user", "content": [{"type": "text", "text": c.replace("[IMG]", "")}]},
        ]
        for c in captions
    ]


def qwen3_tokens(tokenizer, captions: Sequence[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, each ``[B, max_length]``: the chat prompts padded and truncated to
    ``max_length``."""
    texts = [qwen3_prompt(tokenizer, c) for c in captions]
    enc = tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True, max_length=max_length)
    return enc["input_ids"], enc["attention_mask"]


def mistral3_tokens(
    tokenizer, captions: Sequence[str], max_length: int, system_message: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, each ``[B, max_length]``, of the conversations of :func:`mistral3_messages`
    (``tokenizer`` is the model's processor or its tokenizer: both apply the same chat template)."""
    enc = tokenizer.apply_chat_template(
        mistral3_messages(captions, system_message),
        add_generation_prompt=False,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        padding="max_length",
        truncation=True,
        max_length=max_length,
    )
    return enc["input_ids"], enc["attention_mask"]


def stack_hidden_states(hidden_states: Sequence[torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """``[B, L, len(layers) * D]``: the chosen ``[B, L, D]`` hidden states side by side, layer by layer."""
    return torch.cat([hidden_states[k] for k in layers], dim=-1)


def encode_text(text_encoder, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int]):
    """Run the LLM once over a batch of tokens and return its FLUX.2 prompt embeddings ``[B, L, 3 * D]`` in the
    encoder's dtype. ``text_encoder`` needs more than ``max(layers)`` layers."""
    out = text_encoder(
        input_ids=input_ids.to(text_encoder.device),
        attention_mask=attention_mask.to(text_encoder.device),
        output_hidden_states=True,
        use_cache=False,
    )
    if len(out.hidden_states) <= max(layers):
        raise ValueError(f"the text encoder has {len(out.hidden_states) - 1} layers; FLUX.2 reads layer {max(layers)}")
    return stack_hidden_states(out.hidden_states, layers)
