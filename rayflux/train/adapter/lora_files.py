"""The LoRA files a run leaves for its users: one per checkpoint, the final one, and their training metadata.

Every checkpoint's LoRA is also written as ``<output_dir>/lora/<name>-step00000500.safetensors`` in the chosen
format, outside Ray Train's checkpoint directories, so pruning old checkpoints (``train.checkpoint.keep``) never
removes them and users can pick the best step by eye, as with kohya's sd-scripts, SimpleTuner or ai-toolkit.

kohya files carry sd-scripts' ``ss_*`` training metadata and the Stability ``modelspec.*`` keys, which LoRA browsers
and ComfyUI managers show. The diffusers file keeps diffusers' own metadata (the peft config), which its loader reads.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections import Counter
from functools import cache

from rayflux import storage
from rayflux.config import JobConfig
from rayflux.config.optimizer import OPTIMIZERS
from rayflux.train.adapter import kohya, lora
from rayflux.train.resume.checkpoint import EMA_DIR

log = logging.getLogger(__name__)

LORA_DIR = "lora"
EMA_SUFFIX = "-ema"
"""What the EMA's LoRA files add to the plain files' stems."""
MAX_TAGS = 1000
"""Most frequent caption tags kept in ``ss_tag_frequency``: the metadata must stay small at a million captions."""


def output_name(cfg: JobConfig) -> str:
    """The stem of every exported LoRA file: ``train.checkpoint.output_name``, else ``run.name``."""
    return cfg.train.checkpoint.output_name or cfg.run.name


def final_name(cfg: JobConfig) -> str:
    """The final LoRA's file name: ``<name>.safetensors`` for kohya; diffusers' default name, which
    ``load_lora_weights(<dir>)`` finds without a ``weight_name``, for diffusers."""
    return f"{output_name(cfg)}.safetensors" if cfg.train.checkpoint.output_format == "kohya" else lora.WEIGHT_NAME


def step_name(cfg: JobConfig, step: int, ema: bool = False) -> str:
    return f"{output_name(cfg)}-step{step:08d}{EMA_SUFFIX if ema else ''}.safetensors"


def ema_name(cfg: JobConfig) -> str:
    """The final EMA LoRA's file name (``train.optim.ema_decay``), in ``train.checkpoint.output_format``, beside the plain one."""
    return f"{output_name(cfg)}{EMA_SUFFIX}.safetensors"


def _checkpoint_file(cfg: JobConfig) -> str:
    return kohya.KOHYA_NAME if cfg.train.checkpoint.output_format == "kohya" else lora.WEIGHT_NAME


@cache
def _architecture(model_path: str, revision: str) -> tuple[str, str, str, str]:
    """sd-scripts' architecture, base model version, implementation and network module of the model's family
    (``flux-1-dev``, ``flux1``, BFL's repository, ``networks.lora_flux``)."""
    from rayflux import models
    from rayflux.config import ModelConfig

    cfg = ModelConfig(path=model_path, revision=revision)
    family = models.family(cfg)
    facts = models.model_facts(cfg)
    return facts.architecture, family.base_model_version, family.implementation, family.network_module


