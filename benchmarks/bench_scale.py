"""Scale benchmark: S3 requests per image, by phase, on a local S3 server, and the driver's peak RSS.

Puts N small generated images in a moto S3 server that this script starts on loopback (its request log is the
count), with sidecar captions or, in the ``metadata`` variant, one ``metadata.jsonl``; then runs, each phase counted
from the server's own log:

- ``discover``: discovery alone: the driver's listing, then the caption files read in Ray tasks;
- ``cache``: the job's cache stage (``--only cache``): discovery, preparation, encoding, writing, index, commit;
- ``rerun``: the same command again with nothing changed (everything before training starts);
- ``train-killed``: one epoch of training (one worker) on the committed generation, run as its own process with its
  own local Ray, SIGKILLed (the driver and every process it started) once a checkpoint past ``--kill-at`` of the
  epoch is committed; the requests on the cache's keys (the read path) and all requests;
- ``resume``: the same command again, in this process: it resumes from that checkpoint and finishes the epoch. It
  must seek: its reads on the cache's keys cover what it trains after the checkpoint, not the epoch. For both, the
  training loop's own figures from the run's step log (bytes fetched against the tensors' bytes, its GETs), and the
  size of each checkpoint the killed run committed;
- ``refresh``: one more generation with a new seed (centre crops, one caption per image, so nothing changes): what
  it writes against what generation 0 wrote.

Per phase, the driver's peak RSS within the phase (``VmHWM``, reset when the phase starts) and how far it rose above
the RSS the phase started with (what the upload and earlier phases left is not the phase's own), and, unless
``--no-heap``, the peak of its own Python allocations above what it held before (``tracemalloc``, which itself costs
memory per allocation: run the RSS slope with ``--no-heap``). The request log is streamed, never held, so counting
does not grow the driver with N. Results go to stdout as JSON lines.

Several ``--images`` values with ``--discover-only`` (or ``--skip-train``: discovery, the cache build, the rerun and
the refresh) measure the driver's RSS slope per image in each phase: each N (and each of ``--repeats``) runs in a
fresh process, and a least-squares line through each phase's points gives its slope and standard error;
``--local`` puts the images in a local folder instead (large N without the upload; no requests counted).

    python benchmarks/bench_scale.py --images 500 --variant sidecar
    python benchmarks/bench_scale.py --images 500 --variant metadata
    python benchmarks/bench_scale.py --images 20000 --batch-size 32
    python benchmarks/bench_scale.py --images 2000 --batch-size 16 --read-run 1   # per-sample shuffle, to compare
    python benchmarks/bench_scale.py --discover-only --local --images 2000 10000 40000 --repeats 3
    python benchmarks/bench_scale.py --discover-only --local --per-folder 100 --images 4000 16000 40000 --repeats 3
    python benchmarks/bench_scale.py --skip-train --local --images 2000 10000 20000 --repeats 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from pathlib import Path

_REQUEST = re.compile(r'"(GET|PUT|HEAD|POST|DELETE) (/[^ ?]*)(\?[^ ]*)? HTTP')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class Server:
    """moto's standalone S3 server on a free loopback port; every request is one line of its log."""

    def __init__(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = tempfile.mktemp(prefix="bench-moto-", suffix=".log")
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the server
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for _ in range(300):
            try:
                urllib.request.urlopen(f"{self.url}/moto-api/", timeout=2).close()
                break
            except OSError:
                time.sleep(0.2)
        os.environ.update(
            AWS_ENDPOINT_URL=self.url, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1"
        )
        os.environ.pop("AWS_ENDPOINT_URL_S3", None)

    def mark(self) -> int:
        """Where the log ends now: phases count the requests logged after their mark."""
        time.sleep(0.5)  # the server flushes its log line after answering
        return os.path.getsize(self.log_path)

    def requests(self, since: int = 0):
        """(method, path) of each request logged after byte ``since``, streamed: nothing is kept, so the count
        does not grow this process's memory with N. A GET with a list query is a LIST."""
        time.sleep(0.5)
        with open(self.log_path, "rb") as f:
            f.seek(since)
            for raw in f:
                m = _REQUEST.search(_ANSI.sub("", raw.decode(errors="replace")))
                if m:
                    yield ("LIST" if "list-type" in (m.group(3) or "") else m.group(1), m.group(2))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.unlink(self.log_path)


def _put_images(bucket: str, n: int, variant: str, per_folder: int = 1000, masks: bool = False) -> None:
    """N small PNGs (4 sizes, so several buckets), each with its own caption, written straight to the bucket;
    ``masks``: and a grayscale mask per image (white left half) under ``masks/`` with the same relative path."""
    import io

    from PIL import Image

    from rayflux import storage

    fs, _ = storage.resolve(bucket)
    fs.create_dir(bucket[5:])
    sizes = [(64, 64), (96, 64), (64, 96), (80, 80)]

    def put(k: int) -> str:
        img = Image.new("RGB", sizes[k % 4], ((k * 53) % 256, (k * 97) % 256, (k * 29) % 256))
        buf = io.BytesIO()
        img.save(buf, "PNG")
        name = f"{k // per_folder:04d}/img{k:06d}.png"
        caption = f"photo {k} of a square, shade {k % 256}"
        with fs.open_output_stream(f"{bucket[5:]}/images/{name}") as f:
            f.write(buf.getvalue())
        if masks:
            mask = Image.new("L", sizes[k % 4], 0)
            mask.paste(255, (0, 0, sizes[k % 4][0] // 2, sizes[k % 4][1]))
            mbuf = io.BytesIO()
            mask.save(mbuf, "PNG")
            with fs.open_output_stream(f"{bucket[5:]}/masks/{name}") as f:
                f.write(mbuf.getvalue())
        if variant == "sidecar":
            with fs.open_output_stream(f"{bucket[5:]}/images/{name[:-4]}.txt") as f:
                f.write(caption.encode())
        return json.dumps({"file_name": name, "text": caption})

    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:  # the server answers PUTs concurrently
        rows = list(pool.map(put, range(n)))
    if variant == "metadata":
        with fs.open_output_stream(f"{bucket[5:]}/images/metadata.jsonl") as f:
            f.write(("\n".join(rows) + "\n").encode())


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak_rss() -> None:
    """Start a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM), so each phase has its own peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_mb(*fields: str) -> dict[str, float]:
    """/proc/self/status memory fields in MB: e.g. ``VmHWM`` (peak RSS since :func:`_reset_peak_rss`), ``VmRSS``
    (now), or a part of it (``RssAnon``, ``RssShmem``, ``RssFile``)."""
    with open("/proc/self/status") as f:
        rows = dict(line.split(":", 1) for line in f)
    return {k: int(rows[k].split()[0]) / 1024 for k in fields}


class _Sampler:
    """The peak of each part of the driver's RSS over a phase, sampled every 50 ms in a thread: anonymous memory
    (the process's own heap: Python, Arrow, Ray's core worker) apart from shared memory (object-store pages the
    driver mapped while putting or reading objects, which live in the object store, not in the driver). VmHWM gives
    only the total's peak."""

    FIELDS = ("RssAnon", "RssShmem", "RssFile")

    def __init__(self):
        import threading

        self.start = _status_mb(*self.FIELDS)
        self.peak = dict(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            for k, v in _status_mb(*self.FIELDS).items():
                self.peak[k] = max(self.peak[k], v)

    def growth(self) -> dict[str, float]:
        """Each part's peak above where it started, in MB."""
        self._stop.set()
        self._thread.join()
        return {k: round(self.peak[k] - self.start[k], 1) for k in self.FIELDS}


def _count(server: Server, since: int, prefix: str = "") -> tuple[int, dict]:
    by: dict[str, int] = {}
    for m, p in server.requests(since):
        if p.startswith(prefix):
            where = next((w for w in ("images", "masks", "cache") if f"/{w}/" in p), "run")
            by[f"{m} {where}"] = by.get(f"{m} {where}", 0) + 1
    return sum(by.values()), dict(sorted(by.items()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--images",
        type=int,
        nargs="+",
        default=[500],
        help="N; several values (with --discover-only or --skip-train) measure the driver's RSS "
        "slope per image in each phase",
    )
    parser.add_argument("--repeats", type=int, default=1, help="with several --images: fresh runs per N")
    parser.add_argument("--per-folder", type=int, default=1000, help="images per folder")
    parser.add_argument(
        "--local",
        action="store_true",
        help="with --discover-only or --skip-train: images in a local folder instead of the S3 "
        "server (large N fast; no requests counted)",
    )
    parser.add_argument("--variant", choices=["sidecar", "metadata"], default="sidecar")
    parser.add_argument("--skip-train", action="store_true", help="stop after the cache phases")
    parser.add_argument("--masks", action="store_true", help="a loss mask per image (data.mask=dir, on S3)")
    parser.add_argument("--no-heap", action="store_true", help="no tracemalloc (for the peak-RSS slope)")
    parser.add_argument("--discover-only", action="store_true", help="stop after the discovery phase")
    parser.add_argument("--batch-size", type=int, default=1, help="train.batch_size of the training phases")
    parser.add_argument(
        "--read-run",
        type=int,
        default=0,
        help="train.feed.shuffle_block of the training phases (0: its default); 1 is a per-sample shuffle",
    )
    parser.add_argument(
        "--kill-at",
        type=float,
        default=0.7,
        help="SIGKILL the training run once a checkpoint past this fraction of the epoch is committed",
    )
    args = parser.parse_args(argv)
    if len(args.images) > 1 or args.repeats > 1:
        if not (args.discover_only or args.skip_train):
            parser.error(
                "several --images or --repeats measure the driver's RSS slope, without training: add "
                "--discover-only or --skip-train"
            )
        _slope(args)
        return
    args.images = args.images[0]
    if args.local:
        if not (args.discover_only or args.skip_train):
            parser.error(
                "--local has no server to count requests on and no training phase: add --discover-only or --skip-train"
            )
        try:
            _run(None, args)
        finally:
            import ray

            ray.shutdown()
        return
    server = Server()
    try:
        _run(server, args)
    finally:
        import ray

        ray.shutdown()
        server.stop()


def _slope(args) -> None:
    """The driver's RSS growth per image in each phase run (discovery only, or every cache phase with
    ``--skip-train``): each (N, repeat) in a fresh process (the allocator keeps what an earlier run freed, so one
    process cannot measure several N), then a least-squares line per phase through all its points. The spread is
    the slope's standard error; each repeat's own slope (over all N) shows it too."""
    import statistics

    points: dict[str, list[tuple[int, int, float]]] = {}
    for rep in range(args.repeats):
        for n in args.images:
            cmd = [
                sys.executable,
                __file__,
                "--no-heap",
                "--images",
                str(n),
                "--per-folder",
                str(args.per_folder),
                "--discover-only" if args.discover_only else "--skip-train",
            ]
            cmd += ["--local"] if args.local else []
            out = subprocess.run(cmd, capture_output=True, text=True, check=True)
            for line in out.stdout.splitlines():
                rec = json.loads(line) if line.startswith("{") else {}
                if rec.get("phase") in _RSS_PHASES:
                    growth, parts = rec["driver_phase_rss_growth_mb"], rec["driver_phase_growth_by_part_mb"]
                    points.setdefault(rec["phase"], []).append((rep, n, growth))
                    for part in ("RssAnon", "RssShmem"):  # each part's own slope, named e.g. "cache RssAnon"
                        points.setdefault(f"{rec['phase']} {part}", []).append((rep, n, parts[part]))
                    print(
                        json.dumps(
                            {
                                "phase": f"{rec['phase']}-point",
                                "repeat": rep,
                                "images": n,
                                "seconds": rec["seconds"],
                                "driver_phase_rss_growth_mb": growth,
                                "by_part_mb": parts,
                            }
                        ),
                        flush=True,
                    )

    def fit(pts) -> tuple[float, float, float]:  # (KB per image, its standard error, MB at N = 0)
        xs, ys = [p[1] for p in pts], [p[2] * 1024 for p in pts]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
        a = my - b * mx
        dof = len(pts) - 2
        se = (sum((y - a - b * x) ** 2 for x, y in zip(xs, ys)) / dof / sxx) ** 0.5 if dof > 0 else float("nan")
        return b, se, a / 1024

    for name, pts in points.items():
        b, se, a = fit(pts)
        each = [round(fit([p for p in pts if p[0] == r])[0], 3) for r in range(args.repeats)]
        print(
            json.dumps(
                {
                    "phase": f"{name}-slope",
                    "where": "local" if args.local else "s3",
                    "images": args.images,
                    "per_folder": args.per_folder,
                    "repeats": args.repeats,
                    "kb_per_image": round(b, 3),
                    "stderr_kb": round(se, 3),
                    "per_repeat_kb": each,
                    "intercept_mb": round(a, 1),
                    "at_10m_gb": round(b * 10_000_000 / 2**20, 2),
                }
            ),
            flush=True,
        )


_RSS_PHASES = ("discover", "cache", "rerun", "refresh")
"""The phases whose driver RSS growth the slope mode fits."""


def _put_local(root: str, n: int, per_folder: int = 1000) -> None:
    """The same images and sidecar captions as :func:`_put_images`, in a local folder."""
    import io

    from PIL import Image

    sizes = [(64, 64), (96, 64), (64, 96), (80, 80)]
    for k in range(n):
        img = Image.new("RGB", sizes[k % 4], ((k * 53) % 256, (k * 97) % 256, (k * 29) % 256))
        buf = io.BytesIO()
        img.save(buf, "PNG")
        path = Path(root, "images", f"{k // per_folder:04d}", f"img{k:06d}.png")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(buf.getvalue())
        path.with_suffix(".txt").write_text(f"photo {k} of a square, shade {k % 256}")


def _run(server: Server | None, args) -> None:
    import ray

    from rayflux import config, generation_stages, job, models, progress
    from rayflux.ledger import Ledger
    from rayflux.cache import discover
    from rayflux.testing.tiny import ensure_tiny_model

    n, bucket = args.images, f"s3://bench-{args.variant}-{os.getpid()}"
    t0 = time.perf_counter()
    if server is None:
        local = tempfile.TemporaryDirectory(prefix="bench-scale-")
        bucket = local.name
        _put_local(bucket, n, args.per_folder)
    else:
        _put_images(bucket, n, args.variant, args.per_folder, args.masks)
    setup = {
        "phase": "setup",
        "seconds": round(time.perf_counter() - t0, 1),
        "requests": sum(1 for _ in server.requests()) if server else 0,
    }
    print(json.dumps(setup), flush=True)
    sets = [
        f"model.path={ensure_tiny_model()}",
        f"data.images_dir={bucket}/images",
        f"run.output_dir={bucket}/run",
        "data.resolution=64",
        "data.crop=center",
        "train.epochs=1",
        f"train.batch_size={args.batch_size}",
        "train.workers.num_workers=1",
        "cache.refresh=never",
    ]
    if args.variant == "metadata":
        sets.append("data.caption_strategy=metadata")
    if args.read_run:
        sets.append(f"train.feed.shuffle_block={args.read_run}")
    if args.masks:
        sets += ["data.mask=dir", f"data.mask_dir={bucket}/masks"]
    # A checkpoint every tenth of the epoch: the killed run leaves one near its end to resume from.
    sets.append(f"train.checkpoint.every={max(-(-n // args.batch_size) // 10, 1)}")
    cfg = config.load(None, sets)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    progress.quiet_operator_bars()
    # The driver's own Python allocations per phase, above what it already held: the part that grows with N
    # (the process's RSS is mostly imported libraries at any N).
    if not args.no_heap:
        tracemalloc.start()

    def phase(name: str, fn, prefix: str = f"/{bucket[5:]}"):
        since = server.mark() if server else 0
        t = time.perf_counter()
        tracemalloc.reset_peak()
        held = tracemalloc.get_traced_memory()[0]
        _reset_peak_rss()
        # What earlier phases (and the upload) left: the growth is this phase's own.
        at_start = _status_mb("VmRSS")["VmRSS"]
        parts = _Sampler()
        out = fn()
        seconds, heap = time.perf_counter() - t, tracemalloc.get_traced_memory()[1] - held  # before the log is read
        peak = _status_mb("VmHWM")["VmHWM"]
        total, by = _count(server, since, prefix) if server else (0, {})
        rec = {
            "phase": name,
            "images": n,
            "seconds": round(seconds, 2),
            "requests": total,
            "per_image": round(total / n, 4),
            "by": by,
            "driver_peak_rss_mb": round(_rss_mb(), 1),
            "driver_phase_peak_rss_mb": round(peak, 1),
            "driver_phase_rss_growth_mb": round(peak - at_start, 1),
            "driver_heap_peak_mb": round(heap / 2**20, 1),
            "driver_phase_growth_by_part_mb": parts.growth(),
        }
        print(json.dumps(rec), flush=True)
        return out, rec

    facts = models.model_facts(cfg.model)
    phase("discover", lambda: discover.discover(cfg, facts, cfg.cache.seed))
    if args.discover_only:
        if server is None:
            local.cleanup()
        return
    first, _ = phase("cache", lambda: job.run(cfg, only="cache"))
    phase("rerun", lambda: job.run(cfg, only="cache"))
    if not args.skip_train:
        _train_killed_and_resumed(server, args, cfg, sets, bucket, phase)
    # Refresh: generation 1 of the same cache key with its own seed, nothing else changed.
    images, cache_root, out = job.resolve_dirs(cfg)
    stages = generation_stages.GenerationStages(
        cfg, facts, Ledger(out, job.run_identity(cfg)), cache_root, False, job.Summary()
    )
    g0 = stages.generation(0)
    g1, _ = phase("refresh", lambda: stages.generation(1))
    written = lambda m: sum(f["bytes"] for f in m["files"] + m["text_files"])  # noqa: E731
    indexed = lambda m: sum(e["bytes"] for e in m["index"].values())  # noqa: E731
    staged = g1.get("staged_bytes", 0)  # written, then swept at commit: bytes written all the same
    print(
        json.dumps(
            {
                "phase": "refresh-bytes",
                "g0_shard_bytes": written(g0),
                "g1_shard_bytes": written(g1),
                "g1_index_bytes": indexed(g1),
                "g1_staged_bytes": staged,
                "ratio": round((written(g1) + indexed(g1) + staged) / max(written(g0), 1), 4),
            }
        ),
        flush=True,
    )
    if server is None:
        local.cleanup()


# The killed run: the job with its own fresh local Ray, as a user's driver process would run it.
_TRAIN = """
import sys, ray
from rayflux import config, job
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
job.run(config.load(None, sys.argv[1:]))
"""


def _descendants(pid: int) -> list[int]:
    """Every process started below ``pid`` (Ray's own services included), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _train_killed_and_resumed(server: Server, args, cfg, sets: list[str], bucket: str, phase) -> None:
    """One epoch in its own process, SIGKILLed after a checkpoint near the end; then the rerun that resumes it."""
    import signal

    import ray

    from rayflux import job
    from rayflux.train.resume import commits

    steps = -(-args.images // args.batch_size)
    every = cfg.train.checkpoint.every
    kill_after = max(int(steps * args.kill_at) // every * every, every)
    run_dir = commits.run_storage(cfg.run.output_dir, cfg.run.name)
    ray.shutdown()  # the killed run starts its own Ray, as a user's driver does

    sizes: dict[int, int] = {}  # each checkpoint step of the killed run: the checkpoint's bytes in storage

    def killed():
        proc = subprocess.Popen(
            [sys.executable, "-c", _TRAIN, *sets],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            while proc.poll() is None:
                latest = commits.latest(run_dir)
                step = commits.read_json(latest)["step"] if latest else 0
                if latest and step not in sizes:
                    sizes[step] = _tree_bytes(latest)
                if step >= kill_after:
                    below = _descendants(proc.pid)
                    os.kill(proc.pid, signal.SIGKILL)
                    for pid in below:  # Ray's services and workers started by that driver, each by its id
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    proc.wait()
                    return step
                time.sleep(1.0)
            raise RuntimeError(f"the training run ended (exit {proc.returncode}) before step {kill_after}")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    since = server.mark()
    at, rec = phase("train-killed", killed)
    reads = [r for r in server.requests(since) if "/cache/" in r[1]]
    print(
        json.dumps(
            {
                "phase": "train-killed-reads",
                "checkpoint_step": at,
                "epoch_steps_about": steps,
                "cache_requests": len(reads),
                "per_checkpointed_sample": round(len(reads) / max(at * args.batch_size, 1), 3),
            }
        ),
        flush=True,
    )
    print(
        json.dumps({"phase": "checkpoint-bytes", "by_step": {str(k): v for k, v in sorted(sizes.items())}}), flush=True
    )
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    since = server.mark()
    summary, rec = phase("resume", lambda: job.run(cfg))
    reads = [r for r in server.requests(since) if "/cache/" in r[1]]
    trained = (summary.steps - at) * args.batch_size
    print(
        json.dumps(
            {
                "phase": "resume-reads",
                "resumed_from_step": at,
                "final_step": summary.steps,
                "trained_samples": trained,
                "cache_requests": len(reads),
                "per_trained_sample": round(len(reads) / max(trained, 1), 3),
            }
        ),
        flush=True,
    )
    # What the training loop itself counted (the step log): bytes fetched against the tensors' bytes, and its GETs.
    from rayflux.train.observe import metrics

    history = metrics.read_steps(cfg.run.output_dir)
    for name, part in (
        ("killed", [h for h in history if h["step"] <= at]),
        ("resume", [h for h in history if h["step"] > at]),
    ):
        total = {k: sum(h.get(k, 0) for h in part) for k in ("read_bytes", "tensor_bytes", "read_requests", "samples")}
        print(
            json.dumps(
                {
                    "phase": f"{name}-read-bytes",
                    "steps": len(part),
                    **total,
                    "bytes_over_tensor_bytes": round(total["read_bytes"] / max(total["tensor_bytes"], 1), 4),
                    "loop_requests_per_sample": round(total["read_requests"] / max(total["samples"], 1), 4),
                }
            ),
            flush=True,
        )


def _tree_bytes(uri: str) -> int:
    """The bytes of every file under ``uri`` (one listing)."""
    import pyarrow.fs as pafs

    from rayflux import storage

    fs, inner = storage.resolve(uri)
    return sum(i.size or 0 for i in fs.get_file_info(pafs.FileSelector(inner, recursive=True)) if i.is_file)


if __name__ == "__main__":
    main()
