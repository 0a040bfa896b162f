"""GPU throughput at the real configurations of FLUX.1-dev, FLUX.2 [klein] 9B and FLUX.2 [dev], with random weights
(nothing is downloaded).

    python benchmarks/bench_gpu.py [--steps 10] [--models flux2-dev ...] [--json results.json]   # on a CUDA device
    python benchmarks/bench_gpu.py --dry-run                              # CPU, tiny shapes: checks the script runs

1. **LoRA step** (``LoraTrainer.train_step``, the job's own step: flow-matching loss, bf16 autocast, AdamW, clipping)
   for each model of :data:`MODELS` in its ``train.base_dtype`` (FLUX.1-dev and FLUX.2 [klein] 9B in bf16 at 512 and
   1024 px, batch 1 and 2, gradient checkpointing off and on; FLUX.2 [dev], 32B, in fp8 on one GPU with
   checkpointing): steps/s, samples/s, peak memory and MFU by :func:`model_flops` (the README's formula: a frozen
   base has no weight gradients) over the device's peak dense bf16 FLOP/s. A row that runs out of memory, or whose
   base_dtype this device refuses, is recorded as such. FLUX.1-dev and [klein] 9B also run ``train.compile=true``
   (:data:`COMPILED`: 512 px without checkpointing, 1024 px with it) beside the eager rows of the same shape, with
   ``first_step_s``, the step that compiles; the dry run records them as refused on CPU.
   FLUX.1-dev at 1024 px, batch 1, also runs TREAD (``train.token_routing``, :data:`TREAD_FLUX1`) with checkpointing
   off and on, beside the plain rows of the same shape; its MFU counts the plain step's FLOPs (an effective figure:
   the FLOPs routing saves are in ``benchmarks/bench_tread.py``).
2. **Trainer step vs bare step** (FLUX.1-dev): the same configuration through a plain hand-written loop (pack, noise,
   forward, MSE, backward, ``AdamW.step``), as seconds per step of each and their ratio, in this one process.
3. **Encoders**: FLUX.1's VAE encoding 1024 px images (images/s, bf16 on channels-last tensors, as the cache's
   encoder runs it), alone and as ``--vae-procs`` processes sharing the GPU (what ``cache.gpus_per_actor=0.25``
   gives four actors); T5-XXL + CLIP-L encoding captions of 512 and 77 tokens (captions/s, bf16).
4. **The job** (``--skip-job`` leaves it out): ``jobs/train_flux.py`` itself (Ray Train, its feed, checkpoints) on one
   worker with the job's defaults (``train.workers.on_gpu=auto``, checkpointing ``auto``), 512 px, batch 1, on 8 square images.
   A FLUX.1-shaped model directory is written with ``rayflux.testing.tiny`` (random weights, saved in bf16):
   FLUX.1-dev's transformer (24 heads x 128, 19 + 38 blocks; ``--job-blocks D,S`` for fewer), its real VAE, and shallow
   T5 and CLIP at width 4096, which only encode captions in the cache stage. The pooled projection is so 4096 wide, not
   FLUX.1-dev's 768: one extra 4096 x 3072 matmul per sample (not per token), nothing beside the step's 11.9B parameters
   times 1,536 tokens. The directory takes 23 GiB of disk (22.2 GiB of it the transformer; ``--job-model DIR`` keeps it
   for the next run, otherwise it is removed at the end) and a few minutes of CPU to build and write. The cache is built
   once (``--only cache``, not timed); then, in this process, ``LoraTrainer.train_step`` (loading ``model.path`` as the
   job's worker does) and the bare step of section 2 run on the cache's batches and are freed; only then is the job run
   twice with different ``train.max_steps`` (``--job-steps``), so its worker and this process never hold the model on
   the GPU together. The train stage's wall time from each run's ledger gives ``job_s_per_extra_step`` = (long - short)
   / extra steps, in which start-up, model load and the first read cancel out; it is reported beside
   ``trainer_s_per_step``, ``bare_s_per_step`` and the two ratios. All three runs join one local Ray started here and
   stopped at the end. ``time_to_first_step_s`` breaks the short run's way to its first step down by phase (the
   ``RAYFLUX_PHASES`` marks): job start to train stage, worker group start, first read, model load, first step, with
   the cache built and Ray up, as when a job is submitted to a running cluster.

Weights are random: speed and memory do not depend on their values. ``--dry-run`` runs every section on the CPU with
tiny widths and two steps (the job section: the default tiny model at 64 px, ``train.max_steps`` 2 and 4), so the
script cannot rot unnoticed where no GPU is at hand.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from rayflux import config, families, gpu_memory, models  # noqa: E402
from rayflux.families.flux1 import FLUX1_DEV  # noqa: E402
from rayflux.families.flux2 import FLUX2_DEV, FLUX2_KLEIN_9B  # noqa: E402
from rayflux.testing.tiny import TinySpec, ensure_tiny_model  # noqa: E402
from rayflux.train import step
from rayflux.train.adapter import base_weights  # noqa: E402
from rayflux.train.trainer import LoraTrainer  # noqa: E402

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "A10G": 70.0}
"""Dense bf16 peaks (NVIDIA data sheets, SXM parts); ``--peak-tflops`` overrides."""
TINY = {
    **FLUX1_DEV,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "axes_dims_rope": [4, 4, 8],
    "in_channels": 16,
}
TINY2 = {
    **FLUX2_KLEIN_9B,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "axes_dims_rope": [4, 4, 4, 4],
    "in_channels": 16,
}
FULL_GRID = [(px, b, c) for px in (512, 1024) for b in (1, 2) for c in (False, True)]
COMPILED = [(512, 1, False, True), (1024, 1, True, True)]
"""``train.compile=true`` rows (px, batch, checkpointing, compile), against the grid's eager rows of the same shape."""
TREAD_FLUX1 = [(1024, 1, False, False, "0.5:2-54"), (1024, 1, True, False, "0.5:2-54")]
"""``train.token_routing`` rows (px, batch, checkpointing, compile, routing) of FLUX.1-dev's 57 blocks: half the
image tokens skip all but the first two and the last two blocks (SimpleTuner's FLUX preset), against the eager rows
of the same shape."""
MODELS = {
    "flux1-dev": (FLUX1_DEV, "bf16", FULL_GRID + COMPILED + TREAD_FLUX1),
    "flux2-klein-9b": (FLUX2_KLEIN_9B, "bf16", FULL_GRID + COMPILED),
    # 32B: its bf16 weights (60 GiB) are kept under fp8 (torchao casts them per matmul), so only checkpointed steps fit.
    "flux2-dev": (FLUX2_DEV, "fp8", [(512, 1, True), (512, 2, True), (1024, 1, True)]),
}
"""name -> (transformer config, train.base_dtype, (px, batch, checkpointing[, compile[, token_routing]]) grid) of
the LoRA-step section."""
DRY = {
    "flux1-dev": (
        TINY,
        "bf16",
        [(64, 1, False), (64, 2, True), (64, 1, False, True), (64, 1, False, False, "0.5:0-1")],
    ),
    "flux2-klein-9b": (TINY2, "bf16", [(64, 1, True)]),
    "flux2-dev": ({**TINY2, "guidance_embeds": True}, "fp8", [(64, 1, True)]),
}
"""The same sections at tiny widths for ``--dry-run`` (fp8 is refused on CPU, which the dry run records; so is the
compiled row: inductor's CPU compile takes minutes, and its speed on CPU says nothing about a GPU's)."""
FLUX_VAE = {
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 16,
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
}
T5_XXL = {
    "d_model": 4096,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "d_kv": 64,
    "vocab_size": 32128,
    "feed_forward_proj": "gated-gelu",
    "is_encoder_decoder": False,
}
SECTIONS = ("lora", "encoders", "job")
"""The sections, in their default order: the LoRA step (with the bare step), the encoders, the job."""
JOB_IMAGES = 8
"""Square images the job section caches and trains on: 8 steps an epoch on one worker at batch 1."""
CLIP_L = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "vocab_size": 49408,
    "max_position_embeddings": 77,
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _once(fn, device: torch.device) -> float:
    """Seconds of one call of ``fn``."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _timed(fn, n: int, device: torch.device) -> float:
    """Seconds per call of ``fn`` over ``n`` calls, after one warm-up call."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / n


