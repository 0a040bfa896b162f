"""Tensor <-> bytes for shard columns. Each row's bytes are a fresh, C-contiguous copy of that row alone.

A batch-sliced tensor can keep the whole batch's storage alive (SimpleTuner saved each latent with its batch, 7x the
size), and VAE latents come back channels-last, so ``.clone()`` alone keeps the wrong memory order. ``to_bytes``
always makes a contiguous copy of exactly one sample.
"""

from __future__ import annotations

import numpy as np

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def to_bytes(t, dtype: str) -> bytes:
    """Serialise one sample's tensor (any device, any layout) as C-order little-endian bytes of ``dtype``."""
    import torch

    t = t.detach().to("cpu", getattr(torch, dtype)).contiguous()
    if dtype == "bfloat16":
        # numpy has no bfloat16: ship its raw 16-bit patterns.
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def from_bytes_numpy(data: bytes, dtype: str, shape) -> np.ndarray:
    """Rebuild a float32 numpy array with plain numpy (no torch, no Ray): what any pyarrow reader can do."""
    if dtype == "bfloat16":
        bits = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape)
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape).astype(np.float32)


def from_bytes(data: bytes, dtype: str, shape):
    """Rebuild a torch tensor in its stored dtype."""
    import torch

    if dtype == "bfloat16":
        raw = torch.frombuffer(bytearray(data), dtype=torch.int16)
        return raw.view(torch.bfloat16).reshape(shape)
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)


def nbytes(shape, dtype: str) -> int:
    n = ITEMSIZE[dtype]
    for s in shape:
        n *= int(s)
    return n
