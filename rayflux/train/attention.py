"""Which scaled-dot-product attention kernels the training step may use.

PyTorch picks an SDPA kernel per call among flash, memory-efficient, cuDNN and math. On an H100 with torch 2.11
(CUDA 13.0, cuDNN 9.19), the cuDNN kernel it chose for FLUX.1's joint attention (512 text + 1,024 image tokens,
24 heads x 128, bf16) failed in the backward with ``CUDA error: an illegal memory access`` (anomaly mode traced
it to ``mha_graph.execute``), on the first step, which kills the worker and the run; the same step under flash,
memory-efficient or math trained (benchmarks/bench_gpu.py, BENCHMARKS.md "GPU step time and MFU"). The flash and
memory-efficient kernels cover these shapes, so cuDNN's is taken out of the choice for training.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)


def exclude_faulting_kernels(device: torch.device) -> None:
    """Leave cuDNN's SDPA kernel out of this process's choice on CUDA (see the module docstring). A process-wide
    switch, because the backward runs the kernel the forward chose and a context around the forward is not enough
    once checkpointing re-runs it."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return
    torch.backends.cuda.enable_cudnn_sdp(False)
    log.info("cuDNN's attention kernel left out of SDPA's choice (its backward faults on FLUX shapes)")