def _text_length(tc: dict) -> int:
    return families.of_transformer_config(tc).text_length_of(tc)


def _batch(tc: dict, px: int, size: int, device: torch.device, seed: int) -> step.Batch:
    """A cached batch as the feed gives it: FLUX.1's 16-channel latents at px/8 with T5 + pooled CLIP, or FLUX.2's
    2x2-patchified latents at px/16 with its stacked ``prompt_embeds``."""
    g = torch.Generator().manual_seed(seed)
    text, width = _text_length(tc), tc["joint_attention_dim"]
    if families.of_transformer_config(tc).name == "flux2":
        latents = torch.randn(size, tc["in_channels"], px // 16, px // 16, generator=g)
        return step.Batch(latents, {"prompt_embeds": torch.randn(size, text, width, generator=g)}, seed)
    latents = torch.randn(size, tc["in_channels"] // 4, px // 8, px // 8, generator=g)
    t5 = torch.randn(size, text, width, generator=g)
    return step.Batch(
        latents, {"t5": t5, "clip_pooled": torch.randn(size, tc["pooled_projection_dim"], generator=g)}, seed
    )


def _transformer(tc: dict, device: torch.device, dtype: torch.dtype):
    """The family's transformer with random weights, built on the meta device and materialised on ``device`` in
    ``dtype`` directly (FLUX.2 [dev] in fp32 would not fit an 80 GB GPU on the way to bf16)."""
    model = models.meta_transformer(tc).to(dtype).to_empty(device=device)
    g = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
        for b in model.buffers():  # RoPE tables and the like: not learned, any finite values do
            b.zero_()
    return model


def model_flops(frozen: int, trainable: int, tokens: int, checkpointing: bool) -> int:
    """Model FLOPs of one sample's training step (the README's formula). A frozen weight costs 2 FLOPs per token
    forward and 2 backward (the input gradient only: it has no weight gradient); a LoRA weight 2 forward and 4
    backward (input and weight gradients); checkpointing runs the forward again in the backward (2 more each).
    Attention's L^2 term is left out."""
    recompute = 2 if checkpointing else 0
    return tokens * ((4 + recompute) * frozen + (6 + recompute) * trainable)


def _bare_step(model, params, opt, batch: step.Batch, device: torch.device, dtype: torch.dtype) -> None:
    """What a user writes by hand: flow-matching loss with uniform sigmas, backward, AdamW."""
    from rayflux.families import flux1_math

    x = batch.latents.to(device)
    b, _, h, w = x.shape
    noise = torch.randn_like(x)
    sig = torch.rand(b, device=device)
    noisy = flux1_math.pack((1 - sig[:, None, None, None]) * x + sig[:, None, None, None] * noise).to(dtype)
    with torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
        t5 = batch.text["t5"]
        pred = model(
            hidden_states=noisy,
            encoder_hidden_states=t5.to(device, dtype),
            pooled_projections=batch.text["clip_pooled"].to(device, dtype),
            timestep=sig.to(dtype),
            img_ids=flux1_math.image_ids(h, w, device, dtype),
            txt_ids=flux1_math.text_ids(t5.shape[1], device, dtype),
            guidance=torch.ones(b, device=device, dtype=dtype),
            return_dict=False,
        )[0]
    loss = torch.nn.functional.mse_loss(pred.float(), flux1_math.pack(noise - x))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def lora_steps(
    name: str, tc: dict, base_dtype: str, device: torch.device, grid: list, steps: int, peak: float
) -> list[dict]:
    dtype = models.torch_dtype("auto", device.type)  # model.dtype's default: bf16 on GPU, fp32 on CPU
    rows = []
    for px, batch, ckpt, *extra in grid:
        compiled, routing = bool(extra and extra[0]), extra[1] if len(extra) > 1 else ""
        row = {
            "model": name,
            "base_dtype": base_dtype,
            "px": px,
            "batch": batch,
            "checkpointing": ckpt,
            "compile": compiled,
            "token_routing": routing,
        }
        rows.append(row)
        try:
            base_weights.check_worker(base_dtype, device)
            if compiled and device.type != "cuda":
                raise RuntimeError("train.compile rows run on a GPU only (inductor's CPU compile takes minutes)")
        except RuntimeError as refused:  # e.g. fp8 on CPU or an older GPU: one line, recorded
            row["refused"] = str(refused)
            print(json.dumps(row), flush=True)
            continue
        cfg = config.load(
            None,
            [
                "train.adapter.rank=16",
                f"train.gradient_checkpointing={str(ckpt).lower()}",
                f"data.resolution={px}",
                f"train.batch_size={batch}",
                f"train.base_dtype={base_dtype}",
                f"train.compile={str(compiled).lower()}",
                f"train.token_routing={routing}",
            ],
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        trainer = None
        try:
            trainer = LoraTrainer(cfg, device, total_steps=steps + 2, transformer=_transformer(tc, device, dtype))
            batches = [_batch(tc, px, batch, device, s) for s in range(2)]
            if compiled:  # the first step traces and compiles the blocks: its time is the compile's cost
                row["first_step_s"] = round(_once(lambda: trainer.train_step(batches[:1]), device), 2)
            seconds = _timed(lambda: trainer.train_step(batches[:1]), steps, device)
        except torch.OutOfMemoryError:
            row["error"] = "out of memory"
            print(json.dumps(row), flush=True)
            del trainer
            continue
        trainable = sum(p.numel() for p in trainer.params)
        frozen = sum(p.numel() for p in trainer.transformer.parameters()) - trainable
        flops = model_flops(frozen, trainable, gpu_memory.tokens(px, _text_length(tc)), ckpt) * batch
        row.update(
            {
                "steps_per_s": round(1 / seconds, 3),
                "samples_per_s": round(batch / seconds, 3),
                "peak_gib": round(torch.cuda.max_memory_allocated(device) / gpu_memory.GIB, 1)
                if device.type == "cuda"
                else None,
                "mfu": round(flops / seconds / (peak * 1e12), 3) if peak else None,
                "job_s_per_step": round(seconds, 4),
            }
        )
        if name == "flux1-dev" and not compiled and not routing:
            bare_opt = torch.optim.AdamW(trainer.params, lr=1e-4)
            bare = _timed(
                lambda: _bare_step(trainer.model, trainer.params, bare_opt, batches[0], device, dtype), steps, device
            )
            row.update({"bare_s_per_step": round(bare, 4), "job_over_bare": round(seconds / bare, 3)})
            del bare_opt
        print(json.dumps(row), flush=True)
        del trainer
    return rows


def _vae_worker(vae_cfg: dict, px: int, batch: int, n: int, device: str, out) -> None:
    from diffusers import AutoencoderKL

    dev = torch.device(device)
    # The dtype and memory format the cache's VaeEncoder uses (rayflux.models.vae_dtype, channels-last).
    dtype = models.vae_dtype(config.ModelConfig(), device)
    vae = AutoencoderKL(**vae_cfg).to(dev, dtype).eval().to(memory_format=torch.channels_last)
    x = torch.randn(batch, 3, px, px, device=dev, dtype=dtype).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        out.put(batch / _timed(lambda: vae.encode(x).latent_dist.mean, n, dev))


def vae_encode(vae_cfg: dict, device: torch.device, px: int, batch: int, n: int, procs: int) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    workers = [ctx.Process(target=_vae_worker, args=(vae_cfg, px, batch, n, str(device), out)) for _ in range(procs)]
    for w in workers:
        w.start()
    rates = [out.get() for _ in workers]
    for w in workers:
        w.join()
    return {"px": px, "batch": batch, "processes": procs, "images_per_s": round(sum(rates), 2)}


def text_encode(t5_cfg: dict, clip_cfg: dict, device: torch.device, batch: int, t5_len: int, n: int) -> dict:
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    dtype = models.torch_dtype("auto", device.type)  # model.dtype's default: bf16 on GPU, fp32 on CPU
    t5 = T5EncoderModel(T5Config(**t5_cfg)).to(device, dtype).eval()
    clip = CLIPTextModel(CLIPTextConfig(**clip_cfg)).to(device, dtype).eval()
    t5_ids = torch.randint(0, t5_cfg["vocab_size"], (batch, t5_len), device=device)
    clip_ids = torch.randint(0, clip_cfg["vocab_size"], (batch, 77), device=device)

    def encode():
        t5(t5_ids)
        clip(clip_ids)

    with torch.inference_mode():
        seconds = _timed(encode, n, device)
    return {"batch": batch, "t5_tokens": t5_len, "captions_per_s": round(batch / seconds, 2)}


def job_spec(blocks: tuple[int, int], dry: bool) -> TinySpec:
    """The job section's model: FLUX.1-dev's transformer widths (24 heads x 128, 19 + 38 blocks unless ``blocks``
    says fewer) and real VAE in bf16, shallow text encoders; the default tiny model for ``--dry-run``."""
    if dry:
        return TinySpec()
    return TinySpec(
        flux_vae=True,
        num_layers=blocks[0],
        num_single_layers=blocks[1],
        attention_head_dim=128,
        num_attention_heads=24,
        text_dim=4096,
        dtype="bfloat16",
    )


def _in_process(common: list[str], rows: list[dict], steps: int, device: torch.device) -> dict:
    """Seconds per step of ``LoraTrainer.train_step`` (loading ``model.path`` as the job's worker does) and of the
    bare step on the same model, over the cached batches the job trains on; the GPU is emptied afterwards."""
    cfg = config.load(None, common)
    dtype = models.torch_dtype("auto", device.type)  # model.dtype's default: bf16 on GPU, fp32 on CPU
    batches = itertools.cycle([step.from_item(r) for r in rows])
    trainer = LoraTrainer(cfg, device, total_steps=2 * steps + 2)
    trainer_s = _timed(lambda: trainer.train_step([next(batches)]), steps, device)
    bare_opt = torch.optim.AdamW(trainer.params, lr=cfg.train.optim.learning_rate)
    bare_s = _timed(
        lambda: _bare_step(trainer.model, trainer.params, bare_opt, next(batches), device, dtype), steps, device
    )
    ckpt = trainer.checkpointing
    del trainer, bare_opt
    _free(device)
    return {"checkpointing": ckpt, "trainer_s_per_step": trainer_s, "bare_s_per_step": bare_s}


def _free(device: torch.device) -> None:
    gc.collect()  # the trainer's modules hold reference cycles: freed only by a collection
    if device.type == "cuda":
        torch.cuda.empty_cache()


def job_section(
    spec: TinySpec, px: int, steps: tuple[int, int], device: torch.device, work: Path, model_dir: Path | None
) -> dict:
    """The job (``jobs/train_flux.py``: Ray Train, its feed, checkpoints) on one worker at ``px`` px, batch 1, as wall
    time per extra step between ``train.max_steps`` ``steps[0]`` and ``steps[1]``, against the in-process steps."""
    import ray

    from benchmarks.job_runs import build_cache, cached_batches, first_step, job_train_seconds
    from rayflux.testing.images import write_images

    _free(device)
    t0 = time.perf_counter()
    model = ensure_tiny_model(model_dir or work / "model", spec)
    size = sum(f.stat().st_size for f in model.rglob("*") if f.is_file())
    row = {
        "px": px,
        "batch": 1,
        "blocks": [spec.num_layers, spec.num_single_layers],
        "dtype": spec.dtype,
        "model_write_s": round(time.perf_counter() - t0, 2),
        "model_gib": round(size / gpu_memory.GIB, 3),
    }
    write_images(work / "images", sizes=[(px, px)] * JOB_IMAGES)
    short, long = steps
    # One Ray for the three runs (cache, short, long): each job joins it instead of starting its own. Its workers
    # write the runs' phase marks (for the time to first step) to the file named before it starts.
    os.environ.setdefault("RAYFLUX_PHASES", str(work / "phases.jsonl"))
    ctx = ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        common = [
            f"model.path={model}",
            f"data.images_dir={work / 'images'}",
            f"data.resolution={px}",
            "train.workers.num_workers=1",
            "train.batch_size=1",
            f"train.epochs={-(-long // JOB_IMAGES) + 1}",
            f"cache.dir={work / 'cache'}",
            f"run.ray_address={ctx.address_info['gcs_address']}",
        ]
        rows = cached_batches(common, build_cache(work, common))
        # Before the job runs, so that its worker and this process never hold the model on the GPU together.
        row.update(_in_process(common, rows, long - short, device))
        if device.type == "cuda":
            row["driver_gib_during_job"] = round(torch.cuda.memory_reserved(device) / gpu_memory.GIB, 2)
        seconds = [job_train_seconds(work, f"job-{n}", n, common) for n in steps]
    finally:
        ray.shutdown()
    job_s = (seconds[1] - seconds[0]) / (long - short)
    trainer_s, bare_s = row["trainer_s_per_step"], row["bare_s_per_step"]
    row.update(
        {
            "max_steps": list(steps),
            "job_train_s": [round(x, 3) for x in seconds],
            "job_s_per_extra_step": round(job_s, 5),
            "trainer_s_per_step": round(trainer_s, 5),
            "bare_s_per_step": round(bare_s, 5),
            "job_over_trainer": round(job_s / trainer_s, 3),
            "job_over_bare": round(job_s / bare_s, 3),
            # The short run's way to its first step, with its cache built and Ray already up (as on a cluster).
            "time_to_first_step_s": first_step(work, f"job-{short}"),
        }
    )
    print(json.dumps({"job": row}), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, two steps: only checks that it runs")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--vae-procs", type=int, default=4, help="VAE processes sharing the GPU (cache.gpus_per_actor=1/N)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="peak dense bf16 TFLOP/s (default: by device name)")
    ap.add_argument("--json", metavar="FILE", help="also write the results here")
    ap.add_argument(
        "--models",
        nargs="+",
        choices=sorted(MODELS),
        default=sorted(MODELS),
        help="LoRA-step sections to run (default: all)",
    )
    ap.add_argument("--skip-job", action="store_true", help="leave out the job section")
    ap.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="sections to run, in this order (default: all, as listed); a lent GPU's minutes may not cover them all",
    )
    ap.add_argument(
        "--job-blocks",
        default="19,38",
        metavar="D,S",
        help="double,single blocks of the job section's model (fewer: a smaller directory to write)",
    )
    ap.add_argument("--job-steps", default="10,60", metavar="SHORT,LONG", help="train.max_steps of the two job runs")
    ap.add_argument(
        "--job-model",
        metavar="DIR",
        type=Path,
        help="where the job section's model is written and kept (reused when current; default: a "
        "temporary directory, removed at the end)",
    )
    args = ap.parse_args(argv)
    try:  # checked before any section runs, not after an hour of them
        blocks = tuple(int(n) for n in args.job_blocks.split(","))
        job_steps = (2, 4) if args.dry_run else tuple(int(n) for n in args.job_steps.split(","))
    except ValueError:
        blocks = job_steps = ()
    if len(blocks) != 2 or min(blocks) < 1 or len(job_steps) != 2 or not 0 < job_steps[0] < job_steps[1]:
        ap.error("--job-blocks needs D,S (integers of at least 1); --job-steps SHORT,LONG with 0 < SHORT < LONG")

    if args.dry_run:
        device, models, steps = torch.device("cpu"), DRY, 2
        vae_cfg = {**FLUX_VAE, "block_out_channels": [32, 32, 32, 32], "latent_channels": 4}
        t5_cfg = {**T5_XXL, "d_model": 32, "d_ff": 37, "num_layers": 1, "num_heads": 2, "d_kv": 16, "vocab_size": 100}
        clip_cfg = {
            **CLIP_L,
            "hidden_size": 32,
            "intermediate_size": 37,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "vocab_size": 100,
        }
        vae_px, vae_procs, text_len = 64, 2, 16
    else:
        if not torch.cuda.is_available():
            print("bench_gpu: no CUDA device (use --dry-run to check the script on CPU)", file=sys.stderr)
            return 2
        device, models, steps = torch.device("cuda"), MODELS, args.steps
        vae_cfg, t5_cfg, clip_cfg, vae_px, vae_procs, text_len = FLUX_VAE, T5_XXL, CLIP_L, 1024, args.vae_procs, 512
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
    results = {"device": name, "peak_tflops": peak, "lora_step": []}
    for section in [s for s in args.sections if not (s == "job" and args.skip_job)]:
        if section == "lora":
            for model in args.models:
                tc, base_dtype, grid = models[model]
                results["lora_step"] += lora_steps(model, tc, base_dtype, device, grid, steps, peak)
            if device.type == "cuda" and torch.cuda.device_count() > 1:
                # One process drives one GPU here; a sharded base needs one Ray Train worker per GPU (the job itself).
                results["skipped"] = [
                    "flux2-dev with train.workers.base_fsdp=node: not measured by this one-process script"
                ]
        elif section == "encoders":
            results["vae"] = [vae_encode(vae_cfg, device, vae_px, 8, steps, p) for p in (1, vae_procs)]
            results["text"] = text_encode(t5_cfg, clip_cfg, device, 16, text_len, steps)
            print(json.dumps({"vae": results["vae"], "text": results["text"]}), flush=True)
        else:
            work = Path(tempfile.mkdtemp(prefix="bench-gpu-job-"))
            try:
                results["job"] = job_section(
                    job_spec(blocks, args.dry_run), 64 if args.dry_run else 512, job_steps, device, work, args.job_model
                )
            finally:
                shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: results[k] for k in ("device", "vae", "text", "job") if k in results}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
