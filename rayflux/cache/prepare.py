"""CPU preparation: read, hash, decode, crop and resize one image per its bucket plan.

An edit pair's reference images are prepared with their target: read and hashed with it (their hashes are part of
the sample id), then cut by the target's own crop box and resized to the target's bucket, so reference and result
stay aligned pixel for pixel. A reference of another size than its target is first scaled to the target's size.

A bad input never raises: the row comes back with ``skip_reason`` set, and the writer records it. A row whose
sample a previous generation already encoded comes back with ``reuse`` set and no pixels, so nothing downstream
decodes or encodes it again. Its ``prev`` column (the previous generation's index row for the same relative path,
attached by the driver) also spares the read and the hash when the file's size and mtime are unchanged.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from rayflux import buckets, datasets, storage
from rayflux.cache import masks
from rayflux.cache.decode import BadImage, decode, decode_with_alpha
from rayflux.config import JobConfig

# Every column prepare_row adds, with its value for a row that has none yet.
PREPARED_DEFAULTS = dict(
    skip_reason="",
    reuse=False,
    sample_id="",
    source_sha256="",
    bucket="",
    pixels=b"",
    orig_w=0,
    orig_h=0,
    crop_left=0,
    crop_top=0,
    crop_w=0,
    crop_h=0,
    target_w=0,
    target_h=0,
    ref_count=0,
    ref_sha256="",
    ref_pixels=b"",
    mask=b"",
    mask_sha256="",
)


def sample_id(rel_path: str, sha256: str, plan: buckets.BucketPlan, references: tuple[str, ...] = ()) -> str:
    """Stable id of one cached sample: the whole relative path, the content hash and the crop, and for an edit pair
    its references' content hashes.

    Same-named files in different folders differ by path, a changed file by content, a new random crop by box.
    """
    key = f"{rel_path}|{sha256}|{plan.crop_box}|{plan.key}" + (f"|refs:{','.join(references)}" if references else "")
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def _geometry(p: buckets.BucketPlan, width: int, height: int) -> dict:
    return dict(
        bucket=p.key,
        orig_w=width,
        orig_h=height,
        crop_left=p.crop_left,
        crop_top=p.crop_top,
        crop_w=p.crop_width,
        crop_h=p.crop_height,
        target_w=p.target_width,
        target_h=p.target_height,
    )


def _plan_or_none(width: int, height: int, spec: buckets.BucketSpec, seed: int, rel_path: str):
    try:
        return buckets.plan(width, height, spec, seed=seed, salt=rel_path)
    except buckets.ImageTooSmall:
        return None  # decoded again below, and skipped there with its reason


def _skip(row: dict, reason: str) -> dict:
    row.update(skip_reason=reason, pixels=b"", ref_pixels=b"", mask=b"")
    return row


def _uris(row: dict) -> list[str]:
    refs = row.get("references")
    return [] if refs is None else [str(u) for u in refs]


def _read_references(row: dict) -> tuple[list[bytes], list[str]] | str:
    """Each reference's bytes and content hash, or a skip reason naming the reference."""
    data, shas = [], []
    for uri in _uris(row):
        got = _read({"uri": uri})
        if isinstance(got, str):
            return f"reference {uri}: {got}"
        data.append(got)
        shas.append(hashlib.sha256(got).hexdigest())
    return data, shas


def _cut_references(row: dict, data: list[bytes], p: buckets.BucketPlan, size, max_pixels: int) -> bytes | str:
    """The references' pixels, each cut and resized exactly as its target, concatenated; or a skip reason."""
    from PIL import Image

    out = []
    for uri, raw in zip(_uris(row), data):
        try:
            ref = decode(raw, max_pixels)
        except BadImage as exc:
            return f"reference {uri}: {exc}"
        if ref.size != size:
            ref = ref.resize(size, Image.Resampling.LANCZOS)
        ref = ref.resize((p.target_width, p.target_height), Image.Resampling.LANCZOS, box=p.crop_box)
        out.append(np.asarray(ref, dtype=np.uint8).tobytes())
    return b"".join(out)


def _read(row: dict) -> bytes | str:
    """The file's bytes, or a skip reason."""
    try:
        return storage.read_bytes(row["uri"])
    except Exception as exc:  # noqa: BLE001 - any read failure is a recorded skip, not a crash
        return f"unreadable: {type(exc).__name__}: {exc}"


