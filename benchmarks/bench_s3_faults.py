"""Requests and wall time on S3 clean and with injected 503 SlowDown: the whole job, or the read paths alone.

Against the loopback S3 server (tests/s3server.py) behind the fault proxy (tests/fault_proxy.py), whose log counts
every request and its outcome.

``--images N`` (the job): the S3 benchmark's image set (``bench_scale.py``: N small PNGs of 4 sizes, each with its
own sidecar caption, tiny model, ``data.crop=center``, one worker), then the job's phases with the proxy as every
process's endpoint (the Ray workers included): the cache build, a rerun with nothing changed, and one epoch of
training (``--batch-size``, a checkpoint every tenth of the epoch). Run twice into two run folders of the same
bucket: once clean, once with ``--rate`` of requests answered 503 SlowDown (seeded); the two must commit the same
rows and train the same LoRA, which is checked.

``--objects N`` (the read paths): N objects of an image's size, listed (walk.files), read whole (images, captions)
and read by byte ranges (training), clean and with ``--rate`` 503s.

    PYTHONPATH=. python benchmarks/bench_s3_faults.py --images 2000 --rate 0.05
    PYTHONPATH=. python benchmarks/bench_s3_faults.py --objects 200 --rate 0.05
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))


def _counted(proxy, fn) -> tuple[object, dict]:
    before = len(proxy.fault_log())
    t = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t
    log = proxy.fault_log()[before:]
    outcomes = dict(collections.Counter(e[4] for e in log))
    return out, {"wall_s": round(wall, 1), "requests": len(log), "outcomes": outcomes}


def _reads(proxy, root: str, blobs: dict[str, bytes]) -> None:
    from rayflux import storage
    from rayflux.discovery import walk
    from rayflux.cache import ranges

    fs, inner = storage.resolve(root)
    assert walk.files(fs, inner).num_rows == len(blobs)
    for uri, blob in blobs.items():
        assert storage.read_bytes(uri) == blob
        assert ranges.read_ranges(uri, len(blob), [(0, 4096), (len(blob) // 2, 8192)]) == [
            blob[:4096],
            blob[len(blob) // 2 : len(blob) // 2 + 8192],
        ]


def read_paths(proxy, args) -> None:
    from rayflux import storage

    os.environ["RAYFLUX_S3_READS"] = args.reads
    root = "s3://bench-faults"
    storage.resolve(root)[0].create_dir(root[5:])
    blobs = {f"{root}/imgs/{i:05d}.jpg": os.urandom(args.bytes) for i in range(args.objects)}
    for uri, blob in blobs.items():
        storage.write_bytes_atomic(uri, blob)
    for name, rate in (("clean", 0.0), (f"{args.rate:.0%} 503s", args.rate)):
        proxy.faults(rate=rate, seed=1)
        print(
            json.dumps(
                {
                    "run": name,
                    "objects": args.objects,
                    "reads": args.reads,
                    **_counted(proxy, lambda: _reads(proxy, root, blobs))[1],
                }
            ),
            flush=True,
        )


def _run_record(cfg, summary) -> dict:
    """What two runs are compared on: the committed samples (id and stored checksums), where they lie (shard and
    row), the train stage's ledger entries and the step log's losses."""
    from rayflux import storage
    from rayflux.cache import generations, index
    from rayflux.train.observe import metrics

    manifest = generations.load_manifest(summary.cache_dir)
    rows = index.read(manifest, "samples").to_pylist()
    samples = sorted((r["sample_id"], *(v for k, v in sorted(r.items()) if k.endswith("crc32"))) for r in rows)
    # Where each sample lies, its shard named by the smallest sample id it holds (shard names differ per build).
    first: dict[str, str] = {}
    for r in rows:
        first[r["file"]] = min(first.get(r["file"], r["sample_id"]), r["sample_id"])
    layout = sorted((r["sample_id"], first[r["file"]], r["row"]) for r in rows)
    out = cfg.run.output_dir
    stages = json.loads(storage.read_bytes(storage.join(out, "ledger.json")))["stages"]
    losses = [(s["step"], s["loss"]) for s in metrics.read_steps(out)]
    return {"samples": samples, "layout": layout, "stages": stages, "losses": losses}


def _compare(clean: dict, faulted: dict) -> None:
    """Where a faulted run departs from the clean one: its committed samples, their layout, its train stages, its
    first loss."""
    rows = {
        "same_samples": clean["samples"] == faulted["samples"],
        "same_layout": clean["layout"] == faulted["layout"],
        "samples": len(clean["samples"]),
    }
    rows["faulted_stages"] = [
        {k: v for k, v in s.items() if k in ("name", "status", "attempt", "error", "reused")} for s in faulted["stages"]
    ]
    first = next((i for i, (x, y) in enumerate(zip(clean["losses"], faulted["losses"])) if x != y), None)
    rows["first_loss_difference"] = None if first is None else [clean["losses"][first], faulted["losses"][first]]
    rows["steps"] = [len(clean["losses"]), len(faulted["losses"])]
    print(json.dumps(rows, default=str), flush=True)


def whole_job(proxy, args) -> None:
    import ray
    import torch
    from safetensors.torch import load

    import bench_scale
    from rayflux import config, job, progress, storage
    from rayflux.testing.tiny import ensure_tiny_model

    bucket = f"s3://bench-faults-{os.getpid()}"
    t = time.perf_counter()
    bench_scale._put_images(bucket, args.images, "sidecar")
    print(json.dumps({"phase": "upload", "images": args.images, "seconds": round(time.perf_counter() - t, 1)}))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # workers: the proxy
    progress.quiet_operator_bars()
    steps = -(-args.images // args.batch_size)
    sets = [
        f"model.path={ensure_tiny_model()}",
        f"data.images_dir={bucket}/images",
        "data.resolution=64",
        "data.crop=center",
        "train.epochs=1",
        f"train.batch_size={args.batch_size}",
        "train.workers.num_workers=1",
        "cache.refresh=never",
        f"train.checkpoint.every={max(steps // 10, 1)}",
    ]
    loras, runs = {}, {}
    for name, rate in (("clean", 0.0), (f"{args.rate:.0%} 503s", args.rate)):
        proxy.faults(rate=rate, seed=1)
        cfg = config.load(None, sets + [f"run.output_dir={bucket}/run-{len(loras)}"])
        for phase, only in (("cache build", "cache"), ("rerun", "cache"), ("train", "")):
            summary, rec = _counted(proxy, lambda: job.run(cfg, only=only))
            print(json.dumps({"run": name, "phase": phase, "images": args.images, **rec}), flush=True)
        loras[name] = load(storage.read_bytes(summary.lora_path))
        runs[name] = _run_record(cfg, summary)
    a, b = loras.values()
    print(json.dumps({"same_lora": a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)}), flush=True)
    _compare(*runs.values())
    ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=0, help="run the whole job on N images")
    p.add_argument("--batch-size", type=int, default=16, help="train.batch_size of the job's training phase")
    p.add_argument("--objects", type=int, default=200, help="without --images: objects for the read paths")
    p.add_argument("--bytes", type=int, default=60_000, help="size of each object (a small JPEG)")
    p.add_argument("--rate", type=float, default=0.05)
    p.add_argument("--reads", choices=["boto3", "pyarrow"], default="boto3")
    args = p.parse_args()
    import s3server

    port = s3server._free_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_REGION="us-east-1",
    )
    os.environ.pop("AWS_ENDPOINT_URL_S3", None)
    server = s3server.S3Server(port)
    proxy = s3server.FaultProxy(server.url)
    os.environ["AWS_ENDPOINT_URL"] = proxy.url  # uploads go through it too, with no faults set
    try:
        (whole_job if args.images else read_paths)(proxy, args)
    finally:
        proxy.stop()
        server.stop()


if __name__ == "__main__":
    main()
