"""FLUX.1 Kontext [dev] (``FluxKontextPipeline``): FLUX.1's transformer, VAE, text encoders, packing, ids and key
names, under Kontext's pipeline.

Kontext's own difference, the reference image's latent tokens beside the noisy ones (``kontext_math``, fed by
:meth:`Flux1.forward_args`), belongs to edit pairs; a Kontext LoRA trained on plain image-caption pairs trains
exactly as FLUX.1 [dev] does. Its LoRA files
are FLUX.1's (the same ``FluxLoraLoaderMixin``), so a loaded Kontext transformer saves through FLUX.1.
"""

from __future__ import annotations

from rayflux.families.flux1 import Flux1


class Kontext(Flux1):
    name = "kontext"
    pipelines = {"FluxKontextPipeline": "FLUX.1 Kontext [dev]"}
    max_references = 1
    built_in_configs = {}  # its transformer is FLUX.1's: ``plan --model flux1-dev`` covers it

    def architecture_name(self, guidance: bool) -> str:
        return "flux-1-kontext-dev"

    def pipeline_class(self):
        from diffusers import FluxKontextPipeline

        return FluxKontextPipeline

    def reference_kwargs(self, images, height, width):
        """One reference at the render's own size: no snapping to Kontext's preferred resolutions, and a
        ``max_area`` that keeps ``height`` x ``width`` (the pipeline recomputes the size from it)."""
        if len(images) != 1:
            raise ValueError(f"FLUX.1 Kontext edits one reference image, got {len(images)}")
        return {"image": images[0], "max_area": height * width, "_auto_resize": False}
