"""FLUX.1 [dev] and [schnell] (``FluxPipeline``): CLIP-L pooled + T5-XXL text, 16-channel shift/scale latents packed
2x2, 3-axis ids, guidance embedded by [dev].

T5 runs without an attention mask in ``FluxPipeline``, so padded positions are part of the embedding and are kept at
the model's full ``max_sequence_length`` (512 for [dev], 256 for the distilled [schnell]; ``model.text_tokens`` when
set, and then every kept position's embedding differs a little from the full length's).
"""

from __future__ import annotations

import hashlib
import json

from rayflux.families.base import Family, ModelFacts, TextTensor, public_config

# The tensor helpers (kontext_math, references, train.flow) import torch, so they are imported where they are used:
# the driver reads a model's facts through this module and, for the cache stage, never needs torch (seconds of start).

CLIP_LENGTH = 77

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
FFS = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp", "proj_out"]
# The text stream of the double blocks: its attention projections and its feed-forward (SimpleTuner's "context").
CONTEXT = ["add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff_context.net.0.proj", "ff_context.net.2"]

# diffusers module inside a block -> (kohya name, part, parts); part is None for an unfused layer. FLUX.2's double
# blocks name their attention the same way.
DOUBLE_ATTENTION = {
    "attn.to_q": ("img_attn_qkv", 0, 3),
    "attn.to_k": ("img_attn_qkv", 1, 3),
    "attn.to_v": ("img_attn_qkv", 2, 3),
    "attn.to_out.0": ("img_attn_proj", None, 1),
    "attn.add_q_proj": ("txt_attn_qkv", 0, 3),
    "attn.add_k_proj": ("txt_attn_qkv", 1, 3),
    "attn.add_v_proj": ("txt_attn_qkv", 2, 3),
    "attn.to_add_out": ("txt_attn_proj", None, 1),
}
DOUBLE = {
    **DOUBLE_ATTENTION,
    "ff.net.0.proj": ("img_mlp_0", None, 1),
    "ff.net.2": ("img_mlp_2", None, 1),
    "ff_context.net.0.proj": ("txt_mlp_0", None, 1),
    "ff_context.net.2": ("txt_mlp_2", None, 1),
    "norm1.linear": ("img_mod_lin", None, 1),
    "norm1_context.linear": ("txt_mod_lin", None, 1),
}
SINGLE = {
    "attn.to_q": ("linear1", 0, 4),
    "attn.to_k": ("linear1", 1, 4),
    "attn.to_v": ("linear1", 2, 4),
    "proj_mlp": ("linear1", 3, 4),
    "proj_out": ("linear2", None, 1),
    "norm.linear": ("modulation_lin", None, 1),
}


