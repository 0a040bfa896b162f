"""Which device this process computes on: cuda only where it holds a GPU."""

from __future__ import annotations


def choose_device(cuda_available: bool, in_ray_worker: bool, ray_gpu_ids: list) -> str:
    """cuda only where this process holds a GPU. A Ray worker that reserved no GPU still sees the node's GPUs (Ray
    2.60 leaves ``CUDA_VISIBLE_DEVICES`` alone for it), so there only Ray's GPU ids count."""
    if not cuda_available:
        return "cpu"
    if in_ray_worker:
        return "cuda" if ray_gpu_ids else "cpu"
    return "cuda"


def default_device() -> str:
    """The device for this process: see :func:`choose_device`."""
    import torch

    in_worker, gpu_ids = False, []
    try:
        import ray

        if ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE:
            in_worker, gpu_ids = True, list(ray.get_gpu_ids())
    except ImportError:
        pass
    return choose_device(torch.cuda.is_available(), in_worker, gpu_ids)
