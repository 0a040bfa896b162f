"""The caption stage's throughput: images per second of one captioner actor, and of the whole stage through Ray.

    python benchmarks/bench_caption.py [--images 48] [--batch-size 8] [--max-new-tokens 16] [--rounds 3]
    python benchmarks/bench_caption.py --driver 2000 8000 16000 100000    # the driver's memory per image


Per actor: the stage's own actor class (``rayflux.caption.worker.CaptionActor``) in this process, fed batches the
stage's own read task made (``worker.read_images``), every caption generated (an empty known table), timed after
one warm-up batch. Stage: ``rayflux.caption.stage.run`` on a local Ray with 2 CPUs over the same images, end to end
(listing, reads, pool start-up and model load, captioning, commit), then again with nothing to caption (the rerun's
cost). The model is the tiny random captioner (``rayflux.testing.tiny_vlm``): its numbers measure the stage's
overhead around generation, not a real VLM's speed (see BENCHMARKS.md for the arithmetic at 7B).

``--driver N ...``: the driver's peak RSS growth (``VmHWM`` reset at each phase's start, above the RSS it started
with) in three phases over N small images, each N in a fresh process: the cache's discovery alone (what a job's
driver holds per image without the stage), the caption stage's first run (1-token captions, batch 64: the driver's
share, not the captioner's speed) and its rerun; then a least-squares slope per image for each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _images(root: Path, n: int) -> Path:
    from rayflux.testing.images import ensure_demo_images

    demo = sorted(ensure_demo_images().glob("*.png"))
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"img{i:04d}.png").write_bytes(demo[i % len(demo)].read_bytes() + i.to_bytes(4, "little"))
    return root


def per_actor(images: Path, model: str, args) -> list[float]:
    """Images per second of one actor, per round (each round a fresh captions directory: nothing known)."""
    import pyarrow as pa

    from rayflux.caption import worker

    paths = sorted(str(p) for p in images.iterdir())
    todo = pa.table(
        {"dataset": [""] * len(paths), "rel_path": paths, "stamp": ["0:0"] * len(paths)}, schema=worker.TODO
    )
    read = worker.read_images(todo, {"": ("", 0)})  # rel_path: the whole path
    batches = [read.slice(i, args.batch_size) for i in range(0, read.num_rows, args.batch_size)]
    rates = []
    for _ in range(args.rounds):
        actor = worker.CaptionActor(
            model, "Describe this image.", args.max_new_tokens, "float32", tempfile.mkdtemp(), 10**8
        )
        actor(batches[0])  # warm-up: first-call allocations
        actor.known.clear()
        t0 = time.perf_counter()
        for b in batches:
            actor(b)
        rates.append(read.num_rows / (time.perf_counter() - t0))
    return rates


def stage_runs(images: Path, model: str, args) -> dict:
    import ray

    from rayflux import config
    from rayflux.caption import stage

    os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp())
    ray.init(address="local", num_cpus=2, log_to_driver=False, include_dashboard=False)
    try:
        cfg = config.load(
            None,
            [
                f"data.images_dir={images}",
                "data.caption_strategy=vlm",
                f"caption.model={model}",
                f"caption.max_new_tokens={args.max_new_tokens}",
                f"caption.batch_size={args.batch_size}",
            ],
        )
        root = tempfile.mkdtemp()
        t0 = time.perf_counter()
        first = stage.run(cfg, root, False)
        t1 = time.perf_counter()
        again = stage.run(cfg, root, False)
        t2 = time.perf_counter()
    finally:
        ray.shutdown()
    return {
        "first_s": round(t1 - t0, 2),
        "first_images_per_s": round(first.captioned / (t1 - t0), 2),
        "rerun_s": round(t2 - t1, 2),
        "rerun_captioned": again.captioned,
    }


def _reset_peak() -> float:
    """Start a new peak-RSS window (Linux: 5 to clear_refs resets VmHWM); the RSS now, in MB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        rows = dict(line.split(":", 1) for line in f)
    return int(rows[field].split()[0]) / 1024


