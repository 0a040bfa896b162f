"""Validation images: rank 0 renders the configured prompts with ``FluxPipeline`` and the LoRA being trained.

The pipeline borrows the training transformer (adapter attached, so the images show the current LoRA) and loads
the VAE and both text encoders only for the render; they are dropped again before training resumes. This is the
one moment a training process holds text encoders. Rendering runs under a forked RNG, so it never shifts the
random stream training draws from (a run with validation images trains exactly like one without).
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


def render(transformer, cfg: JobConfig, device, dtype) -> list:
    """One image per prompt; prompt ``i`` always starts from seed ``train.seed + i``."""
    from diffusers import FluxPipeline

    t = cfg.train
    device = torch.device(device)
    size = image_size(cfg)
    extra = {"revision": cfg.model.revision} if cfg.model.revision else {}
    was_training = transformer.training
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked):
        pipe = FluxPipeline.from_pretrained(
            models.resolve_path(cfg.model), transformer=transformer, torch_dtype=dtype, **extra
        ).to(device)
        pipe.set_progress_bar_config(disable=True)
        transformer.eval()
        try:
            images = [
                pipe(
                    prompt,
                    height=size,
                    width=size,
                    num_inference_steps=t.validation_inference_steps,
                    guidance_scale=t.validation_guidance,
                    max_sequence_length=models.model_facts(cfg.model).t5_max_length,
                    generator=torch.Generator().manual_seed(t.seed + i),
                ).images[0]
                for i, prompt in enumerate(t.validation_prompts)
            ]
        finally:
            transformer.train(was_training)
            del pipe
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return images


def save_grid(images: list, run_dir: str, step: int) -> str:
    """Write ``<run_dir>/validation/step-<step>.png`` (local or URI). Returns its path."""
    buf = io.BytesIO()
    grid(images).save(buf, format="PNG")
    path = storage.join(run_dir, "validation", f"step-{step:06d}.png")
    storage.write_bytes_atomic(path, buf.getvalue())
    log.info("validation images for step %d: %s", step, path)
    return path
