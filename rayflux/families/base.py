"""The model-family interface: everything that differs between FLUX.1, FLUX.1 Kontext and FLUX.2, in one place.

The cache, the feed, the training loop and the ledger never ask which model they run: they ask the model's
:class:`Family` (chosen from ``model_index.json``'s ``_class_name``, see :mod:`rayflux.families`) for its encoders,
its named text tensors, its stored latent, its packing and position ids, the transformer's forward arguments, its
pipeline and its LoRA key names. Text tensors are stored and read by the names a family gives them
(:class:`TextTensor`), each with its own shape columns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


def public_config(config: dict) -> dict:
    """A diffusers ``config.json`` without its private ``_``-keys (class name, diffusers version, the path it was read
    from): what decides the model's shapes, and so what a model identity hashes."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


@dataclass(frozen=True)
class TextTensor:
    """One named per-caption text tensor as the cache stores it: a binary column and one shape column per axis."""

    name: str
    """Column in the text shards holding the tensor's bytes (``t5``, ``clip_pooled``, ``prompt_embeds``)."""
    dims: tuple[str, ...]
    """Shape columns, one per axis, in order (``("t5_len", "t5_dim")``)."""
    key: str
    """Prefix of the tensor's byte-range columns in the caption index (``<key>_offset``, ``<key>_length``)."""
    length: int = 0
    """The model's fixed size of the first axis (the padded sequence length), checked on every row; 0: any."""

    def __post_init__(self):
        object.__setattr__(self, "dims", tuple(self.dims))


@dataclass(frozen=True)
class ModelFacts:
    """What the rest of the job needs to know about a model, read from its config files alone (no weights)."""

    family: str
    """The family's registry name (``flux1``, ``flux2``); what the job's workers look the family up by."""
    vae_scale_factor: int
    """Pixels per stored latent cell along each side (FLUX.2 stores 2x2-patchified latents: 16)."""
    latent_channels: int
    """Channels of a stored latent (FLUX.1: the VAE's 16; FLUX.2: 4 x 32 patchified)."""
    pack: int
    """Side of the patches the transformer packs stored latents into tokens with (FLUX.1: 2; FLUX.2: 1)."""
    guidance_embeds: bool
    """The transformer embeds a guidance value (FLUX.1 [dev], FLUX.2 [dev])."""
    text_length: int
    """Padded token length of every caption's text embedding: the ``max_sequence_length`` the pipelines encode with
    (``model.text_tokens``, else the family's default)."""
    text: tuple[TextTensor, ...] = field(default=())
    """The named text tensors one caption encodes to, in storage order."""
    identity: str = ""
    """Hash of the VAE and text-encoder configs and weight file sizes/names (or the hub revision): part of the
    cache key, so a different encoder never reuses old latents."""
    architecture: str = ""
    """What LoRA metadata calls the base model (``flux-1-dev``, ``flux-2-klein``)."""

    @property
    def alignment(self) -> int:
        """Pixel sides must be multiples of this: latent cell size times the transformer's packing."""
        return self.pack * self.vae_scale_factor


