"""CPU preparation: read, hash, decode, crop and resize one image per its bucket plan.

A bad input never raises: the row comes back with ``skip_reason`` set, and the writer records it. A row whose
sample a previous generation already encoded comes back with ``reuse`` set and no pixels, so nothing downstream
decodes or encodes it again.
"""

from __future__ import annotations

import hashlib

import numpy as np

from rayflux import buckets, storage
from rayflux.cache.decode import BadImage, decode

# Every column prepare_row adds, with its value for a row that has none yet.
PREPARED_DEFAULTS = dict(
    skip_reason="", reuse=False, sample_id="", source_sha256="", bucket="", pixels=b"",
    orig_w=0, orig_h=0, crop_left=0, crop_top=0, crop_w=0, crop_h=0, target_w=0, target_h=0,
)  # fmt: skip


def sample_id(rel_path: str, sha256: str, plan: buckets.BucketPlan) -> str:
    """Stable id of one cached sample: the whole relative path, the content hash and the crop.

    Same-named files in different folders differ by path, a changed file by content, a new random crop by box.
    """
    key = f"{rel_path}|{sha256}|{plan.crop_box}|{plan.key}"
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def reuse_key(rel_path: str, sha256: str) -> str:
    """What identifies the same input file across generations: its whole relative path and its content."""
    return f"{rel_path}\n{sha256}"


def _geometry(p: buckets.BucketPlan, width: int, height: int) -> dict:
    return dict(
        bucket=p.key, orig_w=width, orig_h=height, crop_left=p.crop_left, crop_top=p.crop_top,
        crop_w=p.crop_width, crop_h=p.crop_height, target_w=p.target_width, target_h=p.target_height,
    )  # fmt: skip


def _plan_or_none(width: int, height: int, spec: buckets.BucketSpec, seed: int, rel_path: str):
    try:
        return buckets.plan(width, height, spec, seed=seed, salt=rel_path)
    except buckets.ImageTooSmall:
        return None  # decoded again below, and skipped there with its reason


def _skip(row: dict, reason: str) -> dict:
    row.update(skip_reason=reason, pixels=b"")
    return row


def prepare_row(
    row: dict, spec: buckets.BucketSpec, seed: int, max_pixels: int, known: dict | None = None
) -> dict:
    """Ray Data ``map`` function: one discovered source row in, one prepared (or skipped, or reused) row out.

    ``known`` maps :func:`reuse_key` to ``(orig_w, orig_h, sample_id)`` of samples a previous generation holds.
    Equal bytes decode to the same upright size, so the plan and sample id can be checked without decoding.
    """
    from PIL import Image

    row = {**PREPARED_DEFAULTS, **row}
    try:
        data = storage.read_bytes(row["uri"])
    except Exception as exc:  # noqa: BLE001 - any read failure is a recorded skip, not a crash
        return _skip(row, f"unreadable: {type(exc).__name__}: {exc}")
    sha = hashlib.sha256(data).hexdigest()
    row["source_sha256"] = sha
    previous = (known or {}).get(reuse_key(row["rel_path"], sha))
    if previous is not None:
        w, h, old_id = previous
        p = _plan_or_none(w, h, spec, seed, row["rel_path"])
        if p is not None and sample_id(row["rel_path"], sha, p) == old_id:
            row.update(_geometry(p, w, h), sample_id=old_id, reuse=True)
            return row
    try:
        img = decode(data, max_pixels)
    except BadImage as exc:
        return _skip(row, str(exc))
    w, h = img.size
    try:
        p = buckets.plan(w, h, spec, seed=seed, salt=row["rel_path"])
    except buckets.ImageTooSmall as exc:
        return _skip(row, str(exc))
    resized = img.resize((p.target_width, p.target_height), Image.Resampling.LANCZOS, box=p.crop_box)
    row.update(
        _geometry(p, w, h),
        sample_id=sample_id(row["rel_path"], sha, p),
        pixels=np.asarray(resized, dtype=np.uint8).tobytes(),
    )
    return row
