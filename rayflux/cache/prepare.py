"""CPU preparation: read, hash, decode, crop and resize one image per its bucket plan.

A bad input never raises: the row comes back with ``skip_reason`` set, and the writer records it. A row whose
sample a previous generation already encoded comes back with ``reuse`` set and no pixels, so nothing downstream
decodes or encodes it again. Its ``prev`` column (the previous generation's index row for the same relative path,
attached by the driver) also spares the read and the hash when the file's size and mtime are unchanged.
"""

from __future__ import annotations

import hashlib
import json

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


def _read(row: dict) -> bytes | str:
    """The file's bytes, or a skip reason."""
    try:
        return storage.read_bytes(row["uri"])
    except Exception as exc:  # noqa: BLE001 - any read failure is a recorded skip, not a crash
        return f"unreadable: {type(exc).__name__}: {exc}"


def prepare_row(row: dict, spec: buckets.BucketSpec, seed: int, max_pixels: int) -> dict:
    """Ray Data ``map`` function: one discovered source row in, one prepared (or skipped, or reused) row out.

    ``row["prev"]`` is the previous generation's index row for the same relative path (JSON), or empty. The same
    content (the same hash, or the same size and mtime) decodes to the same upright size, so the plan and sample id
    are checked without decoding; the file is not even read when its size and mtime are unchanged.
    """
    from PIL import Image

    row = {**PREPARED_DEFAULTS, **row}
    prev = json.loads(row["prev"]) if row.get("prev") else None
    data: bytes | None = None
    if prev and (prev["source_size"], prev["source_mtime_ns"]) == (row["size"], row["mtime_ns"]) and row["mtime_ns"]:
        sha = prev["source_sha256"]
    else:
        got = _read(row)
        if isinstance(got, str):
            return _skip(row, got)
        data, sha = got, hashlib.sha256(got).hexdigest()
    row["source_sha256"] = sha
    if prev and prev["source_sha256"] == sha:
        w, h = prev["orig_w"], prev["orig_h"]
        p = _plan_or_none(w, h, spec, seed, row["rel_path"])
        if p is not None and sample_id(row["rel_path"], sha, p) == prev["sample_id"]:
            row.update(_geometry(p, w, h), sample_id=prev["sample_id"], reuse=True)
            return row
    if data is None:
        got = _read(row)
        if isinstance(got, str):
            return _skip(row, got)
        data = got
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
        prev="",  # not reused: the writer needs nothing of the previous row
    )
    return row


def skip_reason(row: dict, spec: buckets.BucketSpec, seed: int, max_pixels: int) -> str:
    """Why a listed image would not be cached ("" when it would): the same read, decode and plan as
    :func:`prepare_row`, for the ``max_samples`` draw, which must choose among usable images only."""
    return prepare_row({**row, "prev": ""}, spec, seed, max_pixels)["skip_reason"]
