"""Cache-stage efficiency and actor scaling, measured side by side in one run on CPU.

    python benchmarks/bench_cache.py [--images 12] [--resolution 512]

1. Efficiency: images/s of the rayflux cache stage (Ray Data, one VAE actor) divided by images/s of a bare PyTorch
   loop that decodes, crops and encodes the same images with the same models and the same thread count.
2. Scaling: images/s with two VAE actors divided by one.

The VAE has FLUX.1's real architecture (16 latent channels, 128-512 wide blocks) with random weights; the text
encoders are tiny, as the bare loop's are, so both sides do the same work. Both timings include loading the models.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def bare_loop(model_dir: str, image_paths: list[Path], resolution: int, threads: int) -> float:
    """Seconds for a plain loop: load models, then decode, crop, resize and encode every image and caption."""
    import numpy as np
    import torch
    from PIL import Image

    from rayflux import buckets, models
    from rayflux.config import ModelConfig

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    cfg = ModelConfig(path=model_dir)
    vae = models.load_vae(cfg, "cpu", torch.float32)
    clip_tok, clip, t5_tok, t5 = models.load_text_encoders(cfg, "cpu", torch.float32)
    spec = buckets.BucketSpec(resolution=resolution, latent_channels=16)
    captions = set()
    for path in image_paths:
        img = Image.open(path).convert("RGB")
        p = buckets.plan(*img.size, spec)
        img = img.resize((p.target_width, p.target_height), Image.Resampling.LANCZOS, box=p.crop_box)
        x = torch.from_numpy(np.asarray(img)).permute(2, 0, 1)[None].float() / 127.5 - 1
        with torch.inference_mode():
            dist = vae.encode(x).latent_dist
            z = (dist.sample() - vae.config.shift_factor) * vae.config.scaling_factor
        z.contiguous().numpy().tobytes()
        captions.add(path.with_suffix(".txt").read_text().strip())
    with torch.inference_mode():
        for c in sorted(captions | {""}):
            clip(clip_tok([c], padding="max_length", max_length=77, return_tensors="pt").input_ids)
            t5(t5_tok([c], padding="max_length", max_length=512, return_tensors="pt").input_ids)
    return time.perf_counter() - t0


def cache_stage(
    model_dir: str, images_dir: str, out: str, resolution: int, vae_actors: int, actor_cpus: float
) -> float:
    """Seconds for the rayflux cache stage (discover, prepare, encode, write, commit)."""
    from rayflux import config, models
    from rayflux.cache.stage import build_generation
    from rayflux.sources import discover

    cfg = config.load(
        None,
        [f"model.path={model_dir}", f"data.images_dir={images_dir}", f"data.resolution={resolution}",
         f"cache.vae_actors={vae_actors}", f"cache.actor_cpus={actor_cpus}", "cache.batch_size=1"],
    )  # fmt: skip
    t0 = time.perf_counter()
    facts = models.model_facts(cfg.model)
    discovery = discover(cfg.data)
    manifest = build_generation(cfg, facts, discovery, out, 0, 0, False)
    assert manifest["cached"] == discovery.discovered
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=12)
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--actor-cpus", type=float, default=0.75,
                    help="cache.actor_cpus: two actors of 0.75 CPU leave 0.5 of a 2-CPU Ray for preparing and writing")
    args = ap.parse_args()

    import ray
    from ray.data import DataContext

    from rayflux.testing.images import write_images
    from rayflux.testing.tiny import TinySpec, write_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-cache-"))
    model_dir = str(write_tiny_model(work / "model", TinySpec(flux_vae=True)))
    paths = write_images(work / "images", sizes=[(args.resolution, args.resolution)] * args.images)

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    DataContext.get_current().enable_progress_bars = False
    try:
        # Warm the page cache and imports on both sides before timing.
        cache_stage(model_dir, str(work / "images"), str(work / "warm"), args.resolution, 1, args.actor_cpus)
        t_bare = bare_loop(model_dir, paths, args.resolution, threads=1)
        t_one = cache_stage(model_dir, str(work / "images"), str(work / "one"), args.resolution, 1, args.actor_cpus)
        t_two = cache_stage(model_dir, str(work / "images"), str(work / "two"), args.resolution, 2, args.actor_cpus)
    finally:
        ray.shutdown()
    n = args.images
    result = {
        "images": n,
        "resolution": args.resolution,
        "actor_cpus": args.actor_cpus,
        "bare_images_per_s": round(n / t_bare, 3),
        "stage_1_actor_images_per_s": round(n / t_one, 3),
        "stage_2_actors_images_per_s": round(n / t_two, 3),
        "efficiency_stage_over_bare": round(t_bare / t_one, 3),
        "scaling_2_over_1_actor": round(t_one / t_two, 3),
    }
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
