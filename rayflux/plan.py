"""``python -m rayflux plan``: the memory plan of a training run, printed for the job's settings.

``python -m rayflux plan [--config FILE] [--set KEY=VALUE ...] [--model NAME] [--gpus-per-node N]`` reads only the
transformer's ``config.json`` from ``model.path`` (a built-in configuration when ``model.path`` is empty, or the one
``--model`` names, e.g. ``flux2-dev``: :data:`rayflux.families.BUILT_IN`), so it needs no weights and no GPU. It
counts the parameters of the family's own transformer built on the meta device (:func:`rayflux.models.
meta_transformer`), and prints what weights, the LoRA with its ``train.optim.name`` state, and activations (with
and without gradient checkpointing) take on a GPU (:mod:`rayflux.gpu_memory`, the same figures every training
worker computes for its run), ending with each ``train.workers.base_fsdp`` x ``train.base_dtype`` option's memory per GPU.

A command like ``doctor``: nothing else of rayflux imports this module.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from rayflux import config, families, gpu_memory, preservation
from rayflux.config import token_routing
from rayflux.config.base_dtype import refusal
from rayflux.config.train import checkpointing_setting
from rayflux.gpu_memory import GIB, BaseCounts
from rayflux.train.adapter import lora, targets
from rayflux.train.adapter.counts import base_counts, count_parameters


def text_tokens(cfg: config.JobConfig) -> int:
    """Text tokens per sample: ``model.text_tokens``, else the padded length the model's family encodes every
    caption to, or the default built-in model's when ``model.path`` is empty."""
    if not cfg.model.path:
        tc = families.BUILT_IN[families.DEFAULT_BUILT_IN][0]
        return families.of_transformer_config(tc).text_length(tc, cfg.model.text_tokens)
    from rayflux.models import model_facts

    return model_facts(cfg.model).text_length


def selected_modules(tc: dict, spec: str) -> list[str]:
    """The full names of the modules ``train.targets`` ``spec`` gives an adapter (on the meta device)."""
    from rayflux.models import meta_transformer

    return lora.resolve_targets(meta_transformer(tc), spec)


def target_lines(tc: dict, spec: str, trainable: int) -> list[str]:
    """What the job's ``train.targets`` trains: its module count and parameters, then the modules per block range."""
    modules = selected_modules(tc, spec)
    prefixes = families.of_transformer_config(tc).lora_blocks
    head = f"  this job's targets={spec!r}: {len(modules)} modules, {trainable:,} trainable parameters"
    return [head] + [f"    {line}" for line in targets.summary(modules, prefixes)]


def transformer_config(cfg: config.JobConfig, model: str = "") -> tuple[dict, str]:
    """The transformer's config (from ``model.path``'s config.json alone, or the built-in ``model``) and a name."""
    if model or not cfg.model.path:
        tc, name = families.BUILT_IN[model or families.DEFAULT_BUILT_IN]
        return dict(tc), f"{name} (built-in config)"
    from rayflux.models import read_config

    return read_config(cfg.model, "transformer"), cfg.model.path