def prepare_row(
    row: dict, spec: buckets.BucketSpec, seed: int, max_pixels: int, mask: masks.MaskPolicy = masks.NO_MASKS
) -> dict:
    """Ray Data ``map`` function: one discovered source row in, one prepared (or skipped, or reused) row out.

    ``row["prev"]`` is the previous generation's index row for the same relative path (JSON), or empty. The same
    content (the same hash, or the same size and mtime) decodes to the same upright size, so the plan and sample id
    are checked without decoding; the file is not even read when its size and mtime are unchanged. An edit pair's
    references are always read and hashed (their hashes are part of the sample id), but decoded only when the sample
    is not reused. ``mask``: the dataset's mask settings; a mask is read and hashed like a reference (its hash
    decides whether the cached row is current, see :mod:`rayflux.cache.masks`), cut and reduced only when the sample
    is not reused.
    """
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
    refs = _read_references(row)
    if isinstance(refs, str):
        return _skip(row, refs)
    ref_data, ref_shas = refs
    row["ref_sha256"] = ",".join(ref_shas)
    got_mask = masks.read(row, mask)
    if isinstance(got_mask, str):
        return _skip(row, got_mask)
    if prev and prev["source_sha256"] == sha and masks.current(prev.get("mask_sha256", ""), got_mask):
        w, h = prev["orig_w"], prev["orig_h"]
        p = _plan_or_none(w, h, spec, seed, row["rel_path"])
        if p is not None and sample_id(row["rel_path"], sha, p, tuple(ref_shas)) == prev["sample_id"]:
            row.update(
                _geometry(p, w, h),
                sample_id=prev["sample_id"],
                reuse=True,
                ref_count=len(ref_data),
                mask_sha256=prev.get("mask_sha256", ""),
            )
            return row
    if data is None:
        got = _read(row)
        if isinstance(got, str):
            return _skip(row, got)
        data = got
    return _prepare_pixels(
        row, data, sha, ref_data, ref_shas, got_mask, spec=spec, seed=seed, max_pixels=max_pixels, policy=mask
    )


def _prepare_pixels(
    row: dict,
    data: bytes,
    sha: str,
    ref_data: list[bytes],
    ref_shas: list[str],
    got_mask: masks.MaskInput | None,
    *,
    spec: buckets.BucketSpec,
    seed: int,
    max_pixels: int,
    policy: masks.MaskPolicy,
) -> dict:
    """Decode, plan, cut and resize a sample that is not reused: its image, references and mask."""
    from PIL import Image

    try:
        img, alpha = decode_with_alpha(data, max_pixels, alpha=policy.mode == "alpha")
    except BadImage as exc:
        return _skip(row, str(exc))
    w, h = img.size
    try:
        p = buckets.plan(w, h, spec, seed=seed, salt=row["rel_path"])
    except buckets.ImageTooSmall as exc:
        return _skip(row, str(exc))
    if got_mask is not None:
        made = masks.prepare(
            got_mask,
            alpha,
            (w, h),
            p,
            spec.vae_scale_factor,
            row.get("mask_uri") or row["uri"],
            max_pixels=max_pixels,
            policy=policy,
        )
        if isinstance(made, str):
            return _skip(row, made)
        row["mask"], row["mask_sha256"] = made
    resized = img.resize((p.target_width, p.target_height), Image.Resampling.LANCZOS, box=p.crop_box)
    ref_pixels = _cut_references(row, ref_data, p, (w, h), max_pixels) if ref_data else b""
    if isinstance(ref_pixels, str):
        return _skip(row, ref_pixels)
    row.update(
        _geometry(p, w, h),
        sample_id=sample_id(row["rel_path"], sha, p, tuple(ref_shas)),
        pixels=np.asarray(resized, dtype=np.uint8).tobytes(),
        ref_count=len(ref_data),
        ref_pixels=ref_pixels,
        prev="",  # not reused: the writer needs nothing of the previous row
    )
    return row


def skip_reason(
    row: dict, spec: buckets.BucketSpec, seed: int, max_pixels: int, mask: masks.MaskPolicy = masks.NO_MASKS
) -> str:
    """Why a listed image would not be cached ("" when it would): the same read, decode and plan as
    :func:`prepare_row`, for the ``max_samples`` draw, which must choose among usable images only."""
    refs = row.get("references")
    if isinstance(refs, str):  # a listed row carries its references as JSON (see sources.list_dataset)
        refs = json.loads(refs or "[]")
    return prepare_row({**row, "references": refs, "prev": ""}, spec, seed, max_pixels, mask)["skip_reason"]


def prepare_in_dataset(row: dict, specs: dict, policies: dict | None = None, **kwargs) -> dict:
    """``prepare_row`` with the bucket spec and mask settings of the row's own dataset (each dataset has its
    resolution, crop and masks)."""
    policy = (policies or {}).get(row["dataset"], masks.NO_MASKS)
    return prepare_row(row, specs[row["dataset"]], mask=policy, **kwargs)


def mask_policies(cfg: JobConfig) -> dict[str, masks.MaskPolicy]:
    """Each dataset's mask settings, keyed by its ``dataset`` column value."""
    return {datasets.key(cfg.data, ds): masks.policy_of(ds) for ds in datasets.datasets_of(cfg.data)}
