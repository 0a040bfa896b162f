"""Validation images: rank 0 renders the configured prompts with the model family's pipeline and the LoRA being
trained.

The pipeline borrows the training transformer (adapter attached, so the images show the current LoRA). The first
render loads both text encoders once, encodes the prompts and drops them again: that is the one moment a training
process holds text encoders, and later renders reuse the embeddings instead of loading them from ``model.path``
again while the other ranks wait. The small VAE is loaded for each render and freed after it. Rendering runs under a forked RNG, so it never shifts the
random stream training draws from (a run with validation images trains exactly like one without).

With ``train.validation_references`` each prompt is an edit instruction: its reference images, cut to the render's
square size as the cache cuts a reference to its target's, go to the pipeline's ``image=`` the way the family's
pipeline takes them (:meth:`~rayflux.families.base.Family.reference_kwargs`).
"""

from __future__ import annotations

import gc
import io
import logging
import math

import torch

from rayflux import models, storage
from rayflux.config import JobConfig

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
    """Square side in pixels: ``data.resolution`` rounded down to the model's 16-pixel alignment."""
    return max(16, cfg.data.resolution // 16 * 16)


_PREPARED: dict = {}
"""This process's validation prompt embeddings, filled by the first render, keyed by everything they depend on."""
text_encoder_loads = 0
"""How many times this process has loaded the text encoders for validation (once per run)."""


def _prompt_embeddings(cfg: JobConfig, device, dtype) -> list:
    """Each validation prompt's embedding arguments for the family's pipeline. The first call loads the text
    encoders, encodes every prompt and drops them; later renders never touch them again."""
    global text_encoder_loads
    t = cfg.train
    facts = models.model_facts(cfg.model)
    path = models.resolve_path(cfg.model)
    key = (path, cfg.model.revision, tuple(t.validation_prompts), str(device), str(dtype), facts.text_length)
    if key not in _PREPARED:
        family = models.family(cfg.model)
        embeds = family.prompt_embeddings(path, models.revision_kw(cfg.model), list(t.validation_prompts), facts,
                                          device, dtype)  # fmt: skip
        text_encoder_loads += 1
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _PREPARED.clear()
        _PREPARED[key] = embeds
    return _PREPARED[key]


def reference_images(entry, size: int) -> list:
    """The reference images of one validation prompt (a path or URI, or a list of them), center-cropped and resized
    to the ``size`` x ``size`` render."""
    from PIL import Image, ImageOps

    out = []
    for uri in [entry] if isinstance(entry, str) else entry:
        with Image.open(io.BytesIO(storage.read_bytes(uri))) as img:
            out.append(ImageOps.fit(img.convert("RGB"), (size, size), Image.Resampling.LANCZOS))
    return out


def render(transformer, cfg: JobConfig, device, dtype) -> list:
    """One image per prompt; prompt ``i`` always starts from seed ``train.seed + i``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    t = cfg.train
    kw = models.revision_kw(cfg.model)
    path = models.resolve_path(cfg.model)
    device = torch.device(device)
    size = image_size(cfg)
    was_training = transformer.training
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        embeds = _prompt_embeddings(cfg, device, dtype)
        # The VAE (small, from local files after the first load) is loaded per render and freed after it, so
        # training never holds an encoder between renders.
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path, subfolder="scheduler", **kw)
        vae = models.load_vae(cfg.model, str(device), dtype)
        family = models.family(cfg.model)
        pipe = family.render_pipeline(path, kw, scheduler, vae, transformer)
        edits = [family.reference_kwargs(reference_images(e, size), size, size) for e in t.validation_references]
        pipe.set_progress_bar_config(disable=True)
        transformer.eval()
        try:
            images = [
                pipe(
                    **prompt,
                    **(edits[i] if edits else {}),
                    height=size,
                    width=size,
                    num_inference_steps=t.validation_inference_steps,
                    guidance_scale=t.validation_guidance,
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


def render_trained(trainer, cfg: JobConfig, device) -> list:
    """:func:`render` with the trainer's LoRA. A sharded base (``train.base_sharding``) cannot run on rank 0 alone:
    each block's forward is an all-gather that every rank must join. Rank 0 instead loads a whole copy from
    ``model.path`` (node-local files), copies the adapter's current weights into it, renders and frees it. Gathering
    the shards instead would stall every rank in collectives for the render's length and hold each gathered tensor
    on all of them; the copy costs one read of local files and, during the render, rank 0's memory for the whole
    base."""
    if not trainer.layout:
        return render(trainer.transformer, cfg, device, trainer.dtype)
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

    from rayflux.train import lora

    device = torch.device(device)
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        whole = models.load_transformer(cfg.model, str(device), trainer.dtype)
        whole.requires_grad_(False)
        whole.add_adapter(trainer.transformer.peft_config[lora.ADAPTER])
        for name, p in whole.named_parameters():
            if ".lora_" in name:
                p.data = p.data.to(torch.float32)  # as the trained adapter is held (lora.add_lora)
    adapter = get_peft_model_state_dict(trainer.transformer)
    set_peft_model_state_dict(whole, {k: v.to(device) for k, v in adapter.items()}, adapter_name=lora.ADAPTER)
    try:
        return render(whole, cfg, device, trainer.dtype)
    finally:
        del whole
        gc.collect()


def save_grid(images: list, run_dir: str, step: int) -> str:
    """Write ``<run_dir>/validation/step-<step>.png`` (local or URI). Returns its path."""
    buf = io.BytesIO()
    grid(images).save(buf, format="PNG")
    path = storage.join(run_dir, "validation", f"step-{step:06d}.png")
    storage.write_bytes_atomic(path, buf.getvalue())
    log.info("validation images for step %d: %s", step, path)
    return path
