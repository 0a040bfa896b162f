"""Requests and wall time of rayflux's S3 read paths, clean and with injected 503 SlowDown.

Against the loopback S3 server (tests/s3server.py) behind the fault proxy (tests/fault_proxy.py): N objects of an
image's size are listed (walk.files), read whole (storage.read_bytes: images, captions) and read by byte ranges
(cache.ranges: training), once with no faults and once with ``--rate`` of requests answered 503 SlowDown.

    PYTHONPATH=. python benchmarks/bench_s3_faults.py --objects 200 --rate 0.05
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))


def _phase(proxy, root: str, blobs: dict[str, bytes]) -> dict:
    from rayflux import storage
    from rayflux.discovery import walk
    from rayflux.cache import ranges

    before = len(proxy.fault_log())
    t = time.perf_counter()
    fs, inner = storage.resolve(root)
    assert walk.files(fs, inner).num_rows == len(blobs)
    for uri, blob in blobs.items():
        assert storage.read_bytes(uri) == blob
        assert ranges.read_ranges(uri, len(blob), [(0, 4096), (len(blob) // 2, 8192)]) == [
            blob[:4096], blob[len(blob) // 2 : len(blob) // 2 + 8192]
        ]  # fmt: skip
    wall = time.perf_counter() - t
    log = proxy.fault_log()[before:]
    return {"wall_s": round(wall, 2), "requests": len(log), "outcomes": dict(collections.Counter(e[4] for e in log))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--objects", type=int, default=200)
    p.add_argument("--bytes", type=int, default=60_000, help="size of each object (a small JPEG)")
    p.add_argument("--rate", type=float, default=0.05)
    p.add_argument("--reads", choices=["boto3", "pyarrow"], default="boto3")
    args = p.parse_args()
    import s3server

    port = s3server._free_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1", RAYFLUX_S3_READS=args.reads)  # fmt: skip
    server = s3server.S3Server(port)
    proxy = s3server.FaultProxy(server.url)
    try:
        from rayflux import storage

        root = "s3://bench-faults"
        storage.resolve(root)[0].create_dir(root[5:])
        blobs = {f"{root}/imgs/{i:05d}.jpg": os.urandom(args.bytes) for i in range(args.objects)}
        for uri, blob in blobs.items():
            storage.write_bytes_atomic(uri, blob)  # straight to the server
        os.environ["AWS_ENDPOINT_URL"] = proxy.url
        clean = _phase(proxy, root, blobs)
        proxy.faults(rate=args.rate, seed=1)
        faulty = _phase(proxy, root, blobs)
        print(f"{args.objects} objects of {args.bytes} B, reads via {args.reads}")
        print(f"clean:          {clean}")
        print(f"{args.rate:.0%} 503s:       {faulty}")
    finally:
        proxy.stop()
        server.stop()


if __name__ == "__main__":
    main()
