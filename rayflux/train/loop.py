"""``train_loop_per_worker``: build the LoRA model, run flow-matching steps, report and checkpoint.

The loop never touches a text encoder or the VAE: everything it needs is in the cached shards.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import numpy as np
import torch

from rayflux import config as config_mod
from rayflux.train import flow, lora, progress

STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.json"


def _batch_tensors(item: dict, device, dtype):
    lat = torch.from_numpy(np.frombuffer(item["latent"], np.float32).reshape(json.loads(item["latent_shape"])).copy())
    t5 = torch.from_numpy(np.frombuffer(item["t5"], np.float32).reshape(json.loads(item["t5_shape"])).copy())
    clip = torch.from_numpy(np.frombuffer(item["clip"], np.float32).reshape(lat.shape[0], int(item["clip_dim"])).copy())
    return lat.to(device, dtype), t5.to(device, dtype), clip.to(device, dtype)


def flow_step(model, latents, t5, clip, generator, train_cfg, guidance_embeds: bool):
    """``generator`` is seeded per planned batch, so a batch's noise is the same whichever rank trains it."""
    """One forward pass and loss (no backward): pack, noise, predict ``ε - x``."""
    b, _, h, w = latents.shape
    device, dtype = latents.device, latents.dtype
    noise = torch.randn(latents.shape, generator=generator).to(device, dtype)
    sigmas = flow.sample_sigmas(
        b,
        train_cfg.sigma_sampling,
        generator,
        logit_mean=train_cfg.logit_mean,
        logit_std=train_cfg.logit_std,
        shift=train_cfg.shift,
        seq_len=(h // 2) * (w // 2),
    ).to(device)
    noisy = flow.pack(flow.noisy_input(latents, noise, sigmas))
    target = flow.pack(flow.flow_target(latents, noise))
    kwargs = {}
    if guidance_embeds:
        kwargs["guidance"] = torch.full((b,), train_cfg.guidance, device=device, dtype=dtype)
    pred = model(
        hidden_states=noisy,
        encoder_hidden_states=t5,
        pooled_projections=clip,
        timestep=sigmas.to(dtype),
        img_ids=flow.image_ids(h, w, device, dtype),
        txt_ids=flow.text_ids(t5.shape[1], device, dtype),
        return_dict=False,
        **kwargs,
    )[0]
    return flow.flow_loss(pred, target, flow.loss_weights(sigmas, train_cfg.loss_weighting))


def _save_checkpoint(transformer, optimizer, step: int, history: list, extra: dict) -> str:
    d = tempfile.mkdtemp(prefix="rayflux-ckpt-")
    lora.save_diffusers(transformer, d)
    torch.save({"optimizer": optimizer.state_dict(), "step": step}, os.path.join(d, STATE_FILE))
    with open(os.path.join(d, METRICS_FILE), "w") as f:
        json.dump({"step": step, "history": history, **extra}, f)
    return d


def train_loop_per_worker(loop_config: dict) -> None:
    import ray.train
    import ray.train.torch

    from rayflux import models

    cfg = config_mod.from_dict(loop_config["job"])
    t = cfg.train
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    dtype = models.torch_dtype(cfg.model.dtype, device.type)
    torch.manual_seed(t.seed)  # identical LoRA init on every rank (DDP also broadcasts rank 0's)

    transformer = models.load_transformer(cfg.model, device, dtype)
    params = lora.add_lora(transformer, t.rank, t.alpha, t.targets)
    optimizer = torch.optim.AdamW(params, lr=t.learning_rate, weight_decay=t.weight_decay)
    guidance_embeds = bool(transformer.config.guidance_embeds)

    step, history, saved_progress = 0, [], None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            lora.load_into(transformer, os.path.join(d, lora.WEIGHT_NAME))
            state = torch.load(os.path.join(d, STATE_FILE), weights_only=True)
            optimizer.load_state_dict(state["optimizer"])
            step = int(state["step"])
            saved = json.load(open(os.path.join(d, METRICS_FILE)))
            history, saved_progress = saved["history"], saved.get("progress")
    # Restarts (failures, resizes, preemptions) may change the world size: resume by the plan cursor, not by step.
    prog = progress.Progress.restore(saved_progress, step, world)
    save_policy = progress.SavePolicy(t.checkpoint_every)
    report_checkpoint = _reporter(transformer, optimizer, history, prog, rank, world)
    model = ray.train.torch.prepare_model(transformer)
    model.train()

    shard = ray.train.get_dataset_shard("train")
    t0, samples = time.perf_counter(), 0
    steps_left = max(t.max_steps - step, 0) if t.max_steps else None
    for item, last in prog.remaining(shard.iter_rows(), world, steps_left):
        latents, t5, clip = _batch_tensors(item, device, dtype)
        generator = torch.Generator().manual_seed(int(item["seed"]))
        loss = flow_step(model, latents, t5, clip, generator, t, guidance_embeds)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm) if t.max_grad_norm > 0 else torch.tensor(0.0)
        optimizer.step()
        step += 1
        prog.advance(item, world)
        samples += int(item["size"])
        mean_loss = loss.detach().float()
        if world > 1:
            torch.distributed.all_reduce(mean_loss)
            mean_loss /= world
        # The step trained batches index .. index + world - 1 of its epoch (rank r trains index + r).
        batches = {"epoch": int(item["epoch"]), "index": int(item["index"]) - rank, "world": world}
        history.append({"step": step, **batches, "loss": float(mean_loss)})
        if last:
            break
        metrics = {"step": step, "loss": float(mean_loss), "grad_norm": float(grad_norm)}
        metrics["samples_per_s"] = samples * world / (time.perf_counter() - t0)
        reason = save_policy.reason(step)
        if reason:
            report_checkpoint(metrics, reason)
        elif step % t.log_every == 0:
            ray.train.report(metrics)
    report_checkpoint({"step": step, "loss": history[-1]["loss"] if history else float("nan")}, "final")


def _reporter(transformer, optimizer, history: list, prog: progress.Progress, rank: int, world: int):
    """``report_checkpoint(metrics, reason)``: every rank reports; rank 0 attaches the checkpoint."""
    import ray.train
    from ray.train import Checkpoint

    def report_checkpoint(metrics: dict, reason: str) -> None:
        step = int(metrics["step"])
        prog.saved(step, world, reason)
        ckpt_dir = None
        if rank == 0:
            extra = {"world_size": world, "checkpoint_reason": reason, "progress": prog.to_dict()}
            ckpt_dir = _save_checkpoint(transformer, optimizer, step, history, extra)
        # The directory is a temporary one of ours, so Ray may delete it once uploaded.
        ray.train.report(
            metrics,
            checkpoint=Checkpoint.from_directory(ckpt_dir) if ckpt_dir else None,
            delete_local_checkpoint_after_upload=ckpt_dir is not None,
        )

    return report_checkpoint