def option_lines(
    counts: BaseCounts,
    fixed_bytes: int,
    activations: Callable[[int, int, bool], int],
    workers: int,
    float_bytes: int = 2,
) -> list[str]:
    """The option table: GiB per GPU for each base_sharding x base_dtype at 512 and 1024 px, batch 1-4, gradient
    checkpointing off / on. ``fixed_bytes``: the LoRA with its optimizer state; ``activations(px, batch,
    checkpointing)``: bytes of one process's activations."""
    lines = [
        f"per-GPU memory by option (GiB, gradient checkpointing off / on; node: {workers} workers a node)",
        "  sharding dtype px    " + "".join(f"batch {b:<9}" for b in (1, 2, 3, 4)).rstrip(),
    ]
    refused = {}
    for sharding in gpu_memory.SHARDINGS:
        for dtype in gpu_memory.DTYPES:
            reason = refusal(dtype, gpu=True, sharding=sharding)
            if reason:
                refused[f"{sharding}/{dtype}"] = reason
                continue
            base = gpu_memory.per_gpu_weight_bytes(counts, dtype, sharding, workers, float_bytes) + fixed_bytes
            for px in (512, 1024):
                off_on = [[(base + activations(px, b, c)) / GIB for c in (False, True)] for b in (1, 2, 3, 4)]
                cells = [f"{off:5.1f} / {on:<5.1f}" for off, on in off_on]
                lines.append((f"  {sharding:<8} {dtype:<5} {px:<5} " + " ".join(cells)).rstrip())
    lines += [f"  {key}: refused ({reason})" for key, reason in refused.items()]
    return lines


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def report(cfg: config.JobConfig, model: str = "", workers_per_node: int = 8) -> list[str]:
    """The plan's lines: parameters per preset, memory at 512 and 1024 px, batch 1-4, then per GPU for each
    base_sharding x base_dtype option. ``model``: a built-in config instead of the job's model."""

    tc, name = transformer_config(cfg, model)
    t = cfg.train
    text = families.of_transformer_config(tc).text_length(tc, cfg.model.text_tokens) if model else text_tokens(cfg)
    float_bytes = 4 if cfg.model.dtype == "float32" else 2
    lines = [
        f"model: {name}; {tc['num_layers']} double + {tc['num_single_layers']} single blocks, "
        f"width {gpu_memory.widths(tc)[0]}, {text} text tokens; {t.adapter.kind} rank {t.adapter.rank}"
    ]
    counts = {}
    for preset in lora.PRESETS:
        counts[preset] = count_parameters(tc, preset, t.adapter.rank, t.adapter.kind)
        total, trainable = counts[preset]
        lines.append(f"  targets={preset}: {trainable:,} trainable of {total:,} ({100 * trainable / total:.3f}%)")
    job_targets = t.adapter.targets if t.adapter.targets in counts else None
    if job_targets and not t.adapter.rank_pattern:
        trainable = counts[job_targets][1]
    else:
        trainable = count_parameters(tc, t.adapter.targets, t.adapter.rank, t.adapter.kind, t.adapter.rank_pattern)[1]
    lines += target_lines(tc, t.adapter.targets, trainable)
    base = base_counts(tc)
    weights = int(gpu_memory.per_gpu_weight_bytes(base, t.base_dtype, "none", 1, float_bytes))  # the whole base
    ema = bool(t.optim.ema_decay)
    lora_bytes = int(trainable * gpu_memory.lora_bytes_per_param(t.optim.name, t.adapter.rank, ema))
    lines.append(
        f"memory per GPU process (GiB) for targets={t.adapter.targets}, base_dtype={t.base_dtype}: weights "
        f"{_gib(weights)}, LoRA + {t.optim.name}{' + EMA' if ema else ''} {_gib(lora_bytes)}"
    )
    lines.append("  px    batch  activations (no ckpt / ckpt)  total (no ckpt / ckpt)")
    opt = {"text": text, "optimizer": t.optim.name, "rank": t.adapter.rank, "ema": ema}
    for px in (512, 1024):
        for batch in (1, 2, 3, 4):
            off, on = (gpu_memory.estimate(tc, weights, trainable, px, batch, c, **opt) for c in (False, True))
            lines.append(
                f"  {px:<5} {batch:<6} {_gib(off.activations):>8} / {_gib(on.activations):<8}"
                f"             {_gib(off.total):>8} / {_gib(on.total)}"
            )
    job = gpu_memory.estimate(tc, weights, trainable, cfg.data.resolution, t.batch_size, False, **opt)
    ckpt = gpu_memory.gradient_checkpointing(
        checkpointing_setting(t.gradient_checkpointing), True, cfg.data.resolution, job.total, 80 * 10**9
    )

    def activations(px: int, batch: int, checkpointing: bool) -> int:
        return gpu_memory.estimate(tc, 0, 0, px, batch, checkpointing, text=text).activations

    lines += option_lines(base, lora_bytes, activations, workers_per_node, float_bytes)
    lines += routing_lines(t.token_routing, tc, text)
    lines.append(
        f"this job on an 80 GB GPU: {cfg.data.resolution} px, batch {t.batch_size}, gradient checkpointing "
        f"{'on' if ckpt else 'off'} ({t.gradient_checkpointing}), base_dtype {t.base_dtype}, "
        f"base_sharding {t.workers.base_fsdp}"
    )
    lines += _preservation_lines(t, cfg.data.resolution, ckpt, activations)
    return lines


def _preservation_lines(t, px: int, ckpt: bool, activations: Callable[[int, int, bool], int]) -> list[str]:
    """Forwards per step and the activations output preservation holds (issue 45), when it is on."""
    if t.flow.preservation == "none":
        return []
    batch = t.batch_size * preservation.graphs(t.flow.preservation)
    return [
        preservation.cost(t.flow.preservation),
        f"  activations at {px} px, batch {t.batch_size}: {_gib(activations(px, batch, ckpt))} GiB with it, "
        f"{_gib(activations(px, t.batch_size, ckpt))} without",
    ]


def routing_lines(spec: str, tc: dict, text: int) -> list[str]:
    """``train.token_routing``'s cost: the share of the blocks' tokens a step keeps, and its forwards (one, as
    plain LoRA's)."""
    routing = token_routing.parse(spec)
    if routing is None:
        return []
    depth = tc["num_layers"] + tc["num_single_layers"]
    token_routing.check_depth(routing, depth)
    lines = [f"train.token_routing={spec}: one forward a step, as plain LoRA; per square image"]
    for px in (512, 1024):
        n = gpu_memory.tokens(px, 0)
        share = token_routing.block_share(routing, depth, n, text)
        lines.append(
            f"  {px} px: {token_routing.keep_count(n, routing.ratio)} of {n} image tokens through blocks "
            f"{routing.first}-{routing.last}; the blocks' activations and matmuls about {share:.2f} of plain"
        )
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rayflux plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", metavar="FILE", help="the job's YAML file")
    config.add_set_arg(p)
    p.add_argument(
        "--model",
        choices=sorted(families.BUILT_IN),
        default="",
        help="plan a built-in transformer config instead of the job's model.path",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=8,
        metavar="N",
        help="workers a node shards the base over with base_sharding=node (default 8)",
    )
    args = p.parse_args(argv)
    cfg = config.load_or_report(args.config, args.set)
    if cfg is None:
        return 2
    try:
        lines = report(cfg, args.model, args.gpus_per_node)
    except ValueError as exc:  # e.g. train.targets naming modules or blocks the model does not have
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0
