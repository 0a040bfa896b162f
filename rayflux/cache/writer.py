"""The cache stage's write tasks (Ray Data ``map_batches`` functions): validate rows, write one shard per batch.

Each returns one metadata row per shard for the driver, carrying the shard's generation-index rows (Arrow IPC), so
the index is made from what the writers wrote, never by reading shards back. A row that fails validation is never
raised inside the task, where Ray would bury it in a task traceback: the task writes nothing and returns the error
text, and the driver raises it as a :class:`~rayflux.cache.shards.CacheShapeError` that names bucket, sample, source
and shapes.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from rayflux import storage
from rayflux.cache import codec, index, shards
from rayflux.cache import layout as sample_layout
from rayflux.faults import kill_point


def _python_scalar(v):
    return v.item() if isinstance(v, np.generic) else v


def _meta(path: str = "", rows: int = 0, nbytes: int = 0, error: str = "", **extra) -> dict:
    out = {"path": [path], "rows": [rows], "bytes": [nbytes], "error": [error]}
    out.update({k: [v] for k, v in extra.items()})
    return out


def _write(rows: list[dict], out_dir: str, layout: shards.ShardLayout, build: str) -> tuple[str, int, pa.Table, dict]:
    """Write ``rows`` as a new shard under ``out_dir``: (path relative to it, bytes, table, each tensor value's
    offset, length and checksum, taken from the bytes written). The name carries the ``build`` id, so a commit knows
    its own build's files from a concurrent build's."""
    table = pa.Table.from_pylist(rows, schema=layout.schema())
    rel = f"{layout.kind}/{shards.new_shard_name(f'{layout.kind}-{build}' if build else layout.kind)}"
    data = shards.encode_table(table, layout)
    ranges = shards.value_ranges(data, layout.tensor_columns)
    # Kill points: a write task's worker killed mid-write or right after its rename leaves a file no result lists,
    # which commit removes (see rayflux.cache.generations.commit).
    storage.write_bytes_atomic(storage.join(out_dir, rel), data, lambda: kill_point(f"{layout.kind}-before-rename"))
    kill_point(f"{layout.kind}-renamed")
    return rel, len(data), table, ranges


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


def write_text(batch: dict, out_dir: str, layout: shards.ShardLayout, generation: int, build: str = "") -> dict:
    """Write a batch of freshly encoded captions (the text encoder's output rows) as one text shard; return its
    metadata and the captions' index rows."""
    names = layout.schema().names
    rows = [{k: _python_scalar(batch[k][i]) for k in names} for i in range(len(batch["caption_id"]))]
    error = _checked(rows, layout)
    if error:
        return _meta(error=error, encoded=0, index=b"")
    codecs = _compress_text(rows, layout)  # after the checks, which look at the raw values
    path, nbytes, _, ranges = _write(rows, out_dir, layout, build)
    file = index.relative(out_dir, path)
    dims = [d for t in layout.text for d in t.dims]
    entries = []
    for i, r in enumerate(rows):
        entry = {k: r[k] for k in ("caption_id", "caption", *dims, "encode_id")}
        entry.update(file=file, file_bytes=nbytes, row=i, generation=generation)
        for t in layout.text:
            entry[f"{t.key}_offset"], entry[f"{t.key}_length"], entry[f"{t.key}_crc32"] = ranges[t.name][i]
            entry[f"{t.key}_{codec.COLUMN}"] = codecs[i][t.name]
        entries.append(entry)
    table = pa.Table.from_pylist(entries, schema=index.caption_index(layout.text))
    return _meta(path, len(rows), nbytes, encoded=len(rows), index=index.to_ipc(table))


def _compress_text(rows: list[dict], layout: shards.ShardLayout) -> list[dict[str, str]]:
    """Replace each row's text tensors by their stored bytes (:func:`rayflux.cache.codec.encode`: compressed where
    that is smaller); return each row's codec per tensor name, for its index row."""
    codecs = []
    for row in rows:
        used = {}
        for t in layout.text:
            row[t.name], used[t.name] = codec.encode(row[t.name], layout.dtype)
        codecs.append(used)
    return codecs


def _index_row(batch: dict, i: int, samples) -> dict:
    """The index fields of input ``i`` that describe this generation's use of it (not where its latent is)."""
    # A reused row's hashes are its previous one's (prepare_row reuses only a row whose tensors are current).
    hashes = {h: str(batch[h][i]) if h in batch else "" for h in sample_layout.hash_columns(samples)}
    return {
        "sample_id": str(batch["sample_id"][i]),
        "dataset": str(batch["dataset"][i]),
        "bucket": str(batch["bucket"][i]),
        "caption_id": str(batch["caption_id"][i]),
        "source_uri": str(batch["uri"][i]),
        "rel_path": str(batch["rel_path"][i]),
        "source_sha256": str(batch["source_sha256"][i]),
        "source_size": int(batch["size"][i]),
        "source_mtime_ns": int(batch["mtime_ns"][i]),
        "orig_w": int(batch["orig_w"][i]),
        "orig_h": int(batch["orig_h"][i]),
        **hashes,
    }


def _check_borrowed(entry: dict, layout: shards.ShardLayout) -> str:
    """A reused row is checked by its index entry: its bucket's latent shape, and each declared tensor's byte length
    to match its shape (an optional one may be absent)."""
    want = layout.latent_shape(entry["bucket"])
    got = (entry["latent_c"], entry["latent_h"], entry["latent_w"])
    for t in layout.samples:
        nbytes, length = t.nbytes(want, entry, layout.dtype_of(t)), entry[t.columns()[1]]
        if got != want or (length != nbytes and not (t.optional and length == 0)):
            err = shards.shape_error(
                entry["bucket"],
                entry["sample_id"],
                entry["source_uri"],
                f"reused {t.name} shape",
                (want, nbytes),
                (got, length),
            )
            return str(err)
    return ""


def _fresh_rows(batch: dict, fresh: list[int], layout: shards.ShardLayout, generation: int) -> list[dict]:
    """The shard rows of the inputs ``fresh``: the batch's columns of the shard's schema, and the tensors that a
    declaration produces itself (:attr:`rayflux.cache.layout.SampleTensor.produce`) when the batch lacks them."""
    names = layout.schema().names
    rows = []
    for i in fresh:
        row = {k: _python_scalar(batch[k][i]) for k in names if k in batch}
        row.update(source_uri=str(batch["uri"][i]), generation=generation)
        for t in layout.samples:
            if t.name not in row and t.produce is not None:
                row[t.name] = t.produce(row)
            elif t.name not in row and t.optional and not t.counts():
                row[t.name] = b""  # no producer output for this row: it lacks the tensor
        rows.append(row)
    return rows


def _fresh_entries(batch, fresh, rows, layout, written: tuple[str, int, dict], generation: int) -> list[dict]:
    """The index rows of the freshly written ``rows``: where each declared tensor's bytes are in the new shard."""
    file, nbytes, ranges = written
    counts = ("latent_c", "latent_h", "latent_w", *sample_layout.count_columns(layout.samples), "encode_id")
    entries = []
    for j, (i, row) in enumerate(zip(fresh, rows)):
        entry = {**_index_row(batch, i, layout.samples), **{k: row[k] for k in counts}}
        entry.update(file=file, file_bytes=nbytes, row=j, generation=generation)
        for t in layout.samples:
            entry.update(zip(t.columns(), ranges[t.name][j]))
        entries.append(entry)
    return entries


def write_samples(batch: dict, out_dir: str, layout: shards.ShardLayout, generation: int, build: str = "") -> dict:
    """Validate each prepared, encoded row against its bucket and write one samples shard; rows reused from an
    earlier generation are not written again, their index rows point at where they already are. Skipped inputs are
    passed on to the driver with their reasons."""
    n = len(batch["sample_id"])
    kept = [i for i in range(n) if not batch["skip_reason"][i]]
    skipped = [
        {
            "source_uri": str(batch["uri"][i]),
            "dataset": str(batch["dataset"][i]),
            "reason": str(batch["skip_reason"][i]),
        }
        for i in range(n)
        if batch["skip_reason"][i]
    ]
    # A bucket's rows lie together in the shard (in input order), so the runs of neighbouring rows that training
    # batches are filled with (rayflux.train.data.runs) hold no other bucket's latents between them: one short read each.
    counted = [c for c in sample_layout.count_columns(layout.samples) if c in batch]
    fresh = sorted(
        (i for i in kept if not batch["reuse"][i]),
        key=lambda i: (str(batch["bucket"][i]), *(int(batch[c][i]) for c in counted)),
    )
    rows = _fresh_rows(batch, fresh, layout, generation)
    borrowed = index.borrowed_columns(layout.samples)
    entries = []
    for i in kept:
        if batch["reuse"][i]:
            prev = json.loads(batch["prev"][i])
            entries.append({**_index_row(batch, i, layout.samples), **{k: prev[k] for k in borrowed}})
    # Counted from the encoder's own stamp on the batch, not from the reuse decision.
    encoded = sum(1 for i in kept if batch["encode_id"][i])
    extra = {"skipped": json.dumps(skipped), "buckets": "{}", "encoded": encoded, "reused": len(entries)}
    error = _checked(rows, layout) or next((e for e in map(lambda x: _check_borrowed(x, layout), entries) if e), "")
    if error:
        return _meta(error=error, index=b"", **extra)
    path, nbytes = "", 0
    if rows:
        path, nbytes, table, ranges = _write(rows, out_dir, layout, build)
        extra["buckets"] = json.dumps(shards.bucket_summary(table))
        written = (index.relative(out_dir, path), nbytes, ranges)
        entries.extend(_fresh_entries(batch, fresh, rows, layout, written, generation))
    table = pa.Table.from_pylist(entries, schema=index.sample_index(layout.samples))
    return _meta(path, len(rows), nbytes, index=index.to_ipc(table), **extra)