class Family(ABC):
    """One model family. Stateless: every method takes what it works on; encoders are returned, not kept."""

    name: str
    """Registry name, recorded in :class:`ModelFacts` (``flux1``)."""
    pipelines: dict[str, str]
    """``model_index.json`` classes of this family, with what users call them."""
    parts: tuple[str, ...]
    """Files and folders a local model directory of this family must hold."""
    lora_presets: dict[str, list[str]]
    """``train.adapter.targets`` presets: module-name suffixes inside the transformer's blocks."""
    lora_blocks: tuple[str, ...]
    """Module-name prefixes of the transformer's blocks, where presets apply."""
    base_model_version: str
    """sd-scripts' ``ss_base_model_version`` of this family's LoRAs."""
    network_module: str
    """kohya's ``ss_network_module`` of this family's LoRAs (the trainer module that writes such files)."""
    max_references: int | None = 0
    """Most reference images one edit pair may have (0: the family trains no edit pairs; None: no limit)."""
    implementation: str
    """Where the model's reference code lives (``modelspec.implementation`` of kohya files)."""
    transformer_class: str
    """The diffusers transformer class: how a loaded transformer names its family."""
    sigma_sampling: str = "flux_shift"
    """``train.sigma_sampling=auto``: the σ schedule of the family's own pipeline (:mod:`rayflux.train.flow`)."""
    lora_read_kwargs: dict = {}
    """Extra keyword arguments of the pipeline's ``lora_state_dict`` for reading a LoRA file."""

    encoder_classes: dict[str, tuple[str, ...]]
    """The VAE and text-encoder classes this family loads, by the package that defines them (``transformers``,
    ``diffusers``): what must live only in the cache stage's actors, never in a training worker
    (:func:`rayflux.memory.live_encoders`)."""

    # -- memory plan (see rayflux.gpu_memory) -------------------------------------------------------------------
    built_in_configs: dict[str, tuple[dict, str]] = {}
    """``python -m rayflux plan --model NAME``: NAME -> (the transformer ``config.json`` of a released model of this
    family, what users call it), planned without any file."""
    block_activations: tuple[tuple[int, int], tuple[int, int]]
    """Activation elements one token keeps for the backward pass in a double-stream and in a single-stream block,
    each as ``(a, b)`` for ``a*h + b*m`` (``h`` the hidden width, ``m`` the MLP width)."""
    mlp_ratio: float
    """MLP width over hidden width, for a transformer config that names no ``mlp_ratio``."""

    @abstractmethod
    def text_length_of(self, transformer_config: dict) -> int:
        """The padded text length the family's pipeline encodes captions to, from the transformer config alone
        (what :attr:`ModelFacts.text_length` is when the other parts' configs are not at hand)."""

    # -- facts and loading -------------------------------------------------------------------------------------
    @abstractmethod
    def facts(self, configs: dict[str, dict], identity: dict, text_tokens: int = 0) -> ModelFacts:
        """Facts from the parts' ``config.json`` (``configs[subfolder]``, see :attr:`config_parts`); ``identity``
        holds what the cache key hashes besides (weights signature, path, revision), to which a family adds.
        ``text_tokens``: ``model.text_tokens``, the text length to keep (0: :meth:`text_length_of`'s)."""

    max_text_tokens: int = 512
    """The longest text the family's pipelines encode (their ``max_sequence_length`` limit)."""

    def text_length(self, transformer_config: dict, text_tokens: int = 0) -> int:
        """The text length a job keeps: ``text_tokens`` (``model.text_tokens``) when set, else the family's default;
        a length the pipelines refuse is refused here, before any encoder loads."""
        if not 0 <= text_tokens <= self.max_text_tokens:
            raise ValueError(
                f"model.text_tokens={text_tokens}: {', '.join(self.pipelines.values())} encodes at most "
                f"{self.max_text_tokens} text tokens (0: the default)"
            )
        return text_tokens or self.text_length_of(transformer_config)

    config_parts: tuple[str, ...] = ("vae", "transformer")
    """Subfolders whose ``config.json`` :meth:`facts` reads."""
    encoder_parts: tuple[str, ...] = ("vae",)
    """Subfolders whose weights the cache's identity covers."""

    @abstractmethod
    def load_vae(self, path: str, kw: dict, device: str, dtype):
        """The VAE, from a model directory or hub id (``kw``: subfolder-less ``from_pretrained`` kwargs)."""

    @abstractmethod
    def load_text_encoders(self, path: str, kw: dict, device: str, dtype):
        """The text encoders with their tokenizers, as one opaque object for :meth:`encode_text`."""

    @abstractmethod
    def load_transformer(self, path: str, kw: dict, device: str, dtype):
        """The denoising transformer."""

    # -- cache --------------------------------------------------------------------------------------------------
    @abstractmethod
    def encode_text(self, encoders, captions: list[str], facts: ModelFacts) -> dict:
        """Named text tensors ``{name: [B, *shape]}`` for a batch of captions, as :attr:`ModelFacts.text` names."""

    @abstractmethod
    def stored_latent(self, vae, z):
        """The latent to store for the VAE's sampled latents ``z`` ``[B, C, h, w]``, normalisation included."""

    # -- training -------------------------------------------------------------------------------------------------
    @abstractmethod
    def pack(self, latents):
        """Stored latents ``[B, C, H, W]`` -> transformer tokens ``[B, N, D]``."""

    @abstractmethod
    def unpack(self, tokens, height: int, width: int):
        """Inverse of :meth:`pack` for a stored latent of ``height`` x ``width``."""

    def pack_mask(self, mask):
        """A loss mask on the stored-latent grid ``[B, H, W]`` -> per-token weights ``[B, N]``, in :meth:`pack`'s
        token order: each token's weight is the mean of the latent cells it packs (FLUX.1: its 2x2 cells; FLUX.2's
        patchified latent: its one cell). Packed by :meth:`pack` itself, so a token's weight can never come from
        other cells than its latent values."""
        return self.pack(mask.unsqueeze(1)).mean(dim=-1)

    @abstractmethod
    def seq_len(self, height: int, width: int) -> int:
        """Image tokens of a stored latent of ``height`` x ``width`` (drives ``flux_shift``)."""

    @abstractmethod
    def forward_args(self, tokens, text: dict, sigmas, height: int, width: int, guidance, *, references=None) -> dict:
        """The transformer's keyword arguments for noisy ``tokens`` of a ``height`` x ``width`` latent, the batch's
        named text tensors (already on the device, in the weights' dtype), ``sigmas`` and ``guidance`` (None when
        the transformer embeds none). ``references``: an edit batch's cached reference latents ``[B, k, C, height,
        width]`` (the weights' dtype), fed after the target's tokens the way the family's pipeline feeds its
        ``image=``; the transformer's prediction then covers them too, and only its first ``tokens.shape[1]``
        tokens (:func:`rayflux.families.references.target_prediction`) are the target's."""

    # -- pipelines and LoRA files ----------------------------------------------------------------------------------
    @abstractmethod
    def pipeline_class(self):
        """The diffusers pipeline class for validation renders, ``save_lora_weights`` and ``lora_state_dict``."""

    @abstractmethod
    def prompt_embeddings(self, path: str, kw: dict, prompts: list[str], facts: ModelFacts, device, dtype) -> list:
        """For each prompt, the pipeline call's keyword arguments that carry its embeddings (text encoders loaded
        here and dropped again)."""

    def reference_kwargs(self, images: list, height: int, width: int) -> dict:
        """The pipeline call's keyword arguments that make a ``height`` x ``width`` render an edit of the reference
        ``images`` (PIL, already at the render's size)."""
        raise ValueError(f"{', '.join(self.pipelines.values())} takes no reference images")

    def true_cfg_kwargs(self, negative: dict, scale: float) -> dict:
        """The pipeline call's keyword arguments for ``train.validation.true_cfg``: classifier-free guidance by
        ``scale`` away from the ``negative`` prompt's embeddings (one :meth:`prompt_embeddings` entry)."""
        raise ValueError(
            f"train.validation.true_cfg: {', '.join(self.pipelines.values())} takes no true classifier-free guidance "
            "(FLUX.2 [klein] base guides against the empty prompt with train.validation.guidance)"
        )

    def validation_settings(self, path: str, kw: dict) -> tuple[int, float]:
        """``(denoising steps, guidance scale)`` a validation render of the model at ``path`` takes when
        ``train.validation.inference_steps`` / ``train.validation.guidance`` are 0 (``kw``: ``from_pretrained``'s
        revision)."""
        return 20, 3.5

    def inference_steps(self, path: str, kw: dict) -> int:
        """The denoising steps the family's pipeline runs the model at by default (``num_inference_steps``): what
        ``flux2_shift``'s μ depends on (``kw``: ``from_pretrained``'s revision)."""
        return 28

    def training_warning(self, path: str, pipeline: dict, transformer_config: dict) -> str:
        """What the job warns about before training on the model at ``path`` (its ``model_index.json``
        ``pipeline`` and transformer ``config.json``), naming what to train on instead; empty: nothing."""
        return ""

    def compile_blocks(self, transformer) -> None:
        """``train.compile``: ``torch.compile`` each of the transformer's repeated blocks in place (regional
        compilation: blocks of one class share one compiled graph, so compiling costs one block's trace, not the
        model's). diffusers' ``compile_repeated_blocks`` finds them by the model class's ``_repeated_blocks``, which
        every built-in family's transformer declares; a family whose transformer lacks it overrides this."""
        transformer.compile_repeated_blocks()

    @abstractmethod
    def render_pipeline(self, path: str, kw: dict, scheduler, vae, transformer):
        """A pipeline without text encoders around the training ``transformer``, for validation renders."""

    routed_blocks: tuple[tuple[str, bool], ...] = (
        ("transformer_blocks", False),
        ("single_transformer_blocks", False),
    )
    """``train.token_routing`` (TREAD, :mod:`rayflux.train.token_routing`): the transformer's block lists in the
    order its forward runs them, each with whether its blocks take text and image tokens as one joint
    ``hidden_states`` (text first) rather than the image stream alone. Every block names its input ``hidden_states``
    and its rotary embedding ``image_rotary_emb`` (text rows first), as diffusers' FLUX blocks do."""

    kohya_blocks: dict[str, tuple[dict, str]]
    """kohya/original key map: diffusers block prefix -> (module inside a block -> (original name, part, parts),
    original block prefix). A fused original layer (``img_attn.qkv``) lists its diffusers parts in order; see
    :mod:`rayflux.train.adapter.kohya`."""
