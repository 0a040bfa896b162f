"""The eval loss: a fixed, reproducible score of the current LoRA on the held-out samples (``data.eval_samples``).

The training loss is too noisy to compare checkpoints: every step draws its own σ and noise. The eval loss scores
every held-out sample at a fixed grid of ``train.eval.sigmas`` noise levels (the quantiles of the training σ density,
:func:`rayflux.train.flow.eval_sigmas`), each with noise seeded by the sample id and the grid index alone, so the
same LoRA on the same cached data gives the same number in every eval, at every step and in every run (bitwise with
one worker; across world sizes to float tolerance, since only the order of the final sum differs). It is the plain
mean of ``(pred - target)²`` over samples, tokens and σ values (a sample with a loss mask: its mask-weighted mean over
tokens, as it trains, :func:`rayflux.train.flow.per_sample_loss`): no loss weighting, no per-dataset weight, no
caption dropout, guidance fixed at ``train.flow.guidance``.

Every training rank scores its share of the eval plan (batches ``r, r + W, ...``; :func:`rayflux.train.data.batching.
plan_eval`) without gradients and with LoRA dropout off, then one all-reduce of ``eval_sigmas + 1`` numbers gives the
mean. The batches are read once per worker group through the cache's planned reads (no encoder is loaded) and held in
host memory: the eval set is small.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass

import torch

from rayflux.train import flow, step, timesteps
from rayflux.train.data import batching


@dataclass
class EvalBatch:
    """One eval batch on this rank: its tensors, its sample ids, and whether it counts (0 for a rank's padding)."""

    batch: step.Batch
    sample_ids: list[str]
    live: float = 1.0


def noise_seed(sample_id: str, k: int) -> int:
    """The seed of one held-out sample's noise at grid index ``k``: fixed by the sample alone, so every eval of every
    run draws the same noise (not ``train.seed``: runs of a sweep with other seeds must score alike)."""
    return int.from_bytes(hashlib.sha256(f"eval-noise:{sample_id}:{k}".encode()).digest()[:8], "little") >> 1


def load(plan: list[dict], rank: int, world: int, pad: bool) -> list[EvalBatch]:
    """This rank's eval batches (``plan[rank::world]``), read through the cache's planned reads. ``pad``: give every
    rank as many batches (repeats that do not count), for a sharded base whose forward passes are collectives."""
    mine = plan[rank::world]
    out = [_batch(row) for row in (batching.load_batches(mine) if mine else [])]
    if pad and plan:
        most = math.ceil(len(plan) / world)
        filler = out[0] if out else _batch(batching.load_batches(plan[:1])[0])
        while len(out) < most:
            out.append(EvalBatch(filler.batch, filler.sample_ids, 0.0))
    return out


def _batch(row: dict) -> EvalBatch:
    return EvalBatch(step.from_item(row), json.loads(row["sample_ids"]))


@torch.no_grad()
def score(trainer, batches: list[EvalBatch], world: int) -> dict:
    """The eval loss of ``trainer``'s current LoRA: ``eval_loss`` (mean over samples and σ values),
    ``eval_loss_sigmas`` (per grid index), ``eval_quantiles`` (the grid's quantiles of the training σ density),
    ``eval_time`` (seconds). Every rank must call it (one all-reduce)."""
    t = trainer.cfg.train
    begin = time.perf_counter()
    k_count = t.eval.sigmas
    sums = torch.zeros(k_count + 1, dtype=torch.float64)  # per σ: sum of per-sample losses; last: samples
    model = trainer.transformer
    was_training = model.training
    model.eval()  # LoRA dropout off
    try:
        for eb in batches:
            _score_batch(trainer, model, eb, sums)
    finally:
        model.train(was_training)
    if world > 1:
        total = sums.to(trainer.device)
        torch.distributed.all_reduce(total)
        sums = total.cpu()
    per_sigma = (sums[:k_count] / sums[k_count].clamp(min=1)).tolist()
    quantiles = ((torch.arange(k_count, dtype=torch.float64) + 0.5) / k_count).tolist()
    return {
        "eval_loss": sum(per_sigma) / k_count,
        "eval_loss_sigmas": per_sigma,
        "eval_quantiles": [round(q, 4) for q in quantiles],
        "eval_samples": int(sums[k_count]),
        "eval_time": time.perf_counter() - begin,
    }


def _score_batch(trainer, model, eb: EvalBatch, sums: torch.Tensor) -> None:
    """Add one batch's per-sample losses at every grid σ into ``sums`` (weighted by ``eb.live``)."""
    t, device, dtype, family = trainer.cfg.train, trainer.device, trainer.dtype, trainer.family
    rt = step.Runtime(device, dtype, family)
    batch = eb.batch
    latents = batch.latents.to(device)
    b, _, h, w = latents.shape
    grid = flow.eval_sigmas(t.eval.sigmas, **timesteps.options(t, family, h, w, trainer.shift_config))
    text = {n: x.to(device, dtype) for n, x in batch.text.items()}
    guidance = torch.full((b,), float(t.flow.guidance), device=device, dtype=dtype) if trainer.guidance_embeds else None
    autocast = torch.autocast(device.type, trainer.autocast or torch.float32, enabled=bool(trainer.autocast))
    weights = step.token_weights(batch, family)  # a masked sample scores on its mask, as it trains
    for k, sigma in enumerate(grid.tolist()):
        # Noise per sample on the CPU, as in training: the same seed gives the same noise on any device.
        noise = torch.stack(
            [
                torch.randn(latents.shape[1:], generator=torch.Generator().manual_seed(noise_seed(s, k)))
                for s in eb.sample_ids
            ]
        ).to(device)
        sigmas = torch.full((b,), sigma, device=device)
        with autocast:
            pred, target = step.predict(model, batch, latents, noise, sigmas, text=text, guidance=guidance, rt=rt)
        per_sample = flow.per_sample_loss(pred, target, weights)
        sums[k] += float(per_sample.double().sum()) * eb.live
    sums[-1] += b * eb.live


class Evaluator:
    """When a worker scores the eval loss, and what follows: the record's fields, and the best LoRA so far.

    ``plan``: the eval set's planned batches (empty: no eval loss); ``keep_best(record)`` writes the live LoRA as the
    best file (rank 0; None on other ranks). ``progress`` (the checkpoint's small state) carries the best so far,
    so a resumed run keeps comparing against it."""

    def __init__(self, trainer, plan: list[dict], rank: int, world: int, every: int, final_segment: bool):
        self.trainer, self.world, self.every, self.final_segment = trainer, world, every, final_segment
        self.batches = load(plan, rank, world, pad=bool(trainer.layout)) if plan else None

    @property
    def active(self) -> bool:
        return self.batches is not None

    def due(self, step: int, last: bool, end_of_feed: bool) -> bool:
        """At ``train.eval.every`` steps and at the run's end (its last step, or the last segment's last batch)."""
        if not self.active:
            return False
        return bool(last or (end_of_feed and self.final_segment) or (self.every and step % self.every == 0))

    def run(self, record: dict, progress, keep_best) -> None:
        """Score the live LoRA into ``record``; a new lowest eval loss updates ``progress`` and the best file. Both
        see the LoRA as it is used (the EMA, or a schedule-free optimizer's average:
        :meth:`LoraTrainer.eval_weights`)."""
        with self.trainer.eval_weights():
            record.update(score(self.trainer, self.batches, self.world))
            loss = record["eval_loss"]
            if progress.best_eval_loss is None or loss < progress.best_eval_loss:
                progress.best_eval_loss, progress.best_step = loss, int(record["step"])
                if keep_best is not None:
                    keep_best(record)
        record["best_eval_loss"], record["best_step"] = progress.best_eval_loss, progress.best_step
