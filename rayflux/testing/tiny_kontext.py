"""A tiny FLUX.1 Kontext model: the tiny FLUX.1 of :mod:`rayflux.testing.tiny` saved as a ``FluxKontextPipeline``.

Kontext has FLUX.1's transformer, VAE and text encoders; what differs is the pipeline, which feeds the reference
image's latent tokens beside the noisy ones. So the tiny Kontext is the tiny FLUX.1 (same seed, same sizes) under
Kontext's pipeline class, and ``FluxKontextPipeline.from_pretrained`` loads it as it loads the real model.
"""

from __future__ import annotations

from pathlib import Path

from rayflux.testing.tiny import TINY_SEED, TINY_VERSION, TinySpec, build_pipeline, default_home, ensure_pipeline_dir

# Bumped whenever the Kontext wrapping changes; the FLUX.1 sizes are versioned by TINY_VERSION.
TINY_KONTEXT_VERSION = "1"


def build_kontext(spec: TinySpec = TinySpec()):
    """Build the tiny ``FluxKontextPipeline`` in memory from the tiny FLUX.1's fixed seed."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline.from_pipe(build_pipeline(spec))


def ensure_tiny_kontext(path: str | Path | None = None, spec: TinySpec = TinySpec()) -> Path:
    """Return a directory holding the current tiny Kontext model, building it once if it is missing or stale."""
    version = f"{TINY_VERSION}.{TINY_KONTEXT_VERSION}"
    path = Path(path) if path else default_home() / f"tiny-kontext-v{version}"
    info = {"family": "kontext", "version": version, "seed": TINY_SEED, "spec": spec.__dict__}
    return ensure_pipeline_dir(path, lambda: build_kontext(spec), info)
