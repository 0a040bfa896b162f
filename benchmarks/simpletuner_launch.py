"""Run SimpleTuner's trainer (``simpletuner.train``) on a CPU-only Python 3.11 venv, with four shims applied first.

    CONFIG_BACKEND=json CONFIG_PATH=config.json /tmp/st311/bin/python benchmarks/simpletuner_launch.py

Run by ``benchmarks/simpletuner_side.py`` under SimpleTuner's own interpreter (never rayflux's); it imports nothing
of rayflux. The shims change nothing that a FLUX LoRA run on the CPU uses; each one only lets an import or a CPU
tensor pass where SimpleTuner assumes CUDA or Python 3.12's wheels:

- ``torchvision::nms``/``qnms`` schemas: PyPI's torchvision 0.28 is a CUDA build whose compiled ops cannot load beside
  torch 2.13's CPU build, and its ``_meta_registrations`` registers fake kernels for those two ops unconditionally
  ("operator torchvision::nms does not exist"). Defining the two schemas lets that registration attach; the ops
  themselves stay without a kernel (detection ops, never called by a FLUX run).
- torchaudio's compiled extension: torchaudio 2.11 (the newest on PyPI) cannot load its library beside torch 2.13, and
  its ``_load_lib`` raises instead of reporting "not built". SimpleTuner's option registry imports every model family,
  audio ones included, so ``import torchaudio`` must succeed; with the extension reported missing torchaudio's Python
  parts import as they do in a build without it.
- skrample (SimpleTuner's scheduled-sampling rollouts): its sources use Python 3.12's generic syntax
  (``def find[T: ...]``), a SyntaxError on 3.11, and SimpleTuner's trainer imports it at module level. Only
  scheduled sampling (off by default, off here) calls it, so when the real package cannot compile it is replaced by
  a stub whose every attribute raises ImportError: a run that needed it would fail loudly, not silently differ.
- ``Tensor.pin_memory``: SimpleTuner's collate pins every batch without checking for CUDA, which fails on a CPU-only
  torch; without CUDA it returns the tensor as is (what pinning buys is host-to-GPU copies, and there is no GPU).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import runpy
import sys
import types

import torch


def _define_torchvision_schemas() -> None:
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _KEEP.append(lib)  # a Library object deregisters its definitions when collected


_KEEP: list = []


class _PatchTorchaudioLoader(importlib.abc.MetaPathFinder):
    """When ``torchaudio._extension.utils`` is imported, wrap its ``_load_lib`` so that a library that cannot be
    loaded reads as absent (False), as in a torchaudio built without its extension."""

    NAME = "torchaudio._extension.utils"

    def find_spec(self, name, path, target=None):
        if name != self.NAME:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            load = module._load_lib

            def load_or_absent(lib: str) -> bool:
                try:
                    return load(lib)
                except OSError:
                    return False

            module._load_lib = load_or_absent

        spec.loader.exec_module = exec_and_patch
        return spec


def _stub_skrample_if_it_cannot_compile() -> None:
    try:
        import skrample.scheduling  # noqa: F401
    except SyntaxError as err:
        reason = f"skrample cannot compile on Python {sys.version_info[:2]} ({err.msg}); scheduled sampling needs it"

        def missing(name: str):
            if name.startswith("__"):  # inspect and import machinery probe dunders with hasattr
                raise AttributeError(name)
            raise ImportError(reason)

        for name in ("skrample", "skrample.scheduling"):
            sys.modules.pop(name, None)
            module = types.ModuleType(name)
            module.__getattr__ = missing
            sys.modules[name] = module
        sys.modules["skrample"].scheduling = sys.modules["skrample.scheduling"]


def _pin_memory_without_cuda() -> None:
    if torch.cuda.is_available():
        return
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


def main() -> None:
    _define_torchvision_schemas()
    sys.meta_path.insert(0, _PatchTorchaudioLoader())
    _stub_skrample_if_it_cannot_compile()
    _pin_memory_without_cuda()
    runpy.run_module("simpletuner.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
