"""FLUX.2 [dev] (``Flux2Pipeline``, Mistral Small 3.1) and [klein] (``Flux2KleinPipeline``, Qwen3).

- Latents: ``AutoencoderKLFlux2``'s 32 channels, patchified 2x2 into 128 and normalised by the VAE's batch-norm
  statistics; the cache stores them so, and the transformer packs them 1x1 (a token per latent cell).
- Text: the hidden states of three encoder layers stacked along the channels, through the encoder's chat template,
  padded to the pipeline's 512 tokens (``model.text_tokens`` when set: the encoders are causal and pad on the right,
  so the kept tokens embed as at 512); no pooled vector. One named tensor, ``prompt_embeds``.
- Ids: four axes (t, h, w, l), built with the pipeline's own helpers.
- Guidance: only when the transformer embeds it ([dev]); [klein] trains without. [klein] base (``model_index.json``
  without ``is_distilled``) renders with classifier-free guidance, step-distilled [klein] without
  (:meth:`Flux2.validation_settings`).

Prompt encoding is the pipeline's own ``encode_prompt``; patchify, normalisation, packing and ids are the pure
functions of :mod:`rayflux.families.flux2_math`, checked bitwise against the pipelines' helpers.
"""

from __future__ import annotations

import hashlib
import json

from rayflux.families.base import Family, ModelFacts, TextTensor, public_config
from rayflux.families.flux1 import DOUBLE_ATTENTION

# flux2_math and references import torch: imported where used, so reading facts on the driver needs no torch.

TEXT_LENGTH = 512
"""The pipelines' ``max_sequence_length`` default, and so the padded length of every cached caption."""

FLUX2_DEV = {
    "_class_name": "Flux2Transformer2DModel",
    "patch_size": 1,
    "in_channels": 128,
    "num_layers": 8,
    "num_single_layers": 48,
    "attention_head_dim": 128,
    "num_attention_heads": 48,
    "joint_attention_dim": 15360,
    "mlp_ratio": 3.0,
    "axes_dims_rope": [32, 32, 32, 32],
    "guidance_embeds": True,
}
"""FLUX.2 [dev] (about 32B parameters): diffusers' ``Flux2Transformer2DModel`` defaults."""
FLUX2_KLEIN_9B = {
    **FLUX2_DEV,
    "num_layers": 8,
    "num_single_layers": 24,
    "num_attention_heads": 32,
    "joint_attention_dim": 12288,
    "guidance_embeds": False,
}
"""FLUX.2 [klein] 9B (black-forest-labs/FLUX.2-klein-9B, subfolder ``transformer``)."""
FLUX2_KLEIN_4B = {
    **FLUX2_DEV,
    "num_layers": 5,
    "num_single_layers": 20,
    "num_attention_heads": 24,
    "joint_attention_dim": 7680,
    "guidance_embeds": False,
}
"""FLUX.2 [klein] 4B (black-forest-labs/FLUX.2-klein-4B, subfolder ``transformer``)."""

KLEIN_BASES = {"4B": "black-forest-labs/FLUX.2-klein-base-4B", "9B": "black-forest-labs/FLUX.2-klein-base-9B"}
"""The undistilled [klein] checkpoints Black Forest Labs publishes for fine-tuning, by size."""


def klein_base(transformer_config: dict) -> str:
    """The base checkpoint of a [klein] of this transformer config (its 4B or 9B shape), or both when neither."""
    shape = ("num_layers", "num_single_layers", "num_attention_heads")
    for size, config in (("4B", FLUX2_KLEIN_4B), ("9B", FLUX2_KLEIN_9B)):
        if all(transformer_config.get(k) == config[k] for k in shape):
            return KLEIN_BASES[size]
    return " or ".join(f"{v} ({k})" for k, v in KLEIN_BASES.items()) + ", the one of its size"


ATTENTION = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "attn.to_qkv_mlp_proj",
    "attn.to_out",
]
FFS = ["ff.linear_in", "ff.linear_out", "ff_context.linear_in", "ff_context.linear_out"]
CONTEXT = ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff_context.linear_in", "ff_context.linear_out"]
"""The text stream of the double blocks (the single blocks hold text and image in one fused projection)."""

DOUBLE = {
    **DOUBLE_ATTENTION,
    "ff.linear_in": ("img_mlp_0", None, 1),
    "ff.linear_out": ("img_mlp_2", None, 1),
    "ff_context.linear_in": ("txt_mlp_0", None, 1),
    "ff_context.linear_out": ("txt_mlp_2", None, 1),
}
# diffusers keeps the single blocks' fused projections fused, as the original code does.
SINGLE = {"attn.to_qkv_mlp_proj": ("linear1", None, 1), "attn.to_out": ("linear2", None, 1)}


