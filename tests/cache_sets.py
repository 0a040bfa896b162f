"""Datasets for the cache tests, made with Pillow, and one cache built from them that several test files share.

The shared dataset mixes what real folders hold: several buckets, duplicate captions, same-named files in different
folders, every awkward Pillow mode, an EXIF-rotated photo, missing and non-UTF-8 captions, and broken files.
"""

from __future__ import annotations

import io
import shutil
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

RED, BLUE = "a red circle on a blue background", "a blue square on a red background"
MAX_PIXELS = 200_000  # data.max_image_pixels for the shared cache: bad/big.png exceeds it


def picture(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A small image with a few coloured boxes, distinct for each seed."""
    img = Image.new("RGB", (width, height), ((seed * 53) % 256, (seed * 97) % 256, (seed * 29) % 256))
    d = ImageDraw.Draw(img)
    for k in range(3):
        x, y = (seed * 31 + k * 40) % width, (seed * 17 + k * 50) % height
        d.rectangle([x, y, x + width // 4, y + height // 4], fill=((k * 90) % 256, 200 - k * 60, (seed * 11) % 256))
    return img if mode == "RGB" else img.convert(mode)


def captioned_pictures(root: Path, n: int, caption: str | None = None) -> Path:
    """``root/images``: ``n`` small pictures, each with its own caption file (or all with ``caption``)."""
    images = root / "images"
    images.mkdir()
    for k in range(n):
        picture(64, 64, k).save(images / f"img{k}.png")
        (images / f"img{k}.txt").write_text(caption or f"caption number {k}")
    return images


def png_header_only(width: int, height: int) -> bytes:
    """A few hundred bytes of PNG whose header claims ``width`` x ``height``: a decompression bomb's calling card."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def exif_rotated_jpeg(stored_w: int, stored_h: int) -> bytes:
    """A JPEG stored ``stored_w`` x ``stored_h`` with a red top-left corner and EXIF orientation 6 (rotate 90° CW)."""
    img = Image.new("RGB", (stored_w, stored_h), (255, 255, 255))
    ImageDraw.Draw(img).rectangle([0, 0, stored_w // 4, stored_h // 4], fill=(255, 0, 0))
    exif = Image.Exif()
    exif[0x0112] = 6
    return encoded(img, "JPEG", exif=exif.tobytes(), quality=95)


@dataclass
class Expected:
    """What the cache must make of one file: a caption (cached) or a skip-reason fragment (skipped)."""

    caption: str | None = None
    skip: str | None = None


def write_mixed_dataset(root: Path) -> dict[str, Expected]:
    """Write the shared dataset under ``root``; returns the expected outcome per relative path."""
    files: dict[str, tuple[bytes, str | bytes | None, Expected]] = {}

    def good(rel: str, data: bytes, caption: str | None, expect_caption: str | None = None) -> None:
        files[rel] = (data, caption, Expected(caption=caption if expect_caption is None else expect_caption))

    def bad(rel: str, data: bytes, reason: str, caption: str | bytes | None = RED) -> None:
        files[rel] = (data, caption, Expected(skip=reason))

    png = picture(160, 128, 1)
    good("a/photo.png", encoded(png, "PNG"), RED)
    good("b/photo.png", encoded(picture(128, 160, 2), "PNG"), RED)
    good("c/photo.png", encoded(png, "PNG"), BLUE)  # same name and same bytes as a/photo.png, another folder
    good("wide.png", encoded(picture(256, 112, 3), "PNG"), BLUE)
    good("square.png", encoded(picture(144, 144, 4), "PNG"), RED)
    good("modes/cmyk.jpg", encoded(picture(128, 128, 5, "CMYK"), "JPEG", quality=95), BLUE)
    p = picture(128, 128, 6).convert("P", palette=Image.Palette.ADAPTIVE, colors=8)
    good("modes/palette.png", encoded(p, "PNG", transparency=0), RED)
    good("modes/la.png", encoded(picture(128, 128, 7, "LA"), "PNG"), RED)
    good("modes/gray16.png", encoded(Image.new("I;16", (128, 128), 40000), "PNG"), BLUE)
    good("modes/rgba.png", encoded(picture(128, 128, 8, "RGBA"), "PNG"), RED)
    good("exif/rotated.jpg", exif_rotated_jpeg(192, 128), BLUE)
    good("no_caption.png", encoded(picture(128, 128, 9), "PNG"), None, expect_caption="no caption")
    latin1 = "caf\xe9 au lait".encode("latin-1")
    bad("caps/latin1.png", encoded(picture(128, 128, 10), "PNG"), "not UTF-8", caption=latin1)
    full = encoded(picture(128, 128, 11), "PNG")
    bad("bad/truncated.png", full[: len(full) // 2], "truncated")
    jpg = encoded(picture(128, 128, 12), "JPEG", quality=90)
    bad("bad/truncated.jpg", jpg[: len(jpg) // 2], "truncated")
    bad("bad/zero.png", b"", "zero-byte")
    bad("bad/notes.jpg", b"<html><body>not an image</body></html>\n", "not a decodable image")
    bad("bad/bomb.png", png_header_only(30_000, 30_000), "decompression bomb")
    bad("bad/big.png", encoded(picture(600, 400, 13), "PNG"), "decompression bomb")
    bad("bad/tiny.png", encoded(picture(40, 40, 14), "PNG"), "min_image_size")

    for rel, (data, caption, _) in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if caption is not None:
            side = path.with_suffix(".txt")
            side.write_bytes(caption if isinstance(caption, bytes) else caption.encode())
    return {rel: exp for rel, (_, _, exp) in files.items()}


@dataclass
class BuiltCache:
    """A committed cache generation and everything used to build it."""

    cfg: object
    facts: object
    images: Path
    cache_root: Path
    gen_dir: str
    manifest: dict
    expected: dict[str, Expected]


def job_config(tiny_model: Path, images: Path, out: Path, *extra: str):
    from rayflux import config

    return config.load(
        None,
        [
            f"model.path={tiny_model}",
            f"data.images_dir={images}",
            f"run.output_dir={out / 'run'}",
            f"cache.dir={out / 'cache'}",
            *extra,
        ],
    )


def build(cfg, previous: dict | None = None, generation: int = 0, facts=None) -> tuple[str, dict]:
    """Run the real cache stage for ``cfg`` (Ray must be up); returns (generation dir, manifest)."""
    from rayflux import models
    from rayflux.cache import generations
    from rayflux.cache.stage import build_generation, inputs_signature
    from rayflux.cache.keys import cache_key
    from rayflux.discovery.in_process import discover

    facts = facts or models.model_facts(cfg.model)
    discovery = discover(cfg.data, seed=cfg.cache.seed)
    key = cache_key(cfg, facts)
    gen_dir = generations.generation_dir(cfg.cache.dir, key, generation, inputs_signature(discovery))
    manifest = build_generation(
        cfg, facts, discovery, gen_dir, generation, cfg.cache.seed, cluster_gpus=False, previous=previous
    )
    return gen_dir, manifest


_SHARED: dict[str, BuiltCache] = {}


def shared_cache(tmp_path_factory, tiny_model: Path) -> BuiltCache:
    """The mixed dataset cached once per test session (batch size 8, 128 px), whichever test file asks first."""
    if "mixed" not in _SHARED:
        from rayflux import models

        base = tmp_path_factory.mktemp("shared-cache")
        images = base / "images"
        expected = write_mixed_dataset(images)
        cfg = job_config(
            tiny_model,
            images,
            base,
            "data.resolution=128",
            f"data.max_image_pixels={MAX_PIXELS}",
            "cache.batch_size=8",
            "data.missing_caption=filename",
        )
        facts = models.model_facts(cfg.model)
        gen_dir, manifest = build(cfg, facts=facts)
        _SHARED["mixed"] = BuiltCache(cfg, facts, images, base / "cache", gen_dir, manifest, expected)
    return _SHARED["mixed"]


def copy_generation(built: BuiltCache, dest: Path) -> Path:
    """A private copy of the shared generation (same key/gNNNNN layout), for tests that corrupt it."""
    src = Path(built.gen_dir)
    target = dest / src.parent.name / src.name
    shutil.copytree(src, target)
    return target


def rewrite_rows(path: Path, change) -> list[dict]:
    """Rewrite a shard with plain pyarrow after ``change(rows)`` edits its rows in place (to make a bad cache)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    rows = table.to_pylist()
    change(rows)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path, row_group_size=1, compression="none")
    return rows


def first_shard(gen_dir: Path) -> Path:
    import json

    manifest = json.loads((gen_dir / "manifest.json").read_text())
    return gen_dir / manifest["files"][0]["path"]


def generation_rows(manifest: dict) -> list[dict]:
    """Every sample of a committed generation as its shard row, overlaid with its index row (which caption this
    generation gives it, and where its latent lives), plus that caption's text and embeddings, read with plain pyarrow
    the way docs/cache-shards.md shows."""
    import pyarrow.parquet as pq

    from rayflux.cache import index

    text = {t["caption_id"]: t for t in generation_text(manifest)}
    out = []
    for e in index.read(manifest, "samples").to_pylist():
        row = pq.ParquetFile(index.resolve(manifest, e["file"])).read_row_group(e["row"]).to_pylist()[0]
        t = text[e["caption_id"]]
        out.append({**row, **e, "caption": t["caption"], "t5": t["t5"], "clip_pooled": t["clip_pooled"]})
    return out


def generation_text(manifest: dict) -> list[dict]:
    """Every caption of a committed generation as its text-shard row, wherever the index says it lives, each text
    tensor decoded to its raw bytes by the codec the index records (rayflux.cache.codec)."""
    import pyarrow.parquet as pq

    from rayflux.cache import codec, index

    out = []
    for c in index.read(manifest, "captions").to_pylist():
        row = pq.ParquetFile(index.resolve(manifest, c["file"])).read_row_group(c["row"]).to_pylist()[0]
        for t in manifest["layout"]["text"]:
            stored, shape = c.get(f"{t['key']}_codec") or "", tuple(row[d] for d in t["dims"])
            row[t["name"]] = codec.decode(row[t["name"]], stored, row["text_dtype"], shape)
        out.append({**row, **c})
    return out


def scale_one_value(path: str, offset: int, length: int, factor: float = 1e6) -> None:
    """Multiply the first non-zero float32 of the tensor at ``offset`` of ``path`` by ``factor``, in place."""
    import numpy as np

    with open(path, "r+b") as f:
        f.seek(offset)
        values = np.frombuffer(f.read(length), np.float32).copy()
        k = int(np.flatnonzero(values)[0])
        values[k] *= factor
        assert np.isfinite(values).all()
        f.seek(offset + 4 * k)
        f.write(values[k : k + 1].tobytes())


def flip_one_byte(path: str, offset: int, length: int) -> None:
    """Invert one byte in the middle of the stored tensor at ``offset`` of ``path``, in place: damage to compressed
    bytes (rayflux.cache.codec), which are no floats to scale."""
    with open(path, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)[0]
        f.seek(offset + length // 2)
        f.write(bytes([byte ^ 0xFF]))
