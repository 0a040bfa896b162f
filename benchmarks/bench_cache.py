"""Cache stage with the job's defaults against the plain PyTorch loop a user would write, as whole processes.

    python benchmarks/bench_cache.py [--images 32] [--resolution 256] [--rounds 3]

Each round runs, one after the other and each as a fresh ``python`` process timed from start to exit:

- **loop**: load the VAE and text encoders, decode, crop and resize every image, encode them in batches of the job's
  ``cache.batch_size`` with torch's default threads, and encode every unique caption once;
- **job**: ``python jobs/train_flux.py --only cache`` with its defaults (its own local Ray, the encoder pools sized
  by ``cache.vae_actors=auto``), on the same model and images.

Rounds alternate the order, so a burst of load from elsewhere on the machine hits both sides. The ratio is loop
seconds / job seconds (1.0: the job is as fast as the loop); the median and range over rounds are printed. A third
process, the **tuned loop**, runs the VAE as the job's encoder does on this machine (bf16 where the CPU computes it
natively, channels-last), so ``ratio_tuned`` is the job's own orchestration cost alone. The VAE
has FLUX.1's real architecture (16 latent channels, 128-512 wide blocks) with random weights; the text encoders are
the tiny test ones on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def plain_loop(model_dir: str, images_dir: str, resolution: int, batch_size: int, tuned: bool = False) -> None:
    """What a user writes by hand: one process, torch's default threads, the job's batch size. ``tuned``: the VAE in
    the dtype and memory format the job's encoder picks on this machine (bf16 where the CPU computes it natively,
    channels-last), so that the job's own overhead can be told apart from its faster encode."""
    import numpy as np
    import torch
    from PIL import Image

    from rayflux import buckets, models
    from rayflux.config import ModelConfig

    cfg = ModelConfig(path=model_dir)
    vae = models.load_vae(cfg, "cpu", models.vae_dtype(cfg, "cpu") if tuned else torch.float32)
    if tuned:
        vae.to(memory_format=torch.channels_last)
    clip_tok, clip, t5_tok, t5 = models.load_text_encoders(cfg, "cpu", torch.float32)
    spec = buckets.BucketSpec(resolution=resolution, latent_channels=16)
    paths = sorted(Path(images_dir).glob("*.png"))
    groups: dict = {}
    for path in paths:
        img = Image.open(path).convert("RGB")
        p = buckets.plan(*img.size, spec)
        img = img.resize((p.target_width, p.target_height), Image.Resampling.LANCZOS, box=p.crop_box)
        groups.setdefault(img.size, []).append(np.asarray(img))
    with torch.inference_mode():
        for arrays in groups.values():
            for i in range(0, len(arrays), batch_size):
                # As users write it: the permuted view keeps NHWC strides, which PyTorch's convolutions already
                # treat as channels-last input.
                x = torch.from_numpy(np.stack(arrays[i : i + batch_size])).permute(0, 3, 1, 2).float() / 127.5 - 1
                if tuned:
                    x = x.to(vae.dtype).contiguous(memory_format=torch.channels_last)
                dist = vae.encode(x).latent_dist
                z = (dist.sample().float() - vae.config.shift_factor) * vae.config.scaling_factor
                [z[j].contiguous().numpy().tobytes() for j in range(z.shape[0])]
        captions = sorted({p.with_suffix(".txt").read_text().strip() for p in paths} | {""})
        for c in captions:
            clip(clip_tok([c], padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids)
            t5(t5_tok([c], padding="max_length", max_length=512, truncation=True, return_tensors="pt").input_ids)


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--resolution", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], help="extra job settings, e.g. cache.vae_actors=2")
    ap.add_argument("--loop", nargs=2, metavar=("MODEL", "IMAGES"), help=argparse.SUPPRESS)  # one loop process
    ap.add_argument("--tuned", action="store_true", help=argparse.SUPPRESS)  # with --loop: the tuned loop
    args = ap.parse_args()

    from rayflux.config import CacheConfig

    batch = CacheConfig().batch_size
    if args.loop:
        plain_loop(args.loop[0], args.loop[1], args.resolution, batch, args.tuned)
        return 0

    from rayflux.testing.images import write_images
    from rayflux.testing.tiny import TinySpec, write_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    model_dir = str(write_tiny_model(work / "model", TinySpec(flux_vae=True)))
    images = work / "images"
    write_images(images, sizes=[(args.resolution, args.resolution)] * args.images)
    loop_cmd = [sys.executable, __file__, "--resolution", str(args.resolution), "--loop", model_dir, str(images)]

    def job_cmd(r: int) -> list[str]:
        sets = [
            f"model.path={model_dir}",
            f"data.images_dir={images}",
            f"data.resolution={args.resolution}",
            f"run.output_dir={work / f'run{r}'}",
            "run.ray_address=local",
            *args.set,
        ]
        return [sys.executable, "jobs/train_flux.py", "--only", "cache", *(x for s in sets for x in ("--set", s))]

    _timed(loop_cmd)  # warm the page cache and imports once, untimed
    rounds = []
    for r in range(args.rounds):
        sides = [("loop", loop_cmd), ("job", job_cmd(r)), ("tuned_loop", [*loop_cmd, "--tuned"])]
        times = dict((name, _timed(cmd)) for name, cmd in (sides if r % 2 == 0 else sides[::-1]))
        rounds.append(
            {
                **{k: round(v, 1) for k, v in times.items()},
                "ratio": round(times["loop"] / times["job"], 3),
                "ratio_tuned": round(times["tuned_loop"] / times["job"], 3),
            }
        )
        print(json.dumps({"round": r, **rounds[-1]}), flush=True)
    ratios, tuned = [x["ratio"] for x in rounds], [x["ratio_tuned"] for x in rounds]
    print(
        json.dumps(
            {
                "images": args.images,
                "resolution": args.resolution,
                "batch_size": batch,
                "job_settings": args.set,
                "threads_loop": os.cpu_count(),
                "ratio_median": statistics.median(ratios),
                "ratio_range": [min(ratios), max(ratios)],
                "ratio_tuned_median": statistics.median(tuned),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
