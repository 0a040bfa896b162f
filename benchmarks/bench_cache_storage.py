"""Cache storage benchmark: bytes per row ÷ raw tensor bytes, and text-encoder passes ÷ unique captions.

Runs the real cache stage (Ray Data, the real encoder classes) on generated images with repeated captions, then
measures the written shards with pyarrow alone:

- **row tensor ratio**: per row, the Parquet column chunks of its tensors ÷ their raw bytes: ``latent`` ÷
  ``C·h·w · itemsize`` for a sample row, the text tensors (FLUX.1: ``t5`` and ``clip_pooled``) ÷ their shapes' raw
  bytes for a caption's text row (stored once per caption, compressed where that pays); target ≤ 1.02, the worst
  row counts;
- **file ratio**: whole shard files (footers and id columns included) ÷ raw tensor bytes;
- **text passes ratio**: text rows stamped by this build's text encoder ÷ unique captions the generation needs
  (the images' distinct captions plus the empty caption kept for caption dropout); target 1.0.

Model shapes, all with random weights: ``tiny`` (the test model: 4 latent channels, 32-wide text), ``wide`` (16
latent channels like FLUX, 768-wide text, 512 T5 tokens), so the per-row fixed costs show against tensors of
realistic size, and ``klein`` (the tiny FLUX.2 [klein]: one stacked text tensor, ``prompt_embeds``).

Then, side by side in the same run, the generation as written (text tensors compressed where that pays,
:mod:`rayflux.cache.codec`) against a raw copy of it (every text tensor decoded back into its shard, the caption
index without codec columns: what rayflux wrote before codecs, and still reads):

- **bytes per image**: every file of the generation (shards, index, manifest, skip list) ÷ cached images;
- **read per sample**: the trainer's own read (:func:`rayflux.train.data.batching.load_batches`: ranged reads, checksums,
  decoding, value checks, stacking) of every planned batch, the process's text cache emptied first, so each caption's
  text is read and decoded once, as in a worker's first epoch; median of ``--rounds``, milliseconds per sample.

``--demo`` uses the images of ``benchmarks/bench_cold.py`` (the demo's shapes, nearly one caption per image: the
setup measured against SimpleTuner) instead of ``--captions`` repeated captions.

    python benchmarks/bench_cache_storage.py [--images 24] [--captions 6] [--resolution 512] [--dtype float32]
    python benchmarks/bench_cache_storage.py --demo --images 32 --resolution 256 --models tiny
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_cold's demo images (--demo)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = {
    "tiny": {"latent_channels": 4, "text_dim": 32},
    "wide": {"latent_channels": 16, "text_dim": 768},
}
SIZES = [(640, 512), (512, 640), (512, 512), (768, 384)]


def write_images(root: Path, n: int, captions: int) -> int:
    """``n`` captioned images cycling through ``captions`` distinct captions; returns the distinct caption count."""
    from rayflux.testing.images import draw

    root.mkdir(parents=True, exist_ok=True)
    colours = ["red", "green", "blue", "yellow", "purple", "orange", "white", "black"]
    shapes = ["circle", "square", "triangle", "stripe", "ring", "cross"]
    used = set()
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        c = i % captions
        colour, shape, back = colours[c % 8], shapes[c % 6], colours[(c + 3) % 8]
        draw(w, h, colour, shape, back, seed=i).save(root / f"img_{i:04d}.png")
        text = f"a {colour} {shape} on a {back} background"
        (root / f"img_{i:04d}.txt").write_text(text)
        used.add(text)
    return len(used)


def measure(manifest: dict) -> dict:
    """The ratios, read back from the shard files with pyarrow only."""
    import numpy as np
    import pyarrow.parquet as pq

    from rayflux.cache import generations

    def chunks(pf, i: int) -> dict:
        rg = pf.metadata.row_group(i)
        return {rg.column(j).path_in_schema: rg.column(j).total_compressed_size for j in range(rg.num_columns)}

    worst_row, worst_latent, raw_total, file_total, rows = 0.0, 0.0, 0, 0, 0
    for path in generations.sample_files(manifest):
        pf = pq.ParquetFile(path)
        shapes = pf.read(columns=["latent_c", "latent_h", "latent_w", "latent_dtype"]).to_pylist()
        for i, s in enumerate(shapes):
            latent_raw = s["latent_c"] * s["latent_h"] * s["latent_w"] * np.dtype(_np_dtype(s["latent_dtype"])).itemsize
            worst_latent = max(worst_latent, chunks(pf, i)["latent"] / latent_raw)
            raw_total += latent_raw
            rows += 1
        file_total += os.path.getsize(path)
    # Text embeddings are stored once per caption, in the text shards (schema 4).
    # The model family's named text tensors (FLUX.1: t5, clip_pooled; FLUX.2: prompt_embeds), each by its shape columns.
    text = manifest["layout"]["text"]
    dims = [d for t in text for d in t["dims"]]
    for path in generations.text_files(manifest):
        pf = pq.ParquetFile(path)
        for i, s in enumerate(pf.read(columns=[*dims, "text_dtype"]).to_pylist()):
            values = sum(int(np.prod([s[d] for d in t["dims"]])) for t in text)
            text_raw = values * np.dtype(_np_dtype(s["text_dtype"])).itemsize
            c = chunks(pf, i)
            worst_row = max(worst_row, sum(c[t["name"]] for t in text) / text_raw)
            raw_total += text_raw
        file_total += os.path.getsize(path)
    worst_row = max(worst_row, worst_latent)
    text = pq.ParquetDataset(generations.text_files(manifest)).read(columns=["caption_id", "encode_id"])
    passes = sum(1 for e in text["encode_id"].to_pylist() if e == manifest["encode_id"])
    return {
        "rows": rows,
        "raw_bytes_per_row": raw_total / rows,
        "row_tensor_ratio": worst_row,
        "latent_ratio": worst_latent,
        "file_ratio": file_total / raw_total,
        "text_passes": passes,
        "unique_captions": len(set(text["caption_id"].to_pylist())),
    }


def _np_dtype(name: str) -> str:
    return "uint16" if name == "bfloat16" else name


def raw_copy(gen_dir: str, dest: Path) -> str:
    """A copy of a committed generation with every text tensor stored raw and a caption index without codec columns
    (as rayflux wrote them before :mod:`rayflux.cache.codec`): its directory."""
    import shutil

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the rewrite is a test fixture
    from raw_text import rewrite_without_codecs

    src = Path(gen_dir)
    gen = dest / src.parent.name / src.name
    shutil.copytree(src, gen)
    rewrite_without_codecs(gen)
    return str(gen)


def stored_as(gen_dir: str, rounds: int) -> dict:
    """Bytes per image and the trainer's read time per sample (ms, one figure per round) of one generation."""
    import time

    from rayflux.cache import generations, reads
    from rayflux.train.data import batching

    manifest = generations.load_manifest(gen_dir)
    files = [p for p in Path(gen_dir).rglob("*") if p.is_file()]
    refs = batching.index_samples(manifest)
    planned, _ = batching.plan_epoch(refs, 1, seed=0, epoch=0, world_size=1)  # the job's default: batch 1
    items = [{**item, "step": 0, "total_steps": 1} for item in planned]
    times = []
    for _ in range(rounds):
        reads._text_cache.clear()  # every caption read and decoded once, as in a worker's first epoch
        reads._text_cache_bytes = 0
        start = time.perf_counter()
        batching.load_batches(items)
        times.append((time.perf_counter() - start) / len(refs) * 1e3)
    return {"bytes_per_image": sum(p.stat().st_size for p in files) / manifest["cached"], "read_ms": times}


