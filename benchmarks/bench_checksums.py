"""What the per-tensor checksum costs a training read: CRC-32 time per sample against the read that fetches it.

    python benchmarks/bench_checksums.py [--samples 64] [--resolution 1024] [--rounds 5]

Writes one shard of ``--samples`` rows with FLUX.1-dev's real tensor sizes in bf16 (a 16 x res/8 x res/8 latent,
T5 512 x 4096, CLIP 768), each row its own caption, through the cache's own encoder (``shards.encode_table``) and
checksums (``shards.value_ranges``). Then it reads every sample with the trainer's own read
(``rayflux.cache.reads.stack_all``: ranged reads, checksums, value checks, stacking) from the local file, warm in the
page cache: the fastest read there is, so the checksum's share is at its largest. The same bytes are then
checksummed alone (``zlib.crc32``). Reported per sample, twice: with its caption's text read too (a caption the
process has not seen) and latent only (a caption already in the process's text cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _shards(work: Path, n: int, res: int) -> tuple[dict, dict, dict]:
    """A samples shard (latents) and a text shard (T5, CLIP), as the cache keeps them: ({kind: path}, {kind: size},
    {column: [(offset, length, checksum)]})."""
    import numpy as np
    import pyarrow as pa

    from rayflux.cache import shards

    rng = np.random.default_rng(0)

    def bf16(*shape) -> bytes:  # random normal values as bf16 bit patterns
        return (rng.standard_normal(shape, np.float32).view(np.uint32) >> 16).astype(np.uint16).tobytes()

    kinds = {
        "samples": {"latent": [bf16(16, res // 8, res // 8) for _ in range(n)]},
        "text": {"t5": [bf16(512, 4096) for _ in range(n)], "clip_pooled": [bf16(768) for _ in range(n)]},
    }
    paths, sizes, ranges = {}, {}, {}
    for kind, cols in kinds.items():
        data = shards.encode_table(pa.table({k: pa.array(v, pa.binary()) for k, v in cols.items()}))
        paths[kind] = str(work / f"{kind}.parquet")
        Path(paths[kind]).write_bytes(data)
        sizes[kind] = len(data)
        ranges.update(shards.value_ranges(data, list(cols)))
    return paths, sizes, ranges


def _items(paths: dict, sizes: dict, ranges: dict, res: int, layout: str) -> list[dict]:
    """One planned batch of one sample per sample, in the feed's own form (see rayflux.train.data.batching.plan_epoch)."""
    items = []
    for i, ((off, n, crc), (t_off, t_n, t_crc), (c_off, c_n, c_crc)) in enumerate(
        zip(ranges["latent"], ranges["t5"], ranges["clip_pooled"])
    ):
        parts = [[t_off, t_n, [512, 4096], t_crc], [c_off, c_n, [768], c_crc]]
        loc = json.dumps([paths["text"], sizes["text"], f"caption-{i}", parts])
        # A PlannedSample (rayflux.cache.layout): file, row, id, file size, latent shape, source, text, refs,
        # and {name: [offset, length, crc32]} of each declared sample tensor (here the latent alone).
        ref = [paths["samples"], i, f"s{i}", sizes["samples"], f"16,{res // 8},{res // 8}", "bench", loc, 0]
        ref.append({"latent": [off, n, crc], "ref_latent": [0, 0, 0], "mask": [0, 0, 0]})  # optional, absent
        items.append(
            {
                "bucket": f"{res}x{res}",
                "refs": json.dumps([ref]),
                "layout": layout,
                "generation_dir": "g00000",
                "weights": "[1.0]",
            }
        )
    return items


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--resolution", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from dataclasses import asdict

    from rayflux.cache import reads, shards
    from rayflux.families.base import TextTensor

    text = (TextTensor("t5", ("t5_len", "t5_dim"), "t5", 512), TextTensor("clip_pooled", ("clip_dim",), "clip"))
    layout = shards.ShardLayout("samples", "bfloat16", 16, 8, text)
    work = Path(tempfile.mkdtemp(prefix="bench-checksums-"))
    paths, sizes, ranges = _shards(work, args.samples, args.resolution)
    layout_json = json.dumps(asdict(layout))
    raw = {c: Path(paths["samples" if c == "latent" else "text"]).read_bytes() for c in ranges}
    out = {}
    for with_text in (True, False):
        items = _items(paths, sizes, ranges, args.resolution, layout_json)
        reads.stack_all(items, lambda *a: {})  # warm the page cache (and, latent only, the process's text cache)
        read_s, crc_s = [], []
        for _ in range(args.rounds):
            if with_text:
                reads._text_cache.clear()
                reads._text_cache_bytes = 0
            t = time.perf_counter()
            reads.stack_all(items, lambda *a: {})
            read_s.append((time.perf_counter() - t) / args.samples)
            cols = ("latent", "t5", "clip_pooled") if with_text else ("latent",)
            spans = [(memoryview(raw[c]), off, n) for c in cols for off, n, _ in ranges[c]]
            t = time.perf_counter()
            for view, off, n in spans:
                zlib.crc32(view[off : off + n])
            crc_s.append((time.perf_counter() - t) / args.samples)
        read, crc = statistics.median(read_s), statistics.median(crc_s)
        name = "latent + caption text" if with_text else "latent only"
        nbytes = sum(n for c in cols for _, n, _ in ranges[c]) / args.samples
        out[name] = {
            "bytes_per_sample": nbytes,
            "read_ms": read * 1e3,
            "checksum_ms": crc * 1e3,
            "share_of_read": crc / read,
            "crc_GBps": nbytes / crc / 1e9,
        }
        print(
            f"{name:>22}: {nbytes / 1024:8.0f} KiB a sample; read (trainer's own, checksums included) "
            f"{read * 1e3:6.2f} ms, of which checksum {crc * 1e3:5.3f} ms = {100 * crc / read:4.1f}% "
            f"({nbytes / crc / 1e9:.1f} GB/s)"
        )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
