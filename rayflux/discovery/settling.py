"""Settling listed rows: caption files read, the missing-caption and missing-mask policies applied, one caption
chosen per image (stably per seed and image)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
from collections.abc import Callable

import pyarrow as pa

from rayflux import storage
from rayflux.config import DatasetConfig
from rayflux.discovery import captions
from rayflux.discovery.schemas import SETTLED

_SIDECAR_READERS = 32  # concurrent caption-file reads: hides object-store latency, not the request count


_CHUNK = 4096  # listed rows settled through Python at a time in this process


def choose(options: list[str], seed: int, rel_path: str) -> str:
    """Pick one caption of several, stably for a (seed, image) pair and independently of discovery order."""
    if len(options) == 1:
        return options[0]
    digest = hashlib.sha256(f"{seed}:{rel_path}".encode()).digest()
    return options[int.from_bytes(digest[:8], "little") % len(options)]


def settle(rows: list[dict], ds: DatasetConfig, seed: int, usable: Callable[[dict], str] | None = None) -> list[dict]:
    """Resolve listed rows: read their caption files (concurrently: on an object store each is a round trip),
    apply the missing-caption policy and pick one caption per image. Each row comes back with ``caption``,
    ``skip_reason`` and ``uncaptioned``. With ``usable`` (row -> skip reason, "" when the image can be cached),
    the image itself is checked too: the ``max_samples`` draw needs to know which images are usable.

    A row whose ``sidecar_lines`` are already known (see :mod:`rayflux.cache.sidecars`) is not read again; a caption
    file read here comes back with its lines in ``sidecar_lines``, for the generation's sidecar table."""
    fs = storage.resolve(ds.images_dir)[0] if ds.caption_strategy == "sidecar" else None

    def one(row: dict) -> dict:
        row = {**row, "caption": "", "skip_reason": row.get("missing_reference", ""), "uncaptioned": False}
        row["skip_reason"] = row["skip_reason"] or missing_mask_reason(row, ds)
        if row["skip_reason"]:
            return row
        options = row.get("options") or []
        if fs is not None and row.get("sidecar"):
            if row.get("sidecar_lines") is not None:
                options = json.loads(row["sidecar_lines"])
            else:
                try:
                    options = captions.read_sidecar(fs, row["sidecar"])
                except UnicodeDecodeError as exc:
                    row["skip_reason"] = f"caption file is not UTF-8 ({exc.reason})"
                    return row
                row["sidecar_lines"] = json.dumps(options)
        row["uncaptioned"] = not options
        options, reason = captions.finish(options, ds, row["rel_path"].rsplit("/", 1)[-1])
        if reason:
            row["skip_reason"] = reason
            return row
        row["caption"] = choose(options, seed, row["rel_path"])
        if usable is not None:
            row["skip_reason"] = usable(row)
        return row

    if fs is None or all(r.get("sidecar_lines") is not None or not r.get("sidecar") for r in rows):
        # Nothing to read (a rerun's known caption files): no thread pool, which here only costs time (measured:
        # docs/observability.md, "Probes behind the defaults").
        return [one(r) for r in rows]
    with concurrent.futures.ThreadPoolExecutor(max_workers=_SIDECAR_READERS) as pool:
        return list(pool.map(one, rows))


def missing_mask_reason(row: dict, ds: DatasetConfig) -> str:
    """Why a listed image is skipped for want of a mask file ("" when it has one, or ``missing_mask=ones``)."""
    if ds.mask not in ("dir", "column") or row.get("mask_uri") or ds.missing_mask != "skip":
        return ""
    if ds.mask == "column":
        return (
            f"mask missing: metadata column {ds.mask_column!r} names no mask file for it, or names one that does "
            "not exist (missing_mask=skip)"
        )
    name = row["rel_path"].rsplit("/", 1)[-1]
    return f"mask missing: mask_dir {ds.mask_dir} has no mask for {name} (any image extension; missing_mask=skip)"


def settle_table(
    listed: pa.Table, ds: DatasetConfig, seed: int, usable: Callable[[dict], str] | None = None
) -> pa.Table:
    """:func:`settle` over listed Arrow rows, a bounded chunk at a time: :data:`SETTLED` rows, in the same order."""
    parts = [SETTLED.empty_table()]
    for batch in listed.to_batches(max_chunksize=_CHUNK):
        rows = settle(batch.to_pylist(), ds, seed, usable)
        parts.append(pa.Table.from_pylist([{f: r.get(f) for f in SETTLED.names} for r in rows], schema=SETTLED))
    return pa.concat_tables(parts)
