"""The training process leaves cuDNN's SDPA kernel out of the choice on CUDA (its backward faulted on FLUX.1's
attention on an H100: rayflux/train/attention.py), and changes nothing for a CPU trainer."""

import torch

from rayflux.train import attention


def _restore(enabled: bool) -> None:
    torch.backends.cuda.enable_cudnn_sdp(enabled)


def test_cuda_device_turns_cudnn_sdp_off():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        attention.exclude_faulting_kernels(torch.device("cuda", 0))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        # The other kernels stay available: flash and memory-efficient cover FLUX's shapes.
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        _restore(before)


def test_cpu_device_leaves_the_choice_alone():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        attention.exclude_faulting_kernels(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        _restore(before)
