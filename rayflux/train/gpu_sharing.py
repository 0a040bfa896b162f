"""Whether the cache stage's encoders may share the training workers' GPUs, so that the worker group can start (and
load the model) during the cache stage on a cluster whose every GPU trains.

A worker group started during the cache stage (:mod:`rayflux.train.early`) normally holds whole GPUs, and the
encoders take GPUs the workers do not use. On a node whose GPUs all train (one 8-GPU node, 8 workers) there are none
left, and the group would have to wait for the cache stage. Where a training worker's peak and an encoder actor both
fit in one GPU's memory, each GPU is split instead: the worker reserves ``1 - share`` of it and one encoder actor
``share`` (Ray packs fractional GPU requests onto the GPUs that have room, so each encoder lands beside a worker).

**Both fit** when the worker's peak as the memory planner computes it (:mod:`rayflux.gpu_memory`: the base at
``train.base_dtype``, the LoRA and its optimizer state, the activations at the largest resolution and
``train.batch_size``, with gradient checkpointing as ``auto`` would set it on that GPU) plus the encoders' weights
(from the text encoders' and the VAE's safetensors headers, in ``model.dtype``; an object-storage model's file
bytes) times :data:`ENCODER_MARGIN` is at most :data:`HEADROOM` of the GPU. The worker's *peak* is counted, not what it holds while it waits, so nothing depends on
how fast the encoder processes give their memory back once the cache commits. A sharded base
(``train.workers.base_fsdp``) is counted whole: an upper bound.

**The share** is the encoders' part of that memory, rounded up to a twentieth, at least :data:`MIN_SHARE` and below
one half, so that no two workers can ever be packed onto one GPU.

Not shared: a cluster whose GPU does not answer with its memory (:func:`rayflux.caption.fit.probe_gpu`, a short
task on a GPU), a model whose encoder weights cannot be counted (a hub id), encoders sent to their own GPU type
(``cache.accelerator_type``), or a run whose validation renders already take a share of each training GPU (the
render actor loads the whole pipeline).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rayflux import gpu_memory
from rayflux.caption.fit import BYTES, parameters
from rayflux.config import JobConfig
from rayflux.gpu_memory import GIB

HEADROOM = 0.85
"""Of a GPU's memory, what the worker's peak and the encoders may fill together: the rest is two CUDA contexts and
the allocators' fragmentation."""
ENCODER_MARGIN = 1.25
"""An encoder actor's memory over its weights: the activations of one batch (the VAE's at full resolution are the
largest)."""
MIN_SHARE = 0.1
"""The smallest GPU share an encoder actor reserves."""
MAX_SHARE = 0.45
"""The largest: below one half, so a worker keeps more than half of its GPU and no two workers share one."""


@dataclass(frozen=True)
class Sharing:
    """One GPU's memory as a worker and an encoder actor would share it (bytes)."""

    worker: int
    """The training worker's peak (:func:`worker_peak_bytes`)."""
    encoders: int
    """One encoder actor's: its weights times :data:`ENCODER_MARGIN`."""
    gpu: int
    """The GPU's memory."""

    @property
    def fits(self) -> bool:
        return self.worker + self.encoders <= HEADROOM * self.gpu and self.share <= MAX_SHARE

    @property
    def share(self) -> float:
        """The encoder actor's GPU share for Ray (the worker takes the rest)."""
        return max(MIN_SHARE, math.ceil(20 * self.encoders / self.gpu) / 20)

    def describe(self) -> str:
        return (
            f"worker peak {_size(self.worker)} + encoders {_size(self.encoders)} of a {_size(self.gpu)} GPU "
            f"(at most {HEADROOM:.0%})"
        )


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def encoder_bytes(cfg: JobConfig) -> int | None:
    """One encoder actor's memory: the family's encoder parts (the text encoders and the VAE: one actor holds them
    all) times :data:`ENCODER_MARGIN`. A local directory's are counted from the safetensors headers in ``model.dtype``;
    an object-storage model's are its files' bytes (their stored dtype: never less than they load in). None where
    nothing can be counted (a hub id, or a part without safetensors files)."""
    import os

    from rayflux import storage
    from rayflux.models import family, resolve_path
    from rayflux.models.facts import weight_files

    parts = family(cfg.model).encoder_parts
    if storage.is_uri(cfg.model.path):
        files = weight_files(cfg.model.path, list(parts))
        if {f[0] for f in files} != set(parts):
            return None
        return int(sum(f[2] for f in files) * ENCODER_MARGIN)
    root = resolve_path(cfg.model)
    counts = [parameters(os.path.join(root, part)) for part in parts]
    if None in counts:
        return None
    return int(sum(counts) * BYTES.get(cfg.model.dtype, 2) * ENCODER_MARGIN)


def worker_peak_bytes(cfg: JobConfig, gpu: int) -> int:
    """A training worker's peak on a ``gpu``-byte GPU, as the worker itself will estimate it
    (:func:`rayflux.gpu_memory.run_estimates`), its base counted whole."""
    import torch

    from rayflux.models import model_facts, read_config
    from rayflux.train import optim
    from rayflux.train.adapter.counts import base_counts, count_parameters

    t = cfg.train
    tc = read_config(cfg.model, "transformer")  # the model the job trains (``plan`` counts FLUX.1-dev for the tiny one)
    trainable = count_parameters(tc, t.adapter.targets, t.adapter.rank, t.adapter.kind, t.adapter.rank_pattern)[1]
    weights = int(gpu_memory.weight_bytes(base_counts(tc), t.base_dtype, BYTES.get(cfg.model.dtype, 2)))
    activations = torch.finfo(optim.autocast_dtype(t.mixed_precision, "cuda") or torch.float32).bits // 8
    text = model_facts(cfg.model).text_length
    without, with_, on = gpu_memory.run_estimates(
        cfg, tc, weights, trainable, text=text, activation_bytes=activations, device_bytes=gpu
    )
    return (with_ if on else without).total


def judge(cfg: JobConfig, gpu: int, cluster: dict) -> tuple[Sharing | None, str]:
    """``(the split of one ``gpu``-byte GPU, "")`` where a worker and an encoder actor both fit on it, else
    ``(None, why not)``. ``cluster``: the cluster's resources (where the validation renders would run)."""
    if cfg.train.validation.prompts:
        from rayflux.train.observe import renderer

        resources, _ = renderer.choose_resources(cfg, True, cluster)
        if renderer.gpu_share(resources):
            return None, "the validation renders already share each training GPU"
    if not gpu:
        return None, "no GPU answered with its memory"
    encoders = encoder_bytes(cfg)
    if encoders is None:
        return None, f"the encoders' weights in {cfg.model.path} cannot be counted (not a local safetensors folder)"
    split = Sharing(worker_peak_bytes(cfg, gpu), encoders, gpu)
    if not split.fits:
        return None, f"they do not fit one GPU: {split.describe()}"
    return split, ""


def with_share(cfg: JobConfig, share: float) -> JobConfig:
    """``cfg`` with each encoder actor reserving ``share`` of a GPU (``cache.gpus_per_actor``) for this build."""
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, gpus_per_actor=share))