@cache
def tag_frequency(caption_tables: tuple[str, ...]) -> dict[str, int]:
    """The ``MAX_TAGS`` most frequent tags over the cached captions: the caption column of each file, split and
    counted with Arrow compute (no Python loop per caption: a million captions take seconds, once per process)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    counts: Counter = Counter()
    for path in caption_tables:
        fs, inner = storage.resolve(path)
        column = pq.read_table(inner, columns=["caption"], filesystem=fs).column("caption")
        tags = pc.utf8_trim_whitespace(pc.list_flatten(pc.split_pattern(column.combine_chunks(), ",")))
        tags = tags.filter(pc.not_equal(tags, ""))
        for entry in pc.value_counts(tags).to_pylist():
            counts[entry["values"]] += entry["counts"]
    return dict(counts.most_common(MAX_TAGS))


LYCORIS_ARGS = {
    "dora": {"algo": "lora", "dora_wd": "True", "wd_on_output": "True"},
    "lokr": {"algo": "lokr", "factor": "-1"},
}
"""LyCORIS ``network_args`` of the adapters only LyCORIS (``lycoris.kohya``) writes in kohya files: DoRA's
magnitude on the output axis as peft trains it, LoKr with LyCORIS's and peft's default factorisation."""


def network(adapter: str, family_module: str) -> dict:
    """``ss_network_module`` (and ``ss_network_args``) of a kohya file of ``train.adapter.kind``: the family's LoRA module,
    else ``lycoris.kohya`` with its algorithm."""
    if adapter not in LYCORIS_ARGS:
        return {"ss_network_module": family_module}
    return {"ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps(LYCORIS_ARGS[adapter])}


def kohya_metadata(cfg: JobConfig, step: int, epoch: int, tags: dict[str, int]) -> dict[str, str]:
    """sd-scripts' ``ss_*`` keys and ``modelspec.*`` for a LoRA trained by ``cfg``, saved at ``step``."""
    from rayflux import datasets
    from rayflux.models import resolve_path

    t, d = cfg.train, cfg.data
    base = resolve_path(cfg.model)
    arch, version, implementation, network_module = _architecture(cfg.model.path, cfg.model.revision)
    now = datetime.datetime.now(datetime.timezone.utc)
    dirs = {datasets.label(ds): {"n_repeats": ds.repeats} for ds in datasets.datasets_of(d)}
    res = f"{d.resolution}x{d.resolution}"
    meta = {
        "ss_output_name": output_name(cfg),
        "ss_base_model_version": version,
        "ss_sd_model_name": os.path.basename(base.rstrip("/")) or base,
        **network(t.adapter.kind, network_module),
        "ss_network_dim": t.adapter.rank,
        # The training alpha; the file's own alpha tensors equal their rank because alpha/rank is baked into up.
        "ss_network_alpha": t.adapter.alpha,
        "ss_network_dropout": t.adapter.lora_dropout,
        "ss_training_comment": f"alpha/rank is baked into {'lokr_w1' if t.adapter.kind == 'lokr' else 'lora_up'}; "
        "alpha tensors equal their rank (strength 1)",
        "ss_resolution": f"({d.resolution}, {d.resolution})",
        "ss_enable_bucket": True,
        "ss_learning_rate": t.optim.learning_rate,
        "ss_unet_lr": t.optim.learning_rate,
        "ss_lr_scheduler": t.optim.lr_scheduler,
        "ss_lr_warmup_steps": t.optim.warmup_steps,
        "ss_optimizer": OPTIMIZERS[t.optim.name].cls,
        "ss_max_grad_norm": t.optim.max_grad_norm,
        "ss_seed": t.seed,
        "ss_gradient_accumulation_steps": t.gradient_accumulation,
        "ss_gradient_checkpointing": t.gradient_checkpointing,
        "ss_mixed_precision": t.mixed_precision,
        "ss_caption_dropout_rate": t.flow.caption_dropout,
        "ss_cache_latents": True,
        "ss_timestep_sampling": t.flow.sigma_sampling,
        "ss_guidance_scale": t.flow.guidance,
        "ss_num_epochs": t.epochs,
        "ss_max_train_steps": t.max_steps,
        "ss_steps": step,
        "ss_epoch": epoch + 1,
        "ss_dataset_dirs": json.dumps(dirs),
        "ss_tag_frequency": json.dumps({output_name(cfg): tags}),
        "ss_training_finished_at": now.timestamp(),
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": f"{arch}/lora",
        "modelspec.implementation": implementation,
        "modelspec.title": f"{output_name(cfg)} (step {step})",
        "modelspec.resolution": res,
        "modelspec.date": now.date().isoformat(),
    }
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}


def _file_bytes(checkpoint_dir: str, cfg: JobConfig, step: int, epoch: int, caption_tables: tuple[str, ...]) -> bytes:
    src = os.path.join(checkpoint_dir, _checkpoint_file(cfg))
    if cfg.train.checkpoint.output_format != "kohya":
        with open(src, "rb") as f:
            return f.read()
    from safetensors.torch import load_file, save

    return save(load_file(src), metadata=kohya_metadata(cfg, step, epoch, tag_frequency(caption_tables)))


def keep_step(checkpoint_dir: str, cfg: JobConfig, output_dir: str, record: dict, caption_tables=()) -> str:
    """Write the checkpoint's LoRA as ``<output_dir>/lora/<name>-step<step>.safetensors`` (rank 0, after a checkpoint
    is written). Returns its path."""
    step = int(record["step"])
    dest = storage.join(output_dir, LORA_DIR, step_name(cfg, step))
    data = _file_bytes(checkpoint_dir, cfg, step, int(record.get("epoch", 0)), tuple(caption_tables))
    storage.write_bytes_atomic(dest, data)
    ema_dir = os.path.join(checkpoint_dir, EMA_DIR)
    if os.path.isdir(ema_dir):
        data = _file_bytes(ema_dir, cfg, step, int(record.get("epoch", 0)), tuple(caption_tables))
        storage.write_bytes_atomic(storage.join(output_dir, LORA_DIR, step_name(cfg, step, ema=True)), data)
    return dest


