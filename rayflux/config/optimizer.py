"""``train.optim.name``: the choices, the package and ``rayflux[...]`` extra each needs, and the one-line reason one is
refused where it cannot run.

Pure rules (no imports of the optimizers' packages), shared by the config check (``train.workers.on_gpu=false``: known
before any work), the driver once it has seen the cluster (no GPU in it: refused before the cache stage) and each
worker as it builds the optimizer (:mod:`rayflux.train.optim`: the package must import there).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerSpec:
    """What one ``train.optim.name`` value needs."""

    package: str
    """The module it imports (only when chosen)."""
    extra: str
    """The ``rayflux[...]`` extra that installs it; empty for torch's own."""
    cls: str
    """The class, as sd-scripts writes it in ``ss_optimizer`` (and accepts as ``optimizer_type``)."""
    gpu_only: str = ""
    """Why it needs a CUDA GPU (empty: runs anywhere)."""


OPTIMIZERS = {
    "adamw": OptimizerSpec("torch", "", "torch.optim.AdamW"),
    "adamw8bit": OptimizerSpec(
        "bitsandbytes", "adamw8bit", "bitsandbytes.optim.AdamW8bit", "bitsandbytes' 8-bit optimizer kernels"
    ),
    "prodigy": OptimizerSpec("prodigyopt", "prodigy", "prodigyopt.Prodigy"),
    "adafactor": OptimizerSpec("transformers", "", "transformers.optimization.Adafactor"),
    "schedulefree_adamw": OptimizerSpec("schedulefree", "schedulefree", "schedulefree.AdamWScheduleFree"),
}
"""``train.optim.name`` values and what each needs. ``adamw8bit`` takes the same bitsandbytes as the ``nf4`` extra;
transformers is a core dependency (diffusers' text encoders)."""


SPELLINGS = {
    "adamwschedulefree": "schedulefree_adamw",  # kohya's optimizer_type
    "adamw_schedulefree": "schedulefree_adamw",  # SimpleTuner
    "bnb-adamw8bit": "adamw8bit",  # SimpleTuner
    **{spec.cls.lower(): name for name, spec in OPTIMIZERS.items()},  # kohya's full class names
}
"""Other trainers' spellings of the same optimizers (matched without regard to case, so kohya's ``AdamW8bit``,
``Prodigy`` and ``Adafactor`` are accepted as they are written there)."""


def canonical(optimizer: str) -> str:
    """``train.optim.name`` in rayflux's spelling (see :data:`SPELLINGS`); unknown names come back as given."""
    low = str(optimizer).strip().lower()
    return SPELLINGS.get(low, low if low in OPTIMIZERS else optimizer)


def refusal(optimizer: str, *, gpu: bool, installed: bool = True) -> str:
    """Why ``optimizer`` cannot run here, in one line; empty when it can. ``gpu``: the run trains on CUDA GPUs;
    ``installed``: its package imports."""
    spec = OPTIMIZERS.get(optimizer)
    if spec is None:
        return ""  # an unknown name is the choice check's to report
    key = f"train.optim.name={optimizer}"
    if spec.gpu_only and not gpu:
        return (
            f"{key} needs a CUDA GPU ({spec.gpu_only}); this run trains on CPU (train.workers.on_gpu=false, no GPU in "
            "the cluster, or none on this worker); use adamw"
        )
    if not installed:
        how = f"pip install 'rayflux[{spec.extra}]'" if spec.extra else f"pip install {spec.package}"
        return f"{key} needs {spec.package}, which is not installed: {how}"
    return ""