FLUX1_DEV = {
    "patch_size": 1,
    "in_channels": 64,
    "out_channels": None,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
"""FLUX.1-dev's transformer ``config.json`` (black-forest-labs/FLUX.1-dev, subfolder ``transformer``)."""


def t5_length(guidance: bool) -> int:
    """FLUX.1's T5 tokens per caption: [schnell] was distilled with 256, guidance-embedding [dev] with 512."""
    return 512 if guidance else 256


def text_tensors(t5_len: int) -> tuple[TextTensor, ...]:
    """FLUX.1's named text tensors: the T5 sequence ``[t5_len, t5_dim]`` and CLIP's pooled vector ``[clip_dim]``."""
    return TextTensor("t5", ("t5_len", "t5_dim"), "t5", t5_len), TextTensor("clip_pooled", ("clip_dim",), "clip")


class Flux1(Family):
    name = "flux1"
    pipelines = {"FluxPipeline": "FLUX.1 [dev] / [schnell]"}
    parts = (
        "transformer/config.json",
        "vae/config.json",
        "text_encoder/config.json",
        "text_encoder_2/config.json",
        "tokenizer",
        "tokenizer_2",
        "scheduler/scheduler_config.json",
    )
    config_parts = ("vae", "transformer", "text_encoder", "text_encoder_2")
    encoder_parts = ("vae", "text_encoder", "text_encoder_2")
    lora_presets = {
        "attention": ATTENTION,
        "attention+ffs": ATTENTION + FFS,
        "context": CONTEXT,
        # Every linear layer of the blocks, including modulation (norm) projections.
        "all": ATTENTION + FFS + ["norm1.linear", "norm1_context.linear", "norm.linear"],
    }
    lora_blocks = ("transformer_blocks.", "single_transformer_blocks.")
    implementation = "https://github.com/black-forest-labs/flux"
    transformer_class = "FluxTransformer2DModel"
    lora_read_kwargs = {"return_alphas": True}
    base_model_version = "flux1"
    network_module = "networks.lora_flux"
    kohya_blocks = {
        "transformer_blocks.": (DOUBLE, "double_blocks"),
        "single_transformer_blocks.": (SINGLE, "single_blocks"),
    }
    encoder_classes = {"transformers": ("CLIPTextModel", "T5EncoderModel"), "diffusers": ("AutoencoderKL",)}
    built_in_configs = {"flux1-dev": (FLUX1_DEV, "FLUX.1-dev")}
    mlp_ratio = 4.0
    block_activations = ((11, 2), (9, 3))
    """Per token, with h the hidden width and m the MLP width:

    - a double-stream block keeps, for each token in its own stream: the modulated norm output (h), q/k/v (3h), q and
      k after RMS norm and RoPE and the joint concatenation (3h), the attention output (h), the output projection
      (h), the second norm output (h), the MLP's first projection and GELU output (2m) and its second projection
      (h): 11h + 2m;
    - a single-stream block keeps: the norm output (h), q/k/v (3h), q/k after norm and RoPE (2h), the attention
      output (h), the MLP projection and GELU output (2m), their concatenation (h + m) and the output projection
      (h): 9h + 3m.
    """

    def text_length_of(self, transformer_config: dict) -> int:
        return t5_length(bool(transformer_config.get("guidance_embeds")))

    def facts(self, configs: dict[str, dict], identity: dict, text_tokens: int = 0) -> ModelFacts:
        vae, transformer = configs["vae"], configs["transformer"]
        guidance = bool(transformer.get("guidance_embeds", False))
        # model.text_tokens or T5's default; the blob below hashes it into the identity, so into the cache key.
        t5_len = self.text_length(transformer, text_tokens)
        blob = {
            "vae": public_config(vae),
            "clip": public_config(configs["text_encoder"]),
            "t5": public_config(configs["text_encoder_2"]),
            **identity,
            "t5_len": t5_len,
        }
        return ModelFacts(
            family=self.name,
            vae_scale_factor=2 ** (len(vae["block_out_channels"]) - 1),
            latent_channels=int(vae["latent_channels"]),
            pack=2,
            guidance_embeds=guidance,
            text_length=t5_len,
            text=text_tensors(t5_len),
            identity=hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:16],
            architecture=self.architecture_name(guidance),
        )

    def architecture_name(self, guidance: bool) -> str:
        """sd-scripts' name of the base model: guidance-distilled FLUX.1 is ``dev``, the other ``schnell``."""
        return "flux-1-dev" if guidance else "flux-1-schnell"

    def load_vae(self, path, kw, device, dtype):
        from diffusers import AutoencoderKL

        vae = AutoencoderKL.from_pretrained(path, torch_dtype=dtype, subfolder="vae", **kw)
        return vae.to(device).eval().requires_grad_(False)

    def load_text_encoders(self, path, kw, device, dtype):
        """CLIP-L and T5-XXL with their tokenizers."""
        from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

        clip_tok = CLIPTokenizer.from_pretrained(path, subfolder="tokenizer", **kw)
        t5_tok = T5TokenizerFast.from_pretrained(path, subfolder="tokenizer_2", **kw)
        clip = CLIPTextModel.from_pretrained(path, dtype=dtype, subfolder="text_encoder", **kw)
        t5 = T5EncoderModel.from_pretrained(path, dtype=dtype, subfolder="text_encoder_2", **kw)
        clip = clip.to(device).eval().requires_grad_(False)
        t5 = t5.to(device).eval().requires_grad_(False)
        return clip_tok, clip, t5_tok, t5

    def load_transformer(self, path, kw, device, dtype):
        from diffusers import FluxTransformer2DModel

        return FluxTransformer2DModel.from_pretrained(path, torch_dtype=dtype, subfolder="transformer", **kw).to(device)

    def encode_text(self, encoders, captions, facts):
        import torch

        clip_tok, clip, t5_tok, t5 = encoders
        with torch.inference_mode():
            clip_ids = clip_tok(
                captions, padding="max_length", max_length=CLIP_LENGTH, truncation=True, return_tensors="pt"
            ).input_ids.to(clip.device)
            pooled = clip(clip_ids, output_hidden_states=False).pooler_output
            t5_ids = t5_tok(
                captions, padding="max_length", max_length=facts.text_length, truncation=True, return_tensors="pt"
            ).input_ids.to(t5.device)
            seq = t5(t5_ids, output_hidden_states=False)[0]
        return {"t5": seq, "clip_pooled": pooled}

    def stored_latent(self, vae, z):
        """``(z - shift_factor) * scaling_factor``, both from the VAE's config."""
        return (z - float(vae.config.shift_factor or 0.0)) * float(vae.config.scaling_factor)

    def pack(self, latents):
        from rayflux.families import flux1_math

        return flux1_math.pack(latents)

    def unpack(self, tokens, height, width):
        from rayflux.families import flux1_math

        return flux1_math.unpack(tokens, height, width)

    def seq_len(self, height, width):
        return (height // 2) * (width // 2)

    def forward_args(self, tokens, text, sigmas, height, width, guidance, *, references=None):
        """References ride as Kontext's image-conditioning tokens (:mod:`.kontext_math`); FLUX.1 and Kontext share
        the transformer, and the job lets only a Kontext model train edit pairs (:attr:`max_references`)."""
        from rayflux.families import kontext_math
        from rayflux.families.references import with_references
        from rayflux.families import flux1_math

        t5 = text["t5"]
        hidden, img_ids = tokens, flux1_math.image_ids(height, width, tokens.device, tokens.dtype)
        if references is not None:
            ref_tokens, ref_ids = kontext_math.cached_references(references, tokens.dtype)
            hidden, img_ids = with_references(tokens, img_ids, ref_tokens, ref_ids)
        kwargs = {
            "hidden_states": hidden,
            "encoder_hidden_states": t5,
            "pooled_projections": text["clip_pooled"],
            "timestep": sigmas.to(tokens.dtype),
            "img_ids": img_ids,
            "txt_ids": flux1_math.text_ids(t5.shape[1], tokens.device, tokens.dtype),
        }
        if guidance is not None:
            kwargs["guidance"] = guidance
        return kwargs

    def pipeline_class(self):
        from diffusers import FluxPipeline

        return FluxPipeline

    def prompt_embeddings(self, path, kw, prompts, facts, device, dtype):
        import torch

        pipe = self.pipeline_class().from_pretrained(path, transformer=None, vae=None, torch_dtype=dtype, **kw)
        pipe = pipe.to(device)
        with torch.inference_mode():
            out = []
            for p in prompts:
                e, pooled = pipe.encode_prompt(p, p, device=device, max_sequence_length=facts.text_length)[:2]
                out.append({"prompt_embeds": e.clone(), "pooled_prompt_embeds": pooled.clone()})
        return out

    def true_cfg_kwargs(self, negative, scale):
        """diffusers' true CFG: FluxPipeline and FluxKontextPipeline run the negative prompt's prediction beside the
        prompt's at every step when ``true_cfg_scale`` > 1 and negative embeddings are given."""
        return {
            "negative_prompt_embeds": negative["prompt_embeds"],
            "negative_pooled_prompt_embeds": negative["pooled_prompt_embeds"],
            "true_cfg_scale": scale,
        }

    def render_pipeline(self, path: str, kw: dict, scheduler, vae, transformer):
        return self.pipeline_class()(
            scheduler=scheduler,
            vae=vae,
            text_encoder=None,
            tokenizer=None,
            text_encoder_2=None,
            tokenizer_2=None,
            transformer=transformer,
        )