def per_tensor(raw_gen: str) -> list[dict]:
    """Per stored tensor column (each text tensor, the latent), read from a raw generation: its raw bytes, the
    stored ÷ raw of plain zstd and of :mod:`rayflux.cache.codec`'s shuffled zstd, and the codec's decode time per
    tensor (ms, median over the tensors). What decides which tensors the writer compresses."""
    import statistics
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayflux.cache import codec, generations, tensors

    manifest = generations.load_manifest(raw_gen)
    dtype, text = manifest["layout"]["dtype"], manifest["layout"]["text"]
    itemsize = tensors.ITEMSIZE[dtype]
    columns = {t["name"]: generations.text_files(manifest) for t in text}
    columns["latent"] = generations.sample_files(manifest)
    zstd = pa.Codec("zstd", codec.LEVEL)
    out = []
    for name, paths in columns.items():
        values = [v for p in paths for v in pq.read_table(p, columns=[name])[name].to_pylist()]
        raw = sum(len(v) for v in values)
        plain = sum(len(zstd.compress(v, asbytes=True)) for v in values)
        stored, times = 0, []
        for v in values:
            packed = zstd.compress(codec.shuffle(v, itemsize), asbytes=True)
            stored += len(packed)
            start = time.perf_counter()
            codec.decode(packed, codec.SHUFFLE_ZSTD, dtype, (len(v) // itemsize,))
            times.append((time.perf_counter() - start) * 1e3)
        out.append(
            {
                "tensor": name,
                "raw": raw / len(values),
                "zstd": plain / raw,
                "shuffle": stored / raw,
                "decode_ms": statistics.median(times),
            }
        )
    return out


def compare(gen_dir: str, work: Path, rounds: int) -> dict:
    """:func:`stored_as` for the generation as written and for its raw copy, their rounds interleaved."""
    raw = raw_copy(gen_dir, work / "raw-copy")
    out = {"compressed": [], "raw": []}
    for _ in range(rounds):
        out["compressed"].append(stored_as(gen_dir, 1))
        out["raw"].append(stored_as(raw, 1))
    import statistics

    result = {
        k: {"bytes_per_image": v[0]["bytes_per_image"], "read_ms": statistics.median(r["read_ms"][0] for r in v)}
        for k, v in out.items()
    }
    result["tensors"] = per_tensor(raw)
    return result


def run_one(name: str, args, work: Path) -> dict:
    from rayflux import config, models
    from rayflux.cache import generations
    from rayflux.cache.stage import build_generation, inputs_signature
    from rayflux.cache.keys import cache_key
    from rayflux.discovery.in_process import discover
    from rayflux.testing.tiny import TinySpec, ensure_tiny_model

    if name == "klein":  # FLUX.2 [klein]: one stacked text tensor, prompt_embeds
        from rayflux.testing.tiny_flux2 import ensure_tiny_flux2_klein

        model = ensure_tiny_flux2_klein(work / "model-klein")
    else:
        model = ensure_tiny_model(work / f"model-{name}", TinySpec(**MODELS[name]))
    images = work / "images"
    if args.demo:
        from bench_cold import write_images as demo_images

        demo_images(images, args.images)
        distinct = len({p.read_text() for p in images.glob("*.txt")})
    else:
        distinct = write_images(images, args.images, args.captions) if not images.exists() else args.captions
    cfg = config.load(
        None,
        [
            f"model.path={model}",
            f"data.images_dir={images}",
            f"cache.dir={work / f'cache-{name}'}",
            f"data.resolution={args.resolution}",
            f"cache.dtype={args.dtype}",
            "cache.batch_size=8",
        ],
    )
    facts = models.model_facts(cfg.model)
    discovery = discover(cfg.data, seed=0)
    gen_dir = generations.generation_dir(cfg.cache.dir, cache_key(cfg, facts), 0, inputs_signature(discovery))
    manifest = build_generation(cfg, facts, discovery, gen_dir, 0, 0, cluster_gpus=False)
    result = measure(manifest)
    result["distinct_image_captions"] = distinct
    result["stored_as"] = compare(gen_dir, work / f"compare-{name}", args.rounds)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=24)
    p.add_argument("--captions", type=int, default=6, help="distinct captions among the images")
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--models", default="tiny,wide")
    p.add_argument("--demo", action="store_true", help="bench_cold.py's demo images (the SimpleTuner setup)")
    p.add_argument("--rounds", type=int, default=5, help="read timings: rounds of each, interleaved")
    args = p.parse_args()

    import ray
    from ray.data import DataContext

    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    DataContext.get_current().enable_progress_bars = False
    try:
        with tempfile.TemporaryDirectory(prefix="rayflux-bench-storage-") as tmp:
            captions = "bench_cold's demo captions" if args.demo else f"{args.captions} distinct captions"
            print(f"{args.images} images, {captions}, {args.resolution} px, {args.dtype}")
            print(
                "| model | raw tensor bytes/row | row tensor ratio (worst) | latent ratio (worst) | file ratio "
                "| text passes ÷ unique captions |"
            )
            print("| --- | --- | --- | --- | --- | --- |")
            results = {}
            for name in args.models.split(","):
                r = results[name] = run_one(name, args, Path(tmp))
                print(
                    f"| {name} | {r['raw_bytes_per_row']:,.0f} | {r['row_tensor_ratio']:.4f} | {r['latent_ratio']:.4f} "
                    f"| {r['file_ratio']:.4f} | {r['text_passes']} ÷ {r['unique_captions']} = "
                    f"{r['text_passes'] / r['unique_captions']:.2f} |"
                )
                assert r["unique_captions"] == r["distinct_image_captions"] + 1  # plus the dropout caption ""
            print()
            print("| model | text tensors | bytes per image | ÷ raw | read per sample (ms, median) | ÷ raw |")
            print("| --- | --- | --- | --- | --- | --- |")
            for name, r in results.items():
                raw = r["stored_as"]["raw"]
                for kind in ("compressed", "raw"):
                    v = r["stored_as"][kind]
                    print(
                        f"| {name} | {kind} | {v['bytes_per_image']:,.0f} | "
                        f"{v['bytes_per_image'] / raw['bytes_per_image']:.3f} | {v['read_ms']:.3f} | "
                        f"{v['read_ms'] / raw['read_ms']:.2f} |"
                    )
            print()
            print("| model | tensor | raw bytes | zstd ÷ raw | shuffled zstd ÷ raw | decode (ms, median) |")
            print("| --- | --- | --- | --- | --- | --- |")
            for name, r in results.items():
                for t in r["stored_as"]["tensors"]:
                    print(
                        f"| {name} | {t['tensor']} | {t['raw']:,.0f} | {t['zstd']:.3f} | {t['shuffle']:.3f} "
                        f"| {t['decode_ms']:.3f} |"
                    )
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
