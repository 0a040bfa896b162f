"""``train.base_dtype`` on a worker: the frozen transformer in bf16, with torchao's float8 matmuls, or in
bitsandbytes' 4-bit NF4 (the QLoRA recipe).

- ``nf4`` happens at load: ``from_pretrained`` gets a ``BitsAndBytesConfig`` and quantizes every Linear weight as
  it loads them (:func:`load_kwargs`).
- ``fp8`` happens after the LoRA is attached: ``convert_to_float8_training`` swaps the frozen Linear layers for
  torchao's ``Float8Linear`` through a module filter (:func:`fp8_target`) that sees, and skips, peft's LoRA layers.

**Why the LoRA file does not change.** Neither path touches a LoRA layer: peft puts ``lora_A``/``lora_B`` beside
the base layer, whatever its class; :func:`rayflux.train.adapter.lora.add_lora` keeps them in fp32, and the filter below
never converts them. The saved file holds only those tensors under peft's names (``<module>.lora_A.weight``), which
name the module, not the class of its base layer. So an fp8 or NF4 run writes the keys and fp32 tensors a bf16 run
writes, and its LoRA loads on the bf16 base as it is.

Each worker checks that it can run the choice before it loads anything (:func:`check_worker`): a CUDA device, the
GPU's compute capability, the package.
"""

from __future__ import annotations

import importlib.util
import logging
import math

from rayflux.config.base_dtype import NEEDS, refusal
from rayflux.gpu_memory import BaseCounts

log = logging.getLogger(__name__)

FP8_ALIGN = 16
"""fp8 matmuls (``torch._scaled_mm``) need both sides of a weight to be multiples of 16."""


def check_worker(base_dtype: str, device) -> None:
    """Refuse, in one line, a ``base_dtype`` this worker cannot run: no CUDA device, an older GPU, no package."""
    if base_dtype not in NEEDS:
        return
    import torch

    dev = torch.device(device)
    gpu = dev.type == "cuda"
    capability = torch.cuda.get_device_capability(dev) if gpu else None
    installed = importlib.util.find_spec(NEEDS[base_dtype][0]) is not None
    reason = refusal(base_dtype, gpu=gpu, capability=capability, installed=installed)
    if reason:
        raise RuntimeError(reason)


def load_kwargs(base_dtype: str) -> dict:
    """Extra ``from_pretrained`` arguments of the transformer: NF4 quantization for ``nf4`` (bf16 compute, as in
    diffusers' QLoRA recipe), nothing otherwise."""
    if base_dtype != "nf4":
        return {}
    import torch
    from diffusers import BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    return {"quantization_config": config}


def is_lora(name: str) -> bool:
    """A module of peft's adapter (``...to_q.lora_A.default``), not of the base model."""
    return any(part.startswith("lora_") for part in name.split("."))


def fp8_target(module, name: str) -> bool:
    """torchao's module filter: a frozen Linear of the base model with sides that are multiples of 16; never a LoRA
    layer (those train in fp32 and must stay as they are)."""
    import torch

    if not isinstance(module, torch.nn.Linear) or is_lora(name) or module.weight.requires_grad:
        return False
    return module.in_features % FP8_ALIGN == 0 and module.out_features % FP8_ALIGN == 0


def convert(transformer, base_dtype: str, emulate: bool = False) -> int:
    """Apply ``fp8`` to a transformer that already carries its LoRA; returns how many Linear layers were swapped
    (0 for bf16, and for nf4, which is settled at load and only checked here). ``emulate``: torchao's emulation of the fp8 matmuls, which
    runs on CPU (tests)."""
    if base_dtype == "nf4" and not getattr(transformer, "is_quantized", False):
        # A transformer built elsewhere (not through load_kwargs) would otherwise train as bf16 under an nf4 label.
        raise ValueError(
            "train.base_dtype=nf4 quantizes the transformer as it loads (models.load_transformer with "
            "base_weights.load_kwargs); this one was given unquantized"
        )
    if base_dtype != "fp8":
        return 0
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # Dynamic tensorwise scales (torchao's default recipe): each matmul casts its weight and input to fp8 with one
    # scale each; the bf16 weight itself is kept, so this speeds the matmuls rather than shrinking the base.
    # Its backward also computes each frozen weight's gradient (torchao 0.18 always does; autograd drops it): the
    # fp8 step pays three GEMMs per frozen Linear where bf16 pays two.
    config = Float8LinearConfig(emulate=emulate)
    convert_to_float8_training(transformer, module_filter_fn=fp8_target, config=config)
    swapped = sum(type(m).__name__ == "Float8Linear" for m in transformer.modules())
    log.info("train.base_dtype=fp8: %d frozen Linear layers run torchao float8 matmuls", swapped)
    return swapped


def elements(param) -> int:
    """Elements a parameter stands for: bitsandbytes packs two 4-bit values a byte, and its ``quant_state`` keeps the
    original shape."""
    state = getattr(param, "quant_state", None)
    return math.prod(state.shape) if state is not None else param.numel()


def counts(transformer) -> BaseCounts:
    """The frozen base's parameter counts (every parameter but the LoRA's), as the memory plan needs them
    (:mod:`rayflux.gpu_memory`): all of them, the Linear weights (what ``base_dtype`` stores differently from the
    biases and norms kept in the model's dtype), the largest Linear weight and the largest transformer block (what
    FSDP2 gathers whole). A meta, loaded, quantized or sharded transformer counts the same (a shard counts whole)."""
    import torch

    def frozen(module) -> int:
        return sum(elements(p) for n, p in module.named_parameters() if not is_lora(n))

    linears = [
        elements(m.weight) for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear) and not is_lora(n)
    ]
    blocks = [
        frozen(block) for child in transformer.children() if isinstance(child, torch.nn.ModuleList) for block in child
    ]
    return BaseCounts(frozen(transformer), sum(linears), max(linears, default=0), max(blocks, default=0))
