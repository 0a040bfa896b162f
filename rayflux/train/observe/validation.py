"""Validation images: the configured prompts rendered with the model family's pipeline and a LoRA.

The render actor (:mod:`rayflux.train.observe.renderer`) calls :func:`render` with its base transformer carrying each due
step's LoRA file. The first render in a process loads both text encoders once, encodes the prompts and drops them;
later renders reuse the embeddings. The small VAE is loaded for each render and freed after it. Rendering runs
under a forked RNG, so it never shifts the random stream of the process that renders.
:func:`render_trained` renders a live trainer's LoRA in-process (used by tests to compare layouts).

With ``train.validation.references`` each prompt is an edit instruction: its reference images, read once per run and
decoded by the cache's decoder (upright by their EXIF orientation, any mode to RGB), cut to the render's square
size, go to the pipeline's ``image=`` the way the family's pipeline takes them
(:meth:`~rayflux.families.base.Family.reference_kwargs`).
"""

from __future__ import annotations

import gc
import io
import logging
import math

import torch

from rayflux import models, storage
from rayflux.cache.decode import BadImage, decode
from rayflux.config import JobConfig
from rayflux.train.adapter import lora

log = logging.getLogger(__name__)


def grid(images: list, columns: int = 0):
    """Paste equally sized PIL images into one grid, row by row (``columns`` 0: as square as possible)."""
    from PIL import Image

    columns = columns or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / columns)
    w, h = images[0].size
    out = Image.new("RGB", (columns * w, rows * h))
    for i, img in enumerate(images):
        out.paste(img, ((i % columns) * w, (i // columns) * h))
    return out


def image_size(cfg: JobConfig) -> int:
    """Square side in pixels: ``data.resolution`` rounded down to the model's alignment
    (:attr:`rayflux.families.ModelFacts.alignment`: a whole number of its packed latent tokens)."""
    align = models.model_facts(models.render_model(cfg)).alignment
    return max(align, cfg.data.resolution // align * align)


_PREPARED: dict = {}
"""This process's validation prompt embeddings, filled by the first render, keyed by everything they depend on."""


def _prompt_embeddings(cfg: JobConfig, device, dtype) -> list:
    """Each validation prompt's embedding arguments for the family's pipeline. The first call loads the text
    encoders, encodes every prompt and drops them; later renders never touch them again."""
    t, model = cfg.train, models.render_model(cfg)
    facts = models.model_facts(model)
    path = models.resolve_path(model)
    texts = [*t.validation.prompts, *([t.validation.negative_prompt] if t.validation.true_cfg else [])]
    key = (path, model.revision, tuple(texts), str(device), str(dtype), facts.text_length)
    if key not in _PREPARED:
        family = models.family(model)
        embeds = family.prompt_embeddings(path, models.revision_kw(model), texts, facts, device, dtype)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _PREPARED.clear()
        _PREPARED[key] = embeds
    return _PREPARED[key]


_REFERENCES: dict = {}
"""This process's validation reference images, read and cut by the first render, keyed by what they depend on."""


def reference_images(entry, size: int, max_pixels: int) -> list:
    """The reference images of one validation prompt (a path or URI, or a list of them): decoded as the cache
    decodes a reference (:func:`rayflux.cache.decode.decode`: EXIF orientation, any mode to RGB, the
    ``data.max_image_pixels`` limit), center-cropped and resized to the ``size`` x ``size`` render."""
    from PIL import Image, ImageOps

    out = []
    for uri in [entry] if isinstance(entry, str) else entry:
        try:
            img = decode(storage.read_bytes(uri), max_pixels)
        except BadImage as exc:
            raise ValueError(f"train.validation.references: {uri}: {exc}") from None
        out.append(ImageOps.fit(img, (size, size), Image.Resampling.LANCZOS))
    return out


def _references(cfg: JobConfig, size: int) -> list[list]:
    """Every validation prompt's reference images (:func:`reference_images`), read once per run: later renders
    reuse them instead of reading the files again."""
    refs = cfg.train.validation.references
    key = (repr(refs), size, cfg.data.max_image_pixels)
    if key not in _REFERENCES:
        _REFERENCES.clear()
        _REFERENCES[key] = [reference_images(e, size, cfg.data.max_image_pixels) for e in refs]
    return _REFERENCES[key]


def _guided(cfg: JobConfig, family, embeds: list) -> tuple[list, dict]:
    """``(the prompts' embeddings, the guidance arguments every render call takes)``: with
    ``train.validation.true_cfg`` the last embedding is the negative prompt's (:func:`_prompt_embeddings`)."""
    scale = cfg.train.validation.true_cfg
    if not scale:
        return embeds, {}
    return embeds[:-1], family.true_cfg_kwargs(embeds[-1], scale)


def render(transformer, cfg: JobConfig, device, dtype) -> list:
    """One image per prompt; prompt ``i`` always starts from seed ``train.seed + i``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    t, model = cfg.train, models.render_model(cfg)
    kw = models.revision_kw(model)
    path = models.resolve_path(model)
    device = torch.device(device)
    size = image_size(cfg)
    was_training = transformer.training
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        embeds = _prompt_embeddings(cfg, device, dtype)
        # The VAE (small, from local files after the first load) is loaded per render and freed after it, so
        # training never holds an encoder between renders.
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **kw)
        vae = models.load_vae(model, str(device), dtype)
        family = models.family(model)
        embeds, guide = _guided(cfg, family, embeds)
        pipe = family.render_pipeline(path, kw, scheduler, vae, transformer)
        own_steps, own_guidance = family.validation_settings(path, kw)
        edits = [family.reference_kwargs(images, size, size) for images in _references(cfg, size)]
        pipe.set_progress_bar_config(disable=True)
        transformer.eval()
        try:
            images = [
                pipe(
                    **prompt,
                    **(edits[i] if edits else {}),
                    **guide,
                    height=size,
                    width=size,
                    num_inference_steps=t.validation.inference_steps or own_steps,
                    guidance_scale=t.validation.guidance or own_guidance,
                    generator=torch.Generator().manual_seed(t.seed + i),
                ).images[0]
                for i, prompt in enumerate(embeds)
            ]
        finally:
            transformer.train(was_training)
            del pipe
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return images


def whole_copy(trainer, cfg: JobConfig, device):
    """A whole transformer from ``model.path`` (``train.validation.model`` when set) carrying the trainer's current
    adapter: attached as the trainer attached it (:func:`rayflux.train.adapter.lora.add_lora` with the same ``train``
    settings) and filled with its weights (:func:`rayflux.train.adapter.lora.set_state`), so the rendered adapter is the
    trained one."""
    t = cfg.train
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):  # add_lora's init draws
        whole = models.load_transformer(models.render_model(cfg), str(device), trainer.dtype)
        lora.add_lora(
            whole,
            t.adapter.rank,
            t.adapter.alpha,
            t.adapter.targets,
            t.adapter.lora_dropout,
            t.adapter.kind,
            **lora.patterns_of(t),
        )
    adapter = lora.lora_state_dict(trainer.transformer)
    lora.set_state(whole, {k: v.to(device) for k, v in adapter.items()}, "the trained adapter")
    return whole


def render_trained(trainer, cfg: JobConfig, device) -> list:
    """:func:`render` with the trainer's LoRA. A sharded base (``train.workers.base_fsdp``) cannot run on rank 0 alone:
    each block's forward is an all-gather that every rank must join. Rank 0 instead loads a whole copy from
    ``model.path`` (node-local files) with the adapter's current weights (:func:`whole_copy`), renders and frees it.
    Gathering the shards instead would stall every rank in collectives for the render's length and hold each
    gathered tensor on all of them; the copy costs one read of local files and, during the render, rank 0's memory
    for the whole base. With ``train.validation.model`` the copy is of that model, which renders the LoRA."""
    if not trainer.layout and not cfg.train.validation.model:
        return render(trainer.transformer, cfg, device, trainer.dtype)
    whole = whole_copy(trainer, cfg, device)
    try:
        return render(whole, cfg, device, trainer.dtype)
    finally:
        del whole
        gc.collect()


def grid_path(output_dir: str, step: int) -> str:
    """Where the grid of ``step`` goes: ``<output_dir>/validation/step-<step>.png``."""
    return storage.join(output_dir, "validation", f"step-{step:06d}.png")


def lora_path(output_dir: str, step: int) -> str:
    """Where a kohya-format run leaves the diffusers-format LoRA a grid was rendered with, beside the grid."""
    return storage.join(output_dir, "validation", f"step-{step:06d}.safetensors")


def save_grid(images: list, output_dir: str, step: int) -> str:
    """Write ``<output_dir>/validation/step-<step>.png`` (local or URI). Returns its path."""
    buf = io.BytesIO()
    grid(images).save(buf, format="PNG")
    path = grid_path(output_dir, step)
    storage.write_bytes_atomic(path, buf.getvalue())
    log.info("validation images for step %d: %s", step, path)
    return path
