"""Callable classes for Ray Data ``map_batches`` actor pools: the VAE and the text encoders of the model's family.

These are the only places that load encoders. When the cache stage's dataset finishes, Ray tears the pools down,
so encoder memory never reaches the training processes.
"""

from __future__ import annotations

import hashlib
import logging
import math

import numpy as np

from rayflux.cache import tensors
from rayflux.config import ModelConfig

log = logging.getLogger(__name__)


def noise_seed(sample_id: str) -> int:
    """The seed of one sample's latent noise: a latent does not depend on which batch or worker encoded it."""
    return int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def threads_for(cpus: float) -> int:
    """Torch threads for a reservation of ``cpus``: rounded up, so an actor holding what preparation and writing
    leave (1.25 of 2 CPUs) uses both cores while those short tasks are idle, and 0.75 CPU still gets one thread."""
    return max(1, math.ceil(cpus - 1e-6))


def match_threads_to_reservation() -> None:
    """Run torch on as many threads as CPUs this actor reserved (:func:`threads_for`): an actor on 1 CPU that spins
    up a thread per core fights its neighbours, and two such actors run no faster than one."""
    import ray
    import torch

    if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return  # used directly in a driver (tests, benchmarks): leave torch's threads alone
    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 0)
    if cpus > 0:
        torch.set_num_threads(threads_for(cpus))


class VaeEncoder:
    """Encode prepared pixels to the latents the model's family stores (FLUX.1: ``(z - shift) * scale``; FLUX.2:
    patchified and batch-norm normalised), one row per sample.

    Rows of one batch may come from different buckets; each bucket is encoded as its own sub-batch. Skipped rows
    and rows reused from a previous generation pass through untouched; each row this actor encodes is stamped
    with ``encode_id``, so a generation records exactly which rows cost an encoder pass. The VAE loads on the first
    row that needs it: a rerun with nothing new never loads it at all.
    """

    def __init__(self, model: ModelConfig, store_dtype: str, encode_id: str):
        match_threads_to_reservation()
        self.model = model
        self.store_dtype = store_dtype
        self.encode_id = encode_id
        self.vae = None

    def _load(self) -> None:
        import torch

        from rayflux import models

        self.device = models.default_device()
        self.family = models.family(self.model)
        self.vae = self.family.load_vae(
            models.resolve_path(self.model),
            models.revision_kw(self.model),
            self.device,
            models.vae_dtype(self.model, self.device),
        )
        # Weights and input in channels-last let oneDNN (CPU) and cuDNN run their channels-last kernels throughout:
        # 1.3x against NCHW on FLUX.1's VAE on CPU, with fp32 results equal to 1e-5.
        self.vae.to(memory_format=torch.channels_last)

    def _input(self, pixels: np.ndarray):
        import torch

        if self.vae is None:
            self._load()
        x = torch.from_numpy(pixels).to(self.device).permute(0, 3, 1, 2).to(self.vae.dtype) / 127.5 - 1.0
        return x.contiguous(memory_format=torch.channels_last)

    def encode_references(self, pixels: np.ndarray):
        """Stored latents of a ``[N, H, W, 3]`` batch of edit references: the VAE's mode, not a sample, as the
        Kontext and FLUX.2 pipelines encode their reference images at inference."""
        import torch

        x = self._input(pixels)
        with torch.inference_mode():
            return self.family.stored_latent(self.vae, self.vae.encode(x).latent_dist.mode().float())

    def encode(self, pixels: np.ndarray, sample_ids: list[str]):
        """Latents of a ``[N, H, W, 3]`` uint8 batch of one size, as the VAE returns them (not contiguous)."""
        import torch

        x = self._input(pixels)
        with torch.inference_mode():
            dist = self.vae.encode(x).latent_dist
            shape = dist.mean.shape[1:]
            eps = torch.stack(
                [torch.randn(shape, generator=torch.Generator().manual_seed(noise_seed(s))) for s in sample_ids]
            ).to(dist.mean.device)
            # The sample and the family's normalisation in fp32 whatever the VAE ran in, so a bf16 encode rounds once.
            return self.family.stored_latent(self.vae, dist.mean.float() + dist.std.float() * eps)

    def _encode_references(self, batch: dict, idx: list[int], h: int, w: int, out: list[bytes]) -> None:
        """Each edit row's references (cut to its bucket, like the row) as its stored latents back to back."""
        counts = {i: int(batch["ref_count"][i]) for i in idx if "ref_count" in batch and int(batch["ref_count"][i])}
        if not counts:
            return
        pixels = np.concatenate(
            [np.frombuffer(batch["ref_pixels"][i], dtype=np.uint8).reshape(k, h, w, 3) for i, k in counts.items()]
        )
        z = self.encode_references(pixels)
        start = 0
        for i, k in counts.items():
            out[i] = tensors.to_bytes(z[start : start + k], self.store_dtype)
            start += k

    def __call__(self, batch: dict) -> dict:
        n = len(batch["sample_id"])
        latents: list[bytes] = [b""] * n
        shapes = np.zeros((n, 3), dtype=np.int64)
        groups: dict[tuple[int, int], list[int]] = {}
        for i in range(n):
            if not batch["skip_reason"][i] and not batch["reuse"][i]:
                groups.setdefault((int(batch["target_h"][i]), int(batch["target_w"][i])), []).append(i)
        refs = [b""] * n
        for (h, w), idx in groups.items():
            pixels = np.stack([np.frombuffer(batch["pixels"][i], dtype=np.uint8).reshape(h, w, 3) for i in idx])
            z = self.encode(pixels, [str(batch["sample_id"][i]) for i in idx])
            for j, i in enumerate(idx):
                latents[i] = tensors.to_bytes(z[j], self.store_dtype)  # a contiguous copy of sample j alone
                shapes[i] = z.shape[1:]
            self._encode_references(batch, idx, h, w, refs)
        out = {k: v for k, v in batch.items() if k not in ("pixels", "ref_pixels")}
        out["latent"] = np.array(latents, dtype=object)
        out["ref_latent"] = np.array(refs, dtype=object)
        out["latent_c"], out["latent_h"], out["latent_w"] = shapes[:, 0], shapes[:, 1], shapes[:, 2]
        out["latent_dtype"] = np.array([self.store_dtype if latents[i] else "" for i in range(n)], dtype=object)
        out["encode_id"] = np.array([self.encode_id if latents[i] else "" for i in range(n)], dtype=object)
        return out