class _Peak:
    """The peak of one /proc/self/status field over a phase, sampled every 50 ms in a thread: ``RssAnon`` is the
    driver's own heap, apart from object-store pages it maps (``RssShmem``), which VmHWM counts too."""

    def __init__(self, field: str):
        import threading

        self.field, self.start = field, _status(field)
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, _status(self.field))

    def growth(self) -> float:
        self._stop.set()
        self._thread.join()
        return round(self.peak - self.start, 1)


def _tiny_pngs(root: Path, n: int) -> Path:
    """``n`` distinct 32x32 PNGs (one image's bytes with a counter appended: decoders ignore trailing bytes)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (90, 140, 200)).save(buf, "PNG")
    root.mkdir(parents=True)
    for i in range(n):
        (root / f"{i // 1000:03d}").mkdir(exist_ok=True)
        (root / f"{i // 1000:03d}" / f"img{i:07d}.png").write_bytes(buf.getvalue() + i.to_bytes(4, "little"))
    return root


def driver_one(n: int) -> dict:
    """One N in this process: each phase's peak RSS growth, in MB."""
    import ray

    from rayflux import config, models
    from rayflux.cache import discover
    from rayflux.caption import stage
    from rayflux.testing.tiny_vlm import ensure_tiny_vlm

    images = _tiny_pngs(Path(tempfile.mkdtemp()) / "images", n)
    model = str(ensure_tiny_vlm())
    ray.init(address="local", num_cpus=2, log_to_driver=False, include_dashboard=False)
    cfg = config.load(
        None,
        [
            f"data.images_dir={images}",
            "data.caption_strategy=vlm",
            f"caption.model={model}",
            "caption.max_new_tokens=1",
            "caption.batch_size=64",
        ],
    )
    facts = models.model_facts(cfg.model)
    root = tempfile.mkdtemp()
    out = {"images": n}
    try:
        for phase, fn in (
            ("discover", lambda: discover.discover(cfg, facts, 0)),
            ("caption", lambda: stage.run(cfg, root, False)),
            ("caption-rerun", lambda: stage.run(cfg, root, False)),
        ):
            start = _reset_peak()
            anon = _Peak("RssAnon")
            t0 = time.perf_counter()
            fn()
            out[phase] = {
                "growth_mb": round(_status("VmHWM") - start, 1),
                "anon_growth_mb": anon.growth(),
                "seconds": round(time.perf_counter() - t0, 1),
            }
    finally:
        ray.shutdown()
    return out


def driver_slopes(ns: list[int]) -> None:
    import subprocess

    points = []
    for n in ns:
        done = subprocess.run(
            [sys.executable, __file__, "--driver-one", str(n)], capture_output=True, text=True, check=True
        )
        rec = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps(rec), flush=True)
        points.append(rec)
    xs = [p["images"] for p in points]
    mx = statistics.fmean(xs)
    for phase in ("discover", "caption", "caption-rerun"):
        slopes = {}
        for key in ("growth_mb", "anon_growth_mb"):
            ys = [p[phase][key] * 1024 for p in points]
            my = statistics.fmean(ys)
            slopes[key] = round(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), 3)
        print(json.dumps({"phase": phase, "kb_per_image": slopes}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--driver", type=int, nargs="+", help="the driver's memory per image over these image counts")
    p.add_argument("--driver-one", type=int, help=argparse.SUPPRESS)
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    if args.driver_one:
        print(json.dumps(driver_one(args.driver_one)))
        return
    if args.driver:
        driver_slopes(args.driver)
        return
    from rayflux.testing.tiny_vlm import ensure_tiny_vlm

    model = str(ensure_tiny_vlm())
    images = _images(Path(tempfile.mkdtemp()) / "images", args.images)
    rates = per_actor(images, model, args)
    out = {
        "images": args.images,
        "batch_size": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "actor_images_per_s": [round(r, 1) for r in rates],
        "actor_median": round(statistics.median(rates), 1),
        "load_average": os.getloadavg()[0],
        **stage_runs(images, model, args),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
