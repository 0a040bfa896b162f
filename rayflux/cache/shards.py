"""Parquet shards: one sample per row, explicit shape columns, validated per bucket as they are written.

Any pyarrow reader can rebuild every tensor: ``np.frombuffer(row["latent"], row["latent_dtype"])`` reshaped to
``(latent_c, latent_h, latent_w)``; likewise ``t5`` to ``(t5_len, t5_dim)`` and ``clip_pooled`` to ``(clip_dim,)``
(``bfloat16`` is stored as raw 16-bit patterns; see :func:`rayflux.cache.tensors.from_bytes_numpy`). Each row is its
own Parquet row group, so one sample can be read without reading its neighbours.
"""

from __future__ import annotations

import io
import os
import uuid

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayflux import buckets, storage
from rayflux.cache import tensors

SCHEMA_VERSION = 2  # 2: the dataset column

SAMPLE_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("source_uri", pa.string()),
        ("rel_path", pa.string()),
        ("dataset", pa.string()),
        ("source_sha256", pa.string()),
        ("caption", pa.string()),
        ("caption_id", pa.string()),
        ("bucket", pa.string()),
        ("orig_w", pa.int32()),
        ("orig_h", pa.int32()),
        ("crop_left", pa.int32()),
        ("crop_top", pa.int32()),
        ("crop_w", pa.int32()),
        ("crop_h", pa.int32()),
        ("target_w", pa.int32()),
        ("target_h", pa.int32()),
        ("latent_c", pa.int32()),
        ("latent_h", pa.int32()),
        ("latent_w", pa.int32()),
        ("latent_dtype", pa.string()),
        ("latent", pa.binary()),
        ("t5_len", pa.int32()),
        ("t5_dim", pa.int32()),
        ("clip_dim", pa.int32()),
        ("text_dtype", pa.string()),
        ("t5", pa.binary()),
        ("clip_pooled", pa.binary()),
        ("generation", pa.int32()),
    ]
)

TEXT_SCHEMA = pa.schema(
    [
        ("caption_id", pa.string()),
        ("caption", pa.string()),
        ("t5_len", pa.int32()),
        ("t5_dim", pa.int32()),
        ("clip_dim", pa.int32()),
        ("text_dtype", pa.string()),
        ("t5", pa.binary()),
        ("clip_pooled", pa.binary()),
    ]
)


class CacheShapeError(ValueError):
    """A cached tensor does not have the shape or dtype its bucket promises, or holds non-finite values."""


def shape_error(bucket: str, sample_id: str, source: str, what: str, expected, actual) -> CacheShapeError:
    return CacheShapeError(
        f"bucket {bucket}: sample {sample_id} ({source}): {what} expected {expected}, got {actual}"
    )


def expected_latent_shape(bucket: str, latent_channels: int, vae_scale_factor: int) -> tuple[int, int, int]:
    """The latent shape a bucket promises, from the same key ``buckets.plan`` produced."""
    w, h = buckets.parse_key(bucket)
    return (latent_channels, h // vae_scale_factor, w // vae_scale_factor)


def validate_row(row: dict, latent_channels: int, vae_scale_factor: int, dtype: str) -> None:
    """Check one sample row against its bucket; raise CacheShapeError naming bucket, sample, source and shapes."""
    bucket, sid, src = row["bucket"], row["sample_id"], row["source_uri"]
    want = expected_latent_shape(bucket, latent_channels, vae_scale_factor)
    got = (row["latent_c"], row["latent_h"], row["latent_w"])
    if tuple(int(x) for x in got) != want:
        raise shape_error(bucket, sid, src, "latent shape", want, got)
    if row["latent_dtype"] != dtype or row["text_dtype"] != dtype:
        raise shape_error(bucket, sid, src, "dtype", dtype, (row["latent_dtype"], row["text_dtype"]))
    for col, shape in (
        ("latent", want),
        ("t5", (row["t5_len"], row["t5_dim"])),
        ("clip_pooled", (row["clip_dim"],)),
    ):
        data = row[col]
        if len(data) != tensors.nbytes(shape, dtype):
            actual = f"{len(data)} bytes"
            raise shape_error(bucket, sid, src, f"{col} size for shape {tuple(shape)}", tensors.nbytes(shape, dtype), actual)
        if not np.isfinite(tensors.from_bytes_numpy(data, dtype, shape)).all():
            raise shape_error(bucket, sid, src, f"{col} values", "all finite", "NaN or Inf")


def write_table(table: pa.Table, path: str) -> int:
    """Write ``table`` as Parquet, one row per row group, atomically (temp name then rename). Returns bytes."""
    buf = io.BytesIO()
    # Binary tensor columns do not compress; skipping it keeps reads cheap and sizes honest.
    pq.write_table(table, buf, row_group_size=1, compression="none", write_statistics=["sample_id", "caption_id"])
    data = buf.getvalue()
    storage.write_bytes_atomic(path, data)
    return len(data)


def new_shard_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}.parquet"


def read_rows(path: str, row_groups: list[int], columns: list[str] | None = None) -> pa.Table:
    """Read selected rows (row groups) of one shard."""
    fs, inner = storage.resolve(path)
    with fs.open_input_file(inner) as f:
        return pq.ParquetFile(f).read_row_groups(row_groups, columns=columns)


def read_column(path: str, columns: list[str]) -> pa.Table:
    fs, inner = storage.resolve(path)
    with fs.open_input_file(inner) as f:
        return pq.read_table(f, columns=columns)


def bucket_summary(table: pa.Table) -> dict:
    """Rows, latent shape and bytes per bucket, as written into the manifest and printed by ``cache verify``."""
    out: dict = {}
    for i in range(table.num_rows):
        b = table["bucket"][i].as_py()
        entry = out.setdefault(
            b,
            {
                "rows": 0,
                "latent_shape": [table[c][i].as_py() for c in ("latent_c", "latent_h", "latent_w")],
                "dtype": table["latent_dtype"][i].as_py(),
                "latent_bytes": 0,
            },
        )
        entry["rows"] += 1
        entry["latent_bytes"] += len(table["latent"][i].as_py())
    return out


def merge_summaries(parts: list[dict]) -> dict:
    total: dict = {}
    for part in parts:
        for b, e in part.items():
            t = total.setdefault(b, {**e, "rows": 0, "latent_bytes": 0})
            if t["latent_shape"] != e["latent_shape"]:
                raise CacheShapeError(f"bucket {b}: shards disagree on latent shape {t['latent_shape']} vs {e['latent_shape']}")
            t["rows"] += e["rows"]
            t["latent_bytes"] += e["latent_bytes"]
    return dict(sorted(total.items()))


