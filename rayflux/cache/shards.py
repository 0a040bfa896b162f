"""Parquet shards: one sample per row, explicit shape columns, validated per bucket as they are written and read.

The columns and the declared per-sample tensors are :mod:`rayflux.cache.layout`'s. Any pyarrow reader can rebuild
every tensor: ``np.frombuffer(row["latent"], row["latent_dtype"])`` reshaped to ``(latent_c, latent_h, latent_w)``,
each other declared tensor by its declaration's shape rule; a text row holds the named tensors its model family
encodes (the layout's ``text``), each reshaped by its own shape columns: FLUX.1's ``t5`` to ``(t5_len, t5_dim)`` and
``clip_pooled`` to ``(clip_dim,)``, FLUX.2's ``prompt_embeds`` to ``(prompt_len, prompt_dim)`` (``bfloat16`` is
stored as raw 16-bit patterns; see :func:`rayflux.cache.tensors.from_bytes_numpy`). Text embeddings live once per
caption in the text shards; a sample row names its caption by ``caption_id``.

A text tensor's value may be compressed (:mod:`rayflux.cache.codec`; the caption index's ``<key>_codec`` says how, and
its length then differs from its shape's raw size); a latent's never is.

Each row is its own Parquet row group, written without Parquet compression or dictionaries, as one version-1 data
page per tensor column, so a tensor's stored bytes are one contiguous range of the file. :func:`value_ranges` finds
those ranges when a shard is written (and checks them byte for byte); the generation index records them, and
training reads each row's tensors with one ranged GET and no footer. Each file also carries its
:class:`ShardLayout` in the Parquet key-value metadata (key ``rayflux``), so a shard alone says what its buckets'
latent shapes must be.
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rayflux import storage
from rayflux.cache import codec, integrity, tensors
from rayflux.cache.layout import (
    SAMPLE_SCHEMA,
    SCHEMA_VERSION,
    ShardLayout,
    layout_of,  # noqa: F401
    sample_schema,
    text_schema,
)

# The only columns worth a dictionary or statistics; on tensor columns both would store each tensor again.
_STRING_COLUMNS = sorted({f.name for f in SAMPLE_SCHEMA if f.type == pa.string()} | {"text_dtype"})
_STATS_COLUMNS = ["sample_id", "caption_id"]


class CacheShapeError(ValueError):
    """A cached tensor does not have the shape or dtype its bucket promises, or holds non-finite values."""


def shape_error(bucket: str, sample_id: str, source: str, what: str, expected, actual) -> CacheShapeError:
    return CacheShapeError(f"bucket {bucket}: sample {sample_id} ({source}): {what} expected {expected}, got {actual}")


def _check_tensor(row: dict, col: str, shape, dtype: str, error, values: bool) -> None:
    data = row[col]
    want = tensors.nbytes(shape, dtype)
    if data is None or len(data) != want:
        raise error(f"{col} bytes for shape {tuple(int(s) for s in shape)}", want, None if data is None else len(data))
    if values and not np.isfinite(tensors.from_bytes_numpy(data, dtype, shape)).all():
        raise error(f"{col} values", "all finite", "NaN or Inf")


def check_text(row: dict, layout: ShardLayout, error, values: bool = True, codecs: dict | None = None) -> None:
    """Check a row's text columns (a sample row's copy or a text-table row) against ``layout``; ``codecs``: how each
    tensor's bytes are stored, by name (the caption index's; none: raw), decoded before they are checked."""
    if row["text_dtype"] != layout.dtype:
        raise error("text dtype", layout.dtype, row["text_dtype"])
    for t in layout.text:
        if t.length and row[t.dims[0]] != t.length:
            raise error(f"{t.name} length", t.length, row[t.dims[0]])
        shape = tuple(row[d] for d in t.dims)
        stored = (codecs or {}).get(t.name, codec.RAW)
        if stored != codec.RAW and row[t.name] is not None:
            try:
                row = {**row, t.name: codec.decode(row[t.name], stored, layout.dtype, shape)}
            except codec.CodecError as exc:
                raise error(f"{t.name} bytes ({stored})", f"{tensors.nbytes(shape, layout.dtype)} once decoded", exc)
        _check_tensor(row, t.name, shape, layout.dtype, error, values)


def check_row(row: dict, layout: ShardLayout, bucket: str | None = None, values: bool = True) -> None:
    """Check one sample row against its bucket; raise CacheShapeError naming bucket, sample, source and shapes.

    ``bucket`` is the bucket the row must belong to (a training batch's); by default, the row's own.
    """
    bucket = bucket or row["bucket"]

    def error(what, expected, actual):
        return shape_error(bucket, row.get("sample_id"), row.get("source_uri"), what, expected, actual)

    if row["bucket"] != bucket:
        raise error("bucket", bucket, row["bucket"])
    want = layout.latent_shape(bucket)
    got = tuple(int(x) for x in (row["latent_c"], row["latent_h"], row["latent_w"]))
    if got != want:
        raise error("latent shape", want, got)
    if row["latent_dtype"] != layout.dtype:
        raise error("latent dtype", layout.dtype, row["latent_dtype"])
    for t in layout.samples:
        for count in t.counts() if t.hash else ():  # a counted tensor has one content hash per item
            n, hashes = int(row[count]), [h for h in (row[t.hash] or "").split(",") if h]
            if n < 0 or len(hashes) != n:
                raise error(f"{t.hash} for {count}", n, len(hashes))
    for t in layout.samples:
        if t.optional and not t.counts() and not row.get(t.name):
            continue  # a row may lack it
        _check_tensor(row, t.name, t.shape_of(want, row), layout.dtype_of(t), error, values)


def encode_table(table: pa.Table, layout: ShardLayout | None = None) -> bytes:
    """``table`` as Parquet bytes, one row per row group, each tensor value one contiguous range (see the module)."""
    buf = io.BytesIO()
    if layout is not None:
        table = table.cast(layout.schema())
    pq.write_table(
        table,
        buf,
        row_group_size=1,
        # Latents do not compress and text tensors come compressed (rayflux.cache.codec) when that pays: Parquet's own
        # compression would split no range and gain nothing; dictionaries and statistics would store them again.
        compression="none",
        use_dictionary=[c for c in _STRING_COLUMNS if c in table.column_names],
        write_statistics=[c for c in _STATS_COLUMNS if c in table.column_names],
        data_page_version="1.0",
        write_page_index=False,
    )
    return buf.getvalue()


def write_table(table: pa.Table, path: str, layout: ShardLayout | None = None) -> int:
    """Write ``table`` as Parquet, one row per row group, atomically (temp name, then rename). Returns bytes.

    The cache stage always passes the shard's ``layout``, which goes into the file's metadata; without one the file
    has no layout, and training refuses to read sample rows from it.
    """
    data = encode_table(table, layout)
    storage.write_bytes_atomic(path, data)
    return len(data)


def value_ranges(data: bytes, columns: list[str]) -> dict[str, list[tuple[int, int, int]]]:
    """Per tensor column, the ``(offset, length, checksum)`` of each row's value inside the Parquet file ``data``:
    the checksum (:func:`rayflux.cache.integrity.checksum`) of the very bytes the file holds there.

    A required, uncompressed, dictionary-free column chunk of one value is one page: its header, the value's 4-byte
    length, then the value, so the value ends where the chunk ends. Each range is checked against the value itself,
    so a writer that lays pages out differently fails here, at write time, instead of feeding garbage to training.
    """
    md = pq.read_metadata(pa.BufferReader(data))
    table = pq.read_table(pa.BufferReader(data), columns=columns)
    names = md.schema.names
    out: dict[str, list[tuple[int, int, int]]] = {c: [] for c in columns}
    view = memoryview(data)
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        for c in columns:
            chunk = rg.column(names.index(c))
            start = chunk.dictionary_page_offset if chunk.has_dictionary_page else chunk.data_page_offset
            end = start + chunk.total_compressed_size
            value = table[c][i].as_py()
            offset = end - len(value)
            if rg.num_rows != 1 or data[offset:end] != value:
                raise RuntimeError(f"parquet layout: column {c} of row group {i} is not one contiguous value")
            out[c].append((offset, len(value), integrity.checksum(view[offset:end])))
    return out


def new_shard_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:12]}.parquet"


@contextmanager
def open_shard(path: str) -> Iterator[pq.ParquetFile]:
    """A shard opened for reading (its footer read, no rows yet), closed on exit."""
    fs, inner = storage.resolve(path)
    with fs.open_input_file(inner) as raw:
        yield pq.ParquetFile(raw)


def bucket_summary(table: pa.Table) -> dict:
    """Rows, latent shape and bytes per bucket, as written into the manifest and printed by ``cache verify``."""
    out: dict = {}
    shapes = zip(*(table[c].to_pylist() for c in ("latent_c", "latent_h", "latent_w")))
    lengths = pc.binary_length(table["latent"]).to_pylist()
    for b, shape, dtype, nbytes in zip(table["bucket"].to_pylist(), shapes, table["latent_dtype"].to_pylist(), lengths):
        entry = out.setdefault(b, {"rows": 0, "latent_shape": list(shape), "dtype": dtype, "latent_bytes": 0})
        entry["rows"] += 1
        entry["latent_bytes"] += nbytes
    return dict(sorted(out.items()))


def merge_summaries(parts: list[dict]) -> dict:
    total: dict = {}
    for part in parts:
        for b, e in part.items():
            t = total.setdefault(b, {**e, "rows": 0, "latent_bytes": 0})
            if t["latent_shape"] != e["latent_shape"]:
                raise CacheShapeError(
                    f"bucket {b}: shards disagree on latent shape {t['latent_shape']} vs {e['latent_shape']}"
                )
            t["rows"] += e["rows"]
            t["latent_bytes"] += e["latent_bytes"]
    return dict(sorted(total.items()))