class TextEncoder:
    """Encode unique captions into the named text tensors of the model's family (FLUX.1: T5 sequence and CLIP pooled;
    FLUX.2: stacked hidden states), each with its shape columns, one row per caption, stamped with ``encode_id``.
    """

    def __init__(self, model: ModelConfig, store_dtype: str, facts, encode_id: str):
        import torch

        from rayflux import models

        match_threads_to_reservation()
        self.device = models.default_device()
        dtype = models.torch_dtype(model.dtype, self.device)
        self.family = models.family(model)
        self.encoders = self.family.load_text_encoders(
            models.resolve_path(model), models.revision_kw(model), self.device, dtype
        )
        self.facts = facts
        self.store_dtype = store_dtype
        self.encode_id = encode_id
        self.torch = torch
        self.passes = 0

    def __call__(self, batch: dict) -> dict:
        captions = [str(c) for c in batch["caption"]]
        encoded = self.family.encode_text(self.encoders, captions, self.facts)
        self.passes += len(captions)
        n = len(captions)
        out = {"caption_id": np.array(batch["caption_id"], dtype=object), "caption": np.array(captions, dtype=object)}
        for t in self.facts.text:
            x = encoded[t.name]
            out[t.name] = np.array([tensors.to_bytes(x[i], self.store_dtype) for i in range(n)], dtype=object)
            for d, size in zip(t.dims, x.shape[1:]):
                out[d] = np.full(n, size, dtype=np.int64)
        out["text_dtype"] = np.array([self.store_dtype] * n, dtype=object)
        out["encode_id"] = np.array([self.encode_id] * n, dtype=object)
        return out
