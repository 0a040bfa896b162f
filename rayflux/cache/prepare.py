"""CPU preparation: read, decode, orient, convert to RGB, crop and resize one image per its bucket plan.

A bad input never raises: the row comes back with ``skip_reason`` set, and the writer records it.
"""

from __future__ import annotations

import hashlib
import io
import warnings

import numpy as np

from rayflux import buckets, storage


def _to_rgb(img):
    """Convert any Pillow mode to RGB; transparency is composited onto white rather than dropped to black."""
    from PIL import Image

    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        arr = np.asarray(img, dtype=np.float64)
        hi = 65535.0 if img.mode.startswith("I;16") else max(float(arr.max()), 1.0)
        img = Image.fromarray(np.clip(arr / hi * 255.0, 0, 255).astype(np.uint8), "L")
    has_alpha = img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info)
    if has_alpha:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def sample_id(rel_path: str, sha256: str, plan: buckets.BucketPlan) -> str:
    """Stable id of one cached sample: the whole relative path, the content hash and the crop."""
    key = f"{rel_path}|{sha256}|{plan.crop_box}|{plan.key}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _skip(row: dict, reason: str) -> dict:
    row.update(skip_reason=reason, pixels=b"")
    return row


def prepare_row(row: dict, spec: buckets.BucketSpec, seed: int, max_pixels: int) -> dict:
    """Ray Data ``map`` function: one discovered source row in, one prepared (or skipped) row out."""
    from PIL import Image, ImageOps

    row = dict(row)
    defaults = dict(
        skip_reason="", sample_id="", source_sha256="", bucket="", pixels=b"",
        orig_w=0, orig_h=0, crop_left=0, crop_top=0, crop_w=0, crop_h=0, target_w=0, target_h=0,
    )  # fmt: skip
    for k, v in defaults.items():
        row.setdefault(k, v)
    try:
        data = storage.read_bytes(row["uri"])
    except Exception as exc:  # noqa: BLE001 - any read failure is a recorded skip, not a crash
        return _skip(row, f"unreadable: {type(exc).__name__}: {exc}")
    if not data:
        return _skip(row, "zero-byte file")
    row["source_sha256"] = hashlib.sha256(data).hexdigest()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > max_pixels:
                return _skip(row, f"decompression bomb: {w}x{h} exceeds data.max_image_pixels={max_pixels}")
            img.load()
    except Exception as exc:  # noqa: BLE001 - corrupt, truncated or non-image bytes
        return _skip(row, f"not a decodable image: {type(exc).__name__}: {exc}")
    try:
        img = ImageOps.exif_transpose(img)
    except Exception:  # noqa: BLE001 - a broken EXIF block must not cost the image; keep it unrotated
        pass
    img = _to_rgb(img)
    w, h = img.size
    try:
        p = buckets.plan(w, h, spec, seed=seed, salt=row["rel_path"])
    except buckets.ImageTooSmall as exc:
        return _skip(row, str(exc))
    resized = img.resize((p.target_width, p.target_height), Image.Resampling.LANCZOS, box=p.crop_box)
    row.update(
        sample_id=sample_id(row["rel_path"], row["source_sha256"], p),
        bucket=p.key,
        orig_w=w,
        orig_h=h,
        crop_left=p.crop_left,
        crop_top=p.crop_top,
        crop_w=p.crop_width,
        crop_h=p.crop_height,
        target_w=p.target_width,
        target_h=p.target_height,
        pixels=np.asarray(resized, dtype=np.uint8).tobytes(),
    )
    return row
