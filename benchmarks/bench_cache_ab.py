"""The cache stage of two checkouts side by side, on the same tiny model and images.

    python benchmarks/bench_cache_ab.py OTHER_CHECKOUT [--images 32] [--resolution 256] [--rounds 2] [--set k=v]

Each round runs ``python jobs/train_flux.py --only cache`` once in this checkout and once in ``OTHER_CHECKOUT``
(each with its own ``.venv``, so neither imports the other's code), in alternating order, each as a fresh process
with its own local Ray. It prints, per run, the whole process's seconds, the cache stage's seconds (the first pass's
start to the last pass's end, from the committed manifest's ``passes``), its encoder rule, and the load average
before the run: on a shared machine, only runs at a similar load compare.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _run(checkout: Path, sets: list[str]) -> dict:
    """One cache-only job in ``checkout``: its seconds and its manifest's passes."""
    cmd = [str(checkout / ".venv/bin/python"), "jobs/train_flux.py", "--only", "cache"]
    cmd += [x for s in sets for x in ("--set", s)]
    env = {**os.environ, "RAY_TMPDIR": tempfile.mkdtemp(prefix="ray-ab-")}
    env.pop("PYTHONPATH", None)  # each checkout imports its own code only
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, check=False, cwd=checkout, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: the job failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    out = Path(next(s.split("=", 1)[1] for s in sets if s.startswith("run.output_dir=")))
    passes = json.loads(next(out.rglob("manifest.json")).read_text())["passes"]
    stage = max(p["end"] for p in (passes["text"], passes["images"])) - passes["text"]["start"]
    return {
        "checkout": str(checkout),
        "process_s": round(seconds, 1),
        "cache_stage_s": round(stage, 1),
        "encoders": passes["encoders"],
        "one_process": passes.get("one_process", False),
        "load_before": round(load, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", type=Path, help="the other checkout (with its own .venv)")
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--resolution", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], help="extra job settings, e.g. cache.vae_actors=2")
    args = ap.parse_args()

    from rayflux.testing.images import write_images
    from rayflux.testing.tiny import TinySpec, write_tiny_model

    work = Path(tempfile.mkdtemp(prefix="bench-cache-ab-"))
    model_dir = write_tiny_model(work / "model", TinySpec(flux_vae=True))
    images = work / "images"
    write_images(images, sizes=[(args.resolution, args.resolution)] * args.images)
    sides = [ROOT, args.other.resolve()]
    for r in range(args.rounds):
        for i, checkout in enumerate(sides if r % 2 == 0 else sides[::-1]):
            sets = [
                f"model.path={model_dir}",
                f"data.images_dir={images}",
                f"data.resolution={args.resolution}",
                f"run.output_dir={work / f'run{r}-{i}'}",
                "run.ray_address=local",
                *args.set,
            ]
            print(json.dumps({"round": r, **_run(checkout, sets)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
