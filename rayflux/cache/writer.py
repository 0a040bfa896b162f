"""The cache stage's write tasks (Ray Data ``map_batches`` functions): validate rows, write one shard per batch.

Each returns one metadata row per shard for the driver. A row that fails validation is never raised inside the
task, where Ray would bury it in a task traceback: the task writes nothing and returns the error text, and the driver
raises it as a :class:`~rayflux.cache.shards.CacheShapeError` that names bucket, sample, source and shapes.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import pyarrow as pa

from rayflux import storage
from rayflux.cache import shards

_TEXT_COLUMNS = ["t5", "t5_len", "t5_dim", "clip_pooled", "clip_dim", "text_dtype"]
_LATENT_COLUMNS = ["sample_id", "latent", "latent_c", "latent_h", "latent_w", "latent_dtype", "encode_id"]


def _plain(v):
    return v.item() if isinstance(v, np.generic) else v


def _meta(path: str = "", rows: int = 0, nbytes: int = 0, error: str = "", **extra) -> dict:
    out = {"path": [path], "rows": [rows], "bytes": [nbytes], "error": [error]}
    out.update({k: [v] for k, v in extra.items()})
    return out


def _write(rows: list[dict], out_dir: str, layout: shards.ShardLayout) -> tuple[str, int, pa.Table]:
    """Write ``rows`` as a new shard under ``out_dir``; (path relative to it, bytes, table)."""
    table = pa.Table.from_pylist(rows, schema=layout.schema())
    rel = f"{layout.kind}/{shards.new_shard_name(layout.kind)}"
    return rel, shards.write_table(table, storage.join(out_dir, rel), layout), table


def _read_rows(refs: dict[str, tuple[str, int]], keys: set[str], columns: list[str]) -> dict[str, dict]:
    """Rows of other shards by key (sample or caption id), one read per shard."""
    by_file: dict[str, list[tuple[int, str]]] = {}
    for key in sorted(keys):
        path, row = refs[key]
        by_file.setdefault(path, []).append((row, key))
    found: dict[str, dict] = {}
    for path, wanted in by_file.items():
        table = shards.read_rows(path, [row for row, _ in wanted], columns=columns)
        found.update({key: row for (_, key), row in zip(wanted, table.to_pylist())})
    return found


def _checked(rows: list[dict], layout: shards.ShardLayout) -> str:
    """The first validation error among ``rows``, or ``""``."""
    try:
        for row in rows:
            if layout.kind == "text":
                shards.check_text(row, layout, _text_error(row))
            else:
                shards.check_row(row, layout)
    except shards.CacheShapeError as exc:
        return str(exc)
    return ""


def _text_error(row: dict):
    def error(what, expected, actual):
        where = f"caption {row['caption_id']} ({row['caption']!r})"
        return shards.CacheShapeError(f"{where}: {what} expected {expected}, got {actual}")

    return error


def write_text(batch: dict, out_dir: str, layout: shards.ShardLayout) -> dict:
    """Write a batch of freshly encoded captions (the text encoder's output rows) as one text shard."""
    rows = [{k: _plain(batch[k][i]) for k in shards.TEXT_SCHEMA.names} for i in range(len(batch["caption_id"]))]
    error = _checked(rows, layout)
    if error:
        return _meta(error=error, encoded=0)
    path, nbytes, _ = _write(rows, out_dir, layout)
    return _meta(path, len(rows), nbytes, encoded=len(rows))


def copy_text(batch: dict, out_dir: str, layout: shards.ShardLayout) -> dict:
    """Copy captions' embeddings from a previous generation's text shards into one new text shard."""
    refs = {str(c): (str(f), int(r)) for c, f, r in zip(batch["caption_id"], batch["file"], batch["row"])}
    found = _read_rows(refs, set(refs), shards.TEXT_SCHEMA.names)
    rows = [found[c] for c in sorted(found)]
    error = _checked(rows, layout)
    if error:
        return _meta(error=error, encoded=0)
    path, nbytes, _ = _write(rows, out_dir, layout)
    return _meta(path, len(rows), nbytes, encoded=0)


@functools.lru_cache(maxsize=4)
def _text_index(files: tuple[str, ...]) -> dict[str, tuple[str, int]]:
    index = {}
    for f in files:
        for i, cid in enumerate(shards.read_column(f, ["caption_id"])["caption_id"].to_pylist()):
            index[cid] = (f, i)
    return index


def write_samples(
    batch: dict,
    out_dir: str,
    layout: shards.ShardLayout,
    text_files: tuple[str, ...],
    previous_rows: dict[str, tuple[str, int]],
    generation: int,
) -> dict:
    """Validate each prepared, encoded (or reused) row against its bucket, attach its caption's embeddings, and
    write one samples shard. Skipped inputs are passed on to the driver with their reasons."""
    n = len(batch["sample_id"])
    kept = [i for i in range(n) if not batch["skip_reason"][i]]
    skipped = [
        {"source_uri": str(batch["uri"][i]), "dataset": str(batch["dataset"][i]), "reason": str(batch["skip_reason"][i])}
        for i in range(n)
        if batch["skip_reason"][i]
    ]
    rows = []
    for i in kept:
        row = {k: _plain(batch[k][i]) for k in shards.SAMPLE_SCHEMA.names if k in batch}
        row.update(source_uri=str(batch["uri"][i]), generation=generation)
        rows.append(row)
    reused = [row for i, row in zip(kept, rows) if batch["reuse"][i]]
    old = _read_rows(previous_rows, {r["sample_id"] for r in reused}, _LATENT_COLUMNS)
    for row in reused:
        row.update(old[row["sample_id"]])  # the sample id names path, content and crop: the same latent
    text = _read_rows(_text_index(text_files), {r["caption_id"] for r in rows}, _TEXT_COLUMNS)
    for row in rows:
        row.update(text[row["caption_id"]])
    # Counted from the encoder's own stamp on the batch, not from the reuse decision.
    encoded = sum(1 for i in kept if batch["encode_id"][i])
    extra = {"skipped": json.dumps(skipped), "buckets": "{}", "encoded": encoded, "reused": len(reused)}
    error = _checked(rows, layout)
    if error or not rows:
        return _meta(error=error, **extra)
    path, nbytes, table = _write(rows, out_dir, layout)
    extra["buckets"] = json.dumps(shards.bucket_summary(table))
    return _meta(path, len(rows), nbytes, **extra)