def export_final(checkpoint_dir: str, cfg: JobConfig, output_dir: str, caption_tables=()) -> str:
    """Write the final checkpoint's LoRA as ``<output_dir>/lora/<final_name>``, and its EMA's (``train.optim.ema_decay``)
    as ``<output_dir>/lora/<ema_name>``. Returns the plain file's path."""
    from rayflux.train.resume.commits import POSITION_FILE

    with open(os.path.join(checkpoint_dir, POSITION_FILE)) as f:
        saved = json.load(f)
    step, epoch = int(saved["step"]), int(saved.get("epoch", 0))
    dest = storage.join(output_dir, LORA_DIR, final_name(cfg))
    storage.write_bytes_atomic(dest, _file_bytes(checkpoint_dir, cfg, step, epoch, tuple(caption_tables)))
    ema_dir = os.path.join(checkpoint_dir, EMA_DIR)
    if os.path.isdir(ema_dir):
        data = _file_bytes(ema_dir, cfg, step, epoch, tuple(caption_tables))
        storage.write_bytes_atomic(storage.join(output_dir, LORA_DIR, ema_name(cfg)), data)
    return dest


def best_name(cfg: JobConfig) -> str:
    return f"{output_name(cfg)}-best.safetensors"


def diffusers_bytes(trainer) -> bytes:
    """The live LoRA as the bytes of a diffusers-format file (:func:`rayflux.train.adapter.lora.save_diffusers`)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rayflux-live-") as tmp:
        with open(lora.save_diffusers(trainer.transformer, tmp), "rb") as f:
            return f.read()


def _live_bytes(trainer, cfg: JobConfig, record: dict, caption_tables=()) -> bytes:
    """The live LoRA as the bytes of an exported file in ``train.checkpoint.output_format`` (with kohya metadata)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rayflux-live-") as tmp:
        lora.save_diffusers(trainer.transformer, tmp)
        if cfg.train.checkpoint.output_format == "kohya":
            kohya.save(trainer.transformer, tmp, lora.scale(trainer.transformer))
        return _file_bytes(tmp, cfg, int(record["step"]), int(record.get("epoch", 0)), tuple(caption_tables))


def keep_live_step(trainer, cfg: JobConfig, output_dir: str, record: dict, caption_tables=()) -> str:
    """Write the live LoRA as ``<output_dir>/lora/<name>-step<step>.safetensors``: the file a checkpoint at this step
    would leave (rank 0, for a validation render at a step without a checkpoint). Returns its path."""
    dest = storage.join(output_dir, LORA_DIR, step_name(cfg, int(record["step"])))
    storage.write_bytes_atomic(dest, _live_bytes(trainer, cfg, record, caption_tables))
    return dest


BEST_STEP_KEY = "rayflux.best_step"
BEST_EVAL_KEY = "rayflux.best_eval_loss"
"""Safetensors metadata of the best file: the step and eval loss of the LoRA it holds, written with it in one atomic
write, so they always describe that file's tensors (``-best.json`` is a second write, which a worker ended between
the two leaves stale)."""


def with_metadata(data: bytes, extra: dict[str, str]) -> bytes:
    """A safetensors file's bytes with ``extra`` added to its header's metadata; the tensors' bytes as they are (their
    offsets count from the header's end)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    header["__metadata__"] = {**header.get("__metadata__", {}), **extra}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes with spaces
    return len(raw).to_bytes(8, "little") + raw + data[8 + size :]


def best_recorded(path: str) -> tuple[int, float] | None:
    """(step, eval loss) of the LoRA a best file holds, from its own metadata (None: a file without it)."""
    data = storage.read_bytes(path)
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")]).get("__metadata__", {})
    return (int(meta[BEST_STEP_KEY]), float(meta[BEST_EVAL_KEY])) if BEST_STEP_KEY in meta else None


def keep_best(trainer, cfg: JobConfig, output_dir: str, record: dict, caption_tables=()) -> str:
    """Write the live LoRA as ``<output_dir>/lora/<name>-best.safetensors`` (rank 0, when an eval loss is the lowest so
    far), its step and eval loss in its metadata (:func:`best_recorded`), and ``<name>-best.json`` naming them too.
    Written from the live weights at eval time, so no checkpoint has to be kept for it: ``train.checkpoint.keep``
    may prune every checkpoint of that step. Written before the step's record is logged: a worker ended in between
    leaves an eval that only this file records."""
    step = int(record["step"])
    best = {BEST_STEP_KEY: str(step), BEST_EVAL_KEY: repr(float(record["eval_loss"]))}
    data = with_metadata(_live_bytes(trainer, cfg, record, caption_tables), best)
    dest = storage.join(output_dir, LORA_DIR, best_name(cfg))
    storage.write_bytes_atomic(dest, data)
    note = {"step": step, "eval_loss": record["eval_loss"], "file": best_name(cfg)}
    storage.write_bytes_atomic(
        storage.join(output_dir, LORA_DIR, f"{output_name(cfg)}-best.json"), json.dumps(note).encode()
    )
    return dest
