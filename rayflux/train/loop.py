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
from rayflux.train import flow, lora

STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.json"


def _batch_tensors(item: dict, device, dtype):
    lat = torch.from_numpy(np.frombuffer(item["latent"], np.float32).reshape(json.loads(item["latent_shape"])).copy())
    t5 = torch.from_numpy(np.frombuffer(item["t5"], np.float32).reshape(json.loads(item["t5_shape"])).copy())
    clip = torch.from_numpy(np.frombuffer(item["clip"], np.float32).reshape(lat.shape[0], int(item["clip_dim"])).copy())
    return lat.to(device, dtype), t5.to(device, dtype), clip.to(device, dtype)


def flow_step(model, latents, t5, clip, generator, train_cfg, guidance_embeds: bool, sample_weights=None):
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
    weights = flow.loss_weights(sigmas, train_cfg.loss_weighting)
    if sample_weights is not None:  # per-dataset weights (regularisation sets), see rayflux.datasets.mix
        weights = weights * sample_weights.to(weights.device, weights.dtype)
    return flow.flow_loss(pred, target, weights)


def _save_checkpoint(transformer, optimizer, step: int, history: list, extra: dict) -> str:
    d = tempfile.mkdtemp(prefix="rayflux-ckpt-")
    lora.save_diffusers(transformer, d)
    torch.save({"optimizer": optimizer.state_dict(), "step": step}, os.path.join(d, STATE_FILE))
    with open(os.path.join(d, METRICS_FILE), "w") as f:
        json.dump({"step": step, "history": history, **extra}, f)
    return d


def _debug_delay(loop_config: dict, rank: int) -> None:
    """``run.debug_slow_rank = "RANK:SECONDS"`` sleeps on one rank before each step, to expose ordering races."""
    spec = loop_config["job"]["run"].get("debug_slow_rank", "")
    if spec:
        slow_rank, seconds = spec.split(":")
        if int(slow_rank) == rank:
            time.sleep(float(seconds))


def train_loop_per_worker(loop_config: dict) -> None:
    import ray.train
    import ray.train.torch
    from ray.train import Checkpoint

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

    step, history = 0, []
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            lora.load_into(transformer, os.path.join(d, lora.WEIGHT_NAME))
            state = torch.load(os.path.join(d, STATE_FILE), weights_only=True)
            optimizer.load_state_dict(state["optimizer"])
            step = int(state["step"])
            history = json.load(open(os.path.join(d, METRICS_FILE)))["history"]
    model = ray.train.torch.prepare_model(transformer)
    model.train()

    shard = ray.train.get_dataset_shard("train")
    t0, samples = time.perf_counter(), 0
    for item in shard.iter_rows():
        steps_total = min(int(item["total_steps"]), t.max_steps or int(item["total_steps"]))
        if int(item["step"]) <= step:
            continue  # trained on before the restart: the plan replays the same order, so skip exactly these
        if step >= steps_total:
            break
        _debug_delay(loop_config, rank)
        latents, t5, clip = _batch_tensors(item, device, dtype)
        generator = torch.Generator().manual_seed(int(item["seed"]))
        sample_weights = torch.tensor(json.loads(item["weights"]), dtype=torch.float32)
        loss = flow_step(model, latents, t5, clip, generator, t, guidance_embeds, sample_weights)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm) if t.max_grad_norm > 0 else torch.tensor(0.0)
        optimizer.step()
        step += 1
        samples += int(item["size"])
        # [loss sum, samples]: all-reduced so that rank 0's history holds the whole step, for exact accounting.
        stats = torch.tensor([float(loss.detach()), float(item["size"])], dtype=torch.float64)
        if world > 1:
            torch.distributed.all_reduce(stats)
        mean_loss = stats[0] / world
        history.append(
            {
                "step": step,
                "epoch": int(item["epoch"]),
                "generation": int(item["generation"]),
                "samples": int(stats[1]),
                "loss": float(mean_loss),
            }
        )
        if step % t.log_every == 0 and step < steps_total:
            dt = time.perf_counter() - t0
            ray.train.report(
                {"step": step, "loss": float(mean_loss), "grad_norm": float(grad_norm), "samples_per_s": samples * world / dt}
            )
    final = {"step": step, "loss": history[-1]["loss"] if history else float("nan")}
    ckpt_dir = _save_checkpoint(transformer, optimizer, step, history, {"world_size": world}) if rank == 0 else None
    ray.train.report(final, checkpoint=Checkpoint.from_directory(ckpt_dir) if ckpt_dir else None)
