"""FLUX.1 Kontext [dev] (``FluxKontextPipeline``): FLUX.1's transformer, VAE, text encoders, packing, ids and key
names, under Kontext's pipeline.

Kontext's own difference, the reference image's latent tokens beside the noisy ones (``kontext_math``), belongs to
edit pairs; a Kontext LoRA trained on plain image-caption pairs trains exactly as FLUX.1 [dev] does. Its LoRA files
are FLUX.1's (the same ``FluxLoraLoaderMixin``), so a loaded Kontext transformer saves through FLUX.1.
"""

from __future__ import annotations

from rayflux.families.flux1 import Flux1


class Kontext(Flux1):
    name = "kontext"
    pipelines = {"FluxKontextPipeline": "FLUX.1 Kontext [dev]"}

    def architecture_name(self, guidance: bool) -> str:
        return "flux-1-kontext-dev"

    def pipeline_class(self):
        from diffusers import FluxKontextPipeline

        return FluxKontextPipeline