class Flux2(Family):
    name = "flux2"
    pipelines = {"Flux2KleinPipeline": "FLUX.2 [klein]", "Flux2Pipeline": "FLUX.2 [dev]"}
    parts = (
        "transformer/config.json",
        "vae/config.json",
        "text_encoder/config.json",
        "tokenizer",
        "scheduler/scheduler_config.json",
    )
    config_parts = ("vae", "transformer", "text_encoder")
    encoder_parts = ("vae", "text_encoder")
    lora_presets = {
        "attention": ATTENTION,
        "attention+ffs": ATTENTION + FFS,
        "context": CONTEXT,
        "all": ATTENTION + FFS,
    }
    lora_blocks = ("transformer_blocks.", "single_transformer_blocks.")
    implementation = "https://github.com/black-forest-labs/flux2"
    transformer_class = "Flux2Transformer2DModel"
    base_model_version = "flux2"
    # kohya's FLUX.2 trainer (musubi-tuner) writes its LoRAs with this network module.
    network_module = "networks.lora_flux_2"
    max_references = None
    sigma_sampling = "flux2_shift"
    encoder_classes = {
        "transformers": ("Mistral3ForConditionalGeneration", "Qwen3ForCausalLM"),
        "diffusers": ("AutoencoderKLFlux2",),
    }
    built_in_configs = {
        "flux2-dev": (FLUX2_DEV, "FLUX.2 [dev]"),
        "flux2-klein-9b": (FLUX2_KLEIN_9B, "FLUX.2 [klein] 9B"),
        "flux2-klein-4b": (FLUX2_KLEIN_4B, "FLUX.2 [klein] 4B"),
    }
    mlp_ratio = 3.0
    block_activations = ((11, 3), (9, 4))
    """Per token, with h the hidden width and m the MLP width. The blocks are FLUX.1's (see
    :attr:`rayflux.families.flux1.Flux1.block_activations`) but for their MLP, a SwiGLU (``linear_in`` to 2m, gated
    down to m), and the single blocks' fused projection (q/k/v and the MLP's input in one Linear of 3h + 2m):

    - a double-stream block keeps 11h + 3m (the MLP keeps 2m + m instead of 2m);
    - a single-stream block keeps: the norm output (h), the fused projection (3h + 2m), q/k after norm and RoPE (2h),
      the attention output (h), the SwiGLU output (m), the concatenation (h + m) and the output projection (h):
      9h + 4m.
    """

    def text_length_of(self, transformer_config: dict) -> int:
        return TEXT_LENGTH

    # The single blocks run on the text and image tokens concatenated by the transformer's forward.
    routed_blocks = (("transformer_blocks", False), ("single_transformer_blocks", True))

    kohya_blocks = {
        "transformer_blocks.": (DOUBLE, "double_blocks"),
        "single_transformer_blocks.": (SINGLE, "single_blocks"),
    }

    def facts(self, configs, identity, text_tokens=0):
        vae, transformer, encoder = configs["vae"], configs["transformer"], configs["text_encoder"]
        guidance = bool(transformer.get("guidance_embeds", False))
        length = self.text_length(transformer, text_tokens)
        blob = {"vae": public_config(vae), "text_encoder": public_config(encoder), **identity, "text_length": length}
        arch = encoder.get("model_type", "")
        return ModelFacts(
            family=self.name,
            vae_scale_factor=2 ** (len(vae["block_out_channels"]) - 1) * 2,
            latent_channels=int(vae["latent_channels"]) * 4,
            pack=1,
            guidance_embeds=guidance,
            text_length=length,
            text=(TextTensor("prompt_embeds", ("prompt_len", "prompt_dim"), "prompt", length),),
            identity=hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16],
            architecture="flux-2-klein" if arch.startswith("qwen") else "flux-2-dev",
        )

    def _pipeline(self, path: str, kw: dict):
        from diffusers import Flux2KleinPipeline, Flux2Pipeline

        from rayflux.families.model_index import class_name

        return {"Flux2KleinPipeline": Flux2KleinPipeline, "Flux2Pipeline": Flux2Pipeline}[class_name(path, **kw)]

    def load_vae(self, path, kw, device, dtype):
        from diffusers import AutoencoderKLFlux2

        vae = AutoencoderKLFlux2.from_pretrained(path, torch_dtype=dtype, subfolder="vae", **kw)
        return vae.to(device).eval().requires_grad_(False)

    def load_text_encoders(self, path, kw, device, dtype):
        """The family's pipeline with its text encoder and tokenizer only: its ``encode_prompt`` is the encoding."""
        pipe = self._pipeline(path, kw).from_pretrained(path, transformer=None, vae=None, torch_dtype=dtype, **kw)
        pipe.text_encoder.eval().requires_grad_(False)
        return pipe.to(device)

    def load_transformer(self, path, kw, device, dtype):
        from diffusers import Flux2Transformer2DModel

        return Flux2Transformer2DModel.from_pretrained(path, torch_dtype=dtype, subfolder="transformer", **kw).to(
            device
        )

    def encode_text(self, encoders, captions, facts):
        import torch

        with torch.inference_mode():
            embeds, _ = encoders.encode_prompt(
                captions, device=encoders.text_encoder.device, max_sequence_length=facts.text_length
            )
        return {"prompt_embeds": embeds}

    def stored_latent(self, vae, z):
        """Patchify 2x2, then ``(z - bn.running_mean) / sqrt(bn.running_var + batch_norm_eps)``, as the pipelines'
        ``_encode_vae_image``."""
        from rayflux.families import flux2_math

        return flux2_math.normalize_latent(z, *flux2_math.vae_bn_stats(vae))

    def pack(self, latents):
        from rayflux.families import flux2_math

        return flux2_math.pack(latents)

    def unpack(self, tokens, height, width):
        from rayflux.families import flux2_math

        return flux2_math.unpack(tokens, height, width)

    def seq_len(self, height, width):
        return height * width

    def forward_args(self, tokens, text, sigmas, height, width, guidance, *, references=None):
        from rayflux.families import flux2_math
        from rayflux.families.references import with_references

        embeds = text["prompt_embeds"]
        b, device = tokens.shape[0], tokens.device
        # Batched ids, as the pipelines pass them.
        hidden, img_ids = tokens, flux2_math.latent_ids(height, width, device).expand(b, -1, -1)
        if references is not None:
            ref_tokens, ref_ids = flux2_math.cached_references(references)
            hidden, img_ids = with_references(tokens, img_ids, ref_tokens, ref_ids.expand(b, -1, -1))
        return {
            "hidden_states": hidden,
            "encoder_hidden_states": embeds,
            "timestep": sigmas.to(tokens.dtype),
            "img_ids": img_ids,
            "txt_ids": flux2_math.text_ids(embeds.shape[1], device).expand(b, -1, -1),
            "guidance": guidance,
        }

    def pipeline_class(self):
        from diffusers import Flux2KleinPipeline

        # Both FLUX.2 pipelines share Flux2LoraLoaderMixin: saving and reading LoRA files is the same.
        return Flux2KleinPipeline

    def prompt_embeddings(self, path, kw, prompts, facts, device, dtype):
        import torch

        pipe = self.load_text_encoders(path, kw, device, dtype)
        # [klein] base renders with classifier-free guidance against the empty prompt; the pipeline would encode it
        # itself, with the text encoder that the render no longer has.
        negative = getattr(pipe.config, "is_distilled", True) is False
        with torch.inference_mode():
            empty = (
                pipe.encode_prompt("", device=device, max_sequence_length=facts.text_length)[0] if negative else None
            )
            out = []
            for p in prompts:
                e = pipe.encode_prompt(p, device=device, max_sequence_length=facts.text_length)[0].clone()
                out.append({"prompt_embeds": e, **({"negative_prompt_embeds": empty.clone()} if negative else {})})
        return out

    def validation_settings(self, path, kw):
        """[klein] renders as its ``model_index.json`` says it was made: step-distilled ([klein] 4B/9B,
        ``is_distilled: true``) in 4 steps without guidance, base ([klein] base 4B/9B, no ``is_distilled``, which
        the pipeline reads as False) in 50 steps with classifier-free guidance 4, the pipeline's own defaults."""
        from rayflux.families.model_index import pipeline_config

        config = pipeline_config(path, kw.get("revision", ""))
        if config.get("_class_name") != "Flux2KleinPipeline":
            return super().validation_settings(path, kw)
        return (4, 1.0) if config.get("is_distilled", False) else (50, 4.0)

    def inference_steps(self, path, kw):
        """Step-distilled [klein] runs 4 steps; [klein] base and [dev] the pipelines' default 50."""
        from rayflux.families.model_index import pipeline_config

        return 4 if pipeline_config(path, kw.get("revision", "")).get("is_distilled", False) else 50

    def training_warning(self, path, pipeline, transformer_config):
        """A step-distilled [klein] (``is_distilled: true``) trains weak LoRAs: the warning names its base."""
        if pipeline.get("_class_name") != "Flux2KleinPipeline" or not pipeline.get("is_distilled", False):
            return ""
        return (
            f"model.path={path} is a step-distilled FLUX.2 [klein] (model_index.json: is_distilled: true). LoRAs "
            "trained on it come out weak (they need a strength of 1.5-2, render grey, or never lower the loss): its "
            "weights were distilled to sample in 4 steps, not to predict the flow at every noise level the training "
            "loss draws. Train on its "
            f"undistilled base, model.path={klein_base(transformer_config)}, and preview on this model with "
            f"train.validation.model={path} (4 steps, no guidance). model.allow_distilled=true silences this."
        )

    def reference_kwargs(self, images, height, width):
        return {"image": list(images)}

    def render_pipeline(self, path, kw, scheduler, vae, transformer):
        cls = self._pipeline(path, kw)
        return cls.from_pretrained(
            path, scheduler=scheduler, vae=vae, transformer=transformer, text_encoder=None, tokenizer=None, **kw
        )
