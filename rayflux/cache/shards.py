"""Parquet shards: one sample per row, explicit shape columns, validated per bucket as they are written and read.

Any pyarrow reader can rebuild every tensor: ``np.frombuffer(row["latent"], row["latent_dtype"])`` reshaped to
``(latent_c, latent_h, latent_w)``; a text row holds the named tensors its model family encodes (the layout's
``text``), each reshaped by its own shape columns: FLUX.1's ``t5`` to ``(t5_len, t5_dim)`` and ``clip_pooled`` to
``(clip_dim,)``, FLUX.2's ``prompt_embeds`` to ``(prompt_len, prompt_dim)`` (``bfloat16`` is stored as raw 16-bit
patterns; see :func:`rayflux.cache.tensors.from_bytes_numpy`). Text embeddings live once per caption in the text
shards; a sample row names its caption by ``caption_id``.

Each row is its own Parquet row group, written uncompressed, without dictionaries, as one version-1 data page per
tensor column, so a tensor's bytes are one contiguous range of the file. :func:`value_ranges` finds those ranges when
a shard is written (and checks them byte for byte); the generation index records them, and training reads each
tensor with one ranged GET and no footer. Each file also carries its :class:`ShardLayout` in the Parquet key-value
metadata (key ``rayflux``), so a shard alone says what its buckets' latent shapes must be.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rayflux import buckets, storage
from rayflux.cache import integrity, tensors
from rayflux.families.base import TextTensor

# 2: layout metadata and non-nullable tensors; 3: the dataset column; 4: text only in text shards; 5: text tensors by
# the names and shape columns the model family gives them (the layout's ``text``); 6: edit pairs' reference latents;
# 7: a checksum per tensor in the generation index (rayflux.cache.integrity)
SCHEMA_VERSION = 7
_META_KEY = b"rayflux"


def _tensor(name: str) -> pa.Field:
    # Non-nullable: a missing tensor is an error at write time, and no definition levels are stored per value.
    return pa.field(name, pa.binary(), nullable=False)


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
        _tensor("latent"),
        # Edit pairs: ``ref_count`` reference latents of the row's own latent shape, back to back (empty bytes for a
        # plain sample), and their content hashes, comma-joined in the same order (part of the sample id).
        ("ref_count", pa.int32()),
        ("ref_sha256", pa.string()),
        _tensor("ref_latent"),
        ("generation", pa.int32()),
        ("encode_id", pa.string()),
    ]
)


def text_schema(text: tuple[TextTensor, ...]) -> pa.Schema:
    """A text shard's columns for the named tensors ``text``: their shape columns, then their bytes."""
    dims = [(d, pa.int32()) for t in text for d in t.dims]
    tensors_ = [_tensor(t.name) for t in text]
    return pa.schema([("caption_id", pa.string()), ("caption", pa.string()), *dims, ("text_dtype", pa.string()),
                      *tensors_, ("encode_id", pa.string())])  # fmt: skip


# The only columns worth a dictionary or statistics; on tensor columns both would store each tensor again.
_STRING_COLUMNS = sorted({f.name for f in SAMPLE_SCHEMA if f.type == pa.string()} | {"text_dtype"})
_STATS_COLUMNS = ["sample_id", "caption_id"]


@dataclass(frozen=True)
class ShardLayout:
    """What every row of a shard must look like; written into the shard's own metadata and into the manifest."""

    kind: str
    """``samples`` or ``text``."""
    dtype: str
    """Stored dtype of every tensor column."""
    latent_channels: int
    """VAE latent channels; with ``vae_scale_factor`` and a bucket key it fixes the latent shape."""
    vae_scale_factor: int
    """Pixel-to-latent downscale of the VAE."""
    text: tuple[TextTensor, ...] = ()
    """The named text tensors of every caption, as the model family encodes them (see
    :class:`rayflux.families.base.TextTensor`)."""
    schema_version: int = SCHEMA_VERSION
    """Version of the column layout above."""

    def __post_init__(self):
        # A layout read back from JSON (a manifest, a shard's metadata) carries plain dicts and lists.
        text = tuple(t if isinstance(t, TextTensor) else TextTensor(**t) for t in self.text)
        object.__setattr__(self, "text", text)

    @property
    def tensor_columns(self) -> list[str]:
        """The binary tensor columns of this kind of shard."""
        return ["latent", "ref_latent"] if self.kind == "samples" else [t.name for t in self.text]

    def latent_shape(self, bucket: str) -> tuple[int, int, int]:
        return buckets.latent_shape_of(bucket, self.latent_channels, self.vae_scale_factor)

    def schema(self) -> pa.Schema:
        base = SAMPLE_SCHEMA if self.kind == "samples" else text_schema(self.text)
        return base.with_metadata({_META_KEY: json.dumps(asdict(self), sort_keys=True).encode()})


def layout_of(schema: pa.Schema) -> ShardLayout | None:
    """The layout a shard's schema carries, or None for a file rayflux did not write."""
    raw = (schema.metadata or {}).get(_META_KEY)
    return ShardLayout(**json.loads(raw)) if raw else None


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


def check_text(row: dict, layout: ShardLayout, error, values: bool = True) -> None:
    """Check a row's text columns (a sample row's copy or a text-table row) against ``layout``."""
    if row["text_dtype"] != layout.dtype:
        raise error("text dtype", layout.dtype, row["text_dtype"])
    for t in layout.text:
        if t.length and row[t.dims[0]] != t.length:
            raise error(f"{t.name} length", t.length, row[t.dims[0]])
        _check_tensor(row, t.name, tuple(row[d] for d in t.dims), layout.dtype, error, values)


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
    _check_tensor(row, "latent", want, layout.dtype, error, values)
    refs = int(row["ref_count"])
    hashes = [h for h in (row["ref_sha256"] or "").split(",") if h]
    if refs < 0 or len(hashes) != refs:
        raise error("reference hashes for ref_count", refs, len(hashes))
    _check_tensor(row, "ref_latent", (refs, *want), layout.dtype, error, values)


def encode_table(table: pa.Table, layout: ShardLayout | None = None) -> bytes:
    """``table`` as Parquet bytes, one row per row group, each tensor value one contiguous range (see the module)."""
    buf = io.BytesIO()
    if layout is not None:
        table = table.cast(layout.schema())
    pq.write_table(
        table,
        buf,
        row_group_size=1,
        # Tensor bytes do not compress; dictionaries and min/max statistics would store them again.
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
