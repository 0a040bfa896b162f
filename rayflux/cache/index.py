"""The generation index: one Parquet row per sample and one per caption, saying where every tensor's bytes are.

Written once, at commit, from the write tasks' own results (never by scanning shards), as two ordinary Parquet
files beside the manifest, which names them: ``index/samples.parquet`` and ``index/captions.parquet``. Everything
that needs to know what a generation holds reads these two files instead of the shards: training's sample list and
batch reads, the next generation's reuse, caption dropout's empty caption, ``cache verify``.

``file`` is relative to the cache key's directory (``g00001-<hash>/samples/samples-....parquet``), so a generation
can reference rows another generation of the same key wrote, and a cache that is moved or synced elsewhere still
finds its own files. ``offset``/``length`` locate one tensor value inside that file (see
:func:`rayflux.cache.shards.value_ranges`), ``crc32`` is its checksum and a text tensor's ``codec`` how its stored
bytes are encoded (:mod:`rayflux.cache.codec`); ``file_bytes`` is the file's size, checked by ``cache verify``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rayflux import storage
from rayflux.cache import codec
from rayflux.cache import layout as sample_layout
from rayflux.cache.manifest import Manifest

SAMPLES = "index/samples.parquet"
CAPTIONS = "index/captions.parquet"

_LOCATION = [
    ("file", pa.string()),
    ("file_bytes", pa.int64()),
    ("row", pa.int32()),
]


def sample_index(samples=None) -> pa.Schema:
    """One row per sample of the generation: what it is, where its row is, and the byte range and checksum of each
    declared per-sample tensor (a :class:`~rayflux.cache.layout.SampleTensor`) as ``<key>offset``/``<key>length``/
    ``<key>crc32`` (the latent's are plain ``offset``/``length``/``crc32``). ``generation`` and ``encode_id`` are
    those of the build that wrote the row, which is an earlier generation's for a reused row. The checksums are of
    the tensors' bytes as the writer wrote them (:mod:`rayflux.cache.integrity`)."""
    samples = sample_layout.SAMPLE_TENSORS if samples is None else samples
    ranges = [(c, pa.uint32() if c.endswith("crc32") else pa.int64()) for t in samples for c in t.columns()]
    return pa.schema(
        [
            *_SAMPLE_FIELDS,
            *[(h, pa.string()) for h in sample_layout.hash_columns(samples)],
            *_LOCATION,
            *[(c, pa.int32()) for c in sample_layout.count_columns(samples)],
            *ranges,
            ("generation", pa.int32()),
            ("encode_id", pa.string()),
        ]
    )


_SAMPLE_FIELDS = [
    ("sample_id", pa.string()),
    ("dataset", pa.string()),
    ("bucket", pa.string()),
    ("latent_c", pa.int32()),
    ("latent_h", pa.int32()),
    ("latent_w", pa.int32()),
    ("caption_id", pa.string()),
    ("source_uri", pa.string()),
    ("rel_path", pa.string()),
    ("source_sha256", pa.string()),
    ("source_size", pa.int64()),
    ("source_mtime_ns", pa.int64()),
    ("orig_w", pa.int32()),
    ("orig_h", pa.int32()),
]
"""What a sample is and which generation's use of it the row describes (not where its tensors are); its declared
tensors' content hashes follow (:func:`rayflux.cache.layout.hash_columns`)."""

SAMPLE_INDEX = sample_index()
"""The sample index's columns with the current declarations (:data:`rayflux.cache.layout.SAMPLE_TENSORS`)."""


def borrowed_columns(samples) -> list[str]:
    """The index columns a reused row takes from the earlier generation's index: where its row and tensors are,
    their shapes, and the build that wrote them."""
    return [
        "latent_c",
        "latent_h",
        "latent_w",
        *(n for n, _ in _LOCATION),
        *sample_layout.count_columns(samples),
        *(c for t in samples for c in t.columns()),
        "generation",
        "encode_id",
    ]


_PART_TYPES = {"offset": pa.int64(), "length": pa.int64(), "crc32": pa.uint32(), codec.COLUMN: pa.string()}


def caption_index(text) -> pa.Schema:
    """One row per caption the generation's samples use, plus the empty caption (caption dropout trains on it):
    the shape columns of each named text tensor (a :class:`~rayflux.families.base.TextTensor`), where its row is,
    and each tensor's byte range, checksum and codec as ``<key>_offset``/``<key>_length``/``<key>_crc32``/
    ``<key>_codec`` (the range and checksum are of the stored bytes, compressed or not)."""
    ranges = [(f"{t.key}_{part}", kind) for t in text for part, kind in _PART_TYPES.items()]
    return pa.schema(
        [
            ("caption_id", pa.string()),
            ("caption", pa.string()),
            *[(d, pa.int32()) for t in text for d in t.dims],
            *_LOCATION,
            *ranges,
            ("generation", pa.int32()),
            ("encode_id", pa.string()),
        ]
    )


def with_codecs(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with the codec columns of ``schema`` that it lacks, as raw (``""``): rows of an index written before
    codecs (a known caption reused from an older generation) join a new index as what they are."""
    for name in schema.names:
        if name.endswith(f"_{codec.COLUMN}") and name not in table.column_names:
            table = table.append_column(name, pa.array([""] * table.num_rows, pa.string()))
    return table


def to_ipc(table: pa.Table) -> bytes:
    """A write task's index rows as Arrow IPC bytes: how they travel to the driver inside a metadata row.

    Compressed: a shard's rows are about 500 bytes each raw (paths, hashes, ids), so a 256-row shard's metadata
    would pass Ray's 100 KB limit for inlined objects and travel through the shared-memory object store, whose
    pages the driver maps as it reads them and keeps resident: its RSS grew with every image cached. Compressed
    they are a fraction of that, inlined, and freed once the driver has added them to the index."""
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, table.schema, options=options) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def from_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(pa.BufferReader(data)).read_all()


def key_dir(gen_dir: str) -> str:
    """The cache key's directory: the parent of a generation directory."""
    return gen_dir.rstrip("/").rsplit("/", 1)[0]


def relative(gen_dir: str, path: str) -> str:
    """A path inside generation ``gen_dir`` as the index writes it: relative to the cache key's directory."""
    return f"{gen_dir.rstrip('/').rsplit('/', 1)[-1]}/{path}"


def resolve(manifest: dict, file: str) -> str:
    """An index ``file`` as a full path or URI, from the manifest's own location."""
    return Manifest.of(manifest).resolve(file)


ROW_GROUP_ROWS = 4096
"""Rows per row group of a committed index file (at least; the last parts that reach it join it). The Parquet writer
keeps every row group's metadata until it closes, so a row group per shard-sized part would grow the driver with the
index; larger groups cost more only while each is encoded, a constant. Measured: docs/observability.md, "Probes
behind the defaults"."""


class Sink:
    """Streams index parts into a local file as they arrive, so the driver never holds the whole index: an Arrow IPC
    stream, which keeps nothing per part, turned into the committed Parquet file (row groups of
    :data:`ROW_GROUP_ROWS`) a row group at a time at commit."""

    def __init__(self, kind: str, text=(), samples=None):
        self.kind = kind
        self.schema = sample_index(samples) if kind == "samples" else caption_index(text)
        fd, self.path = tempfile.mkstemp(prefix=f"rayflux-index-{kind}-", suffix=".arrows")
        self._out = os.fdopen(fd, "wb")
        options = pa.ipc.IpcWriteOptions(compression="zstd")
        self.writer = pa.ipc.new_stream(self._out, self.schema, options=options)
        self.rows = 0
        self.files: set[str] = set()
        """Every ``file`` the index rows point to (the generation's own and earlier generations')."""
        self.buckets: dict[str, dict] = {}
        """Samples: rows, latent shape and latent bytes per bucket, as the manifest records them."""
        self.empty: dict | None = None
        """Captions: the empty caption's index row, once it has arrived."""

    def add(self, table: pa.Table) -> None:
        if not table.num_rows:
            return
        table = with_codecs(table, self.schema).select(self.schema.names).cast(self.schema)
        self.files.update(table["file"].unique().to_pylist())
        self.writer.write_table(table)
        self.rows += table.num_rows
        if self.kind == "captions":
            empty = table.filter(pc.equal(table["caption"], "")).to_pylist()
            self.empty = empty[0] if empty else self.empty
            return
        keys = ["bucket", "latent_c", "latent_h", "latent_w"]
        for r in table.group_by(keys).aggregate([("length", "sum"), ("length", "count")]).to_pylist():
            shape = [r[k] for k in keys[1:]]
            e = self.buckets.setdefault(r["bucket"], {"rows": 0, "latent_shape": shape, "latent_bytes": 0})
            e["rows"] += r["length_count"]
            e["latent_bytes"] += r["length_sum"]

    def commit(self, gen_dir: str, build: str = "") -> dict:
        """Close, write the Parquet file, upload it beside the manifest, and return the manifest's entry for it.
        ``build``: the build's id, in the file's name (``index/samples-<build>.parquet``)."""
        self._close_spool()
        fd, local = tempfile.mkstemp(prefix=f"rayflux-index-{self.kind}-", suffix=".parquet")
        os.close(fd)
        try:
            # No dictionaries and no statistics: nothing looks rows up by a column's range, and the writer keeps
            # both for every row group until it closes; zstd already folds the columns' repeated paths and ids.
            # Read, not memory-mapped: mapped pages would stay counted in the driver's RSS.
            with (
                pq.ParquetWriter(
                    local, self.schema, compression="zstd", use_dictionary=False, write_statistics=False
                ) as out,
                pa.OSFile(self.path) as src,
            ):
                group, rows = [], 0
                for batch in pa.ipc.open_stream(src):
                    group.append(batch)
                    rows += batch.num_rows
                    if rows >= ROW_GROUP_ROWS:
                        out.write_table(pa.Table.from_batches(group, self.schema), row_group_size=rows)
                        group, rows = [], 0
                if group:
                    out.write_table(pa.Table.from_batches(group, self.schema), row_group_size=rows)
        except BaseException:
            os.unlink(local)
            raise
        self.discard()  # the spool is of no use once its rows are in the Parquet file
        return upload(local, gen_dir, own_name(SAMPLES if self.kind == "samples" else CAPTIONS, build), self.rows)

    def discard(self) -> None:
        self._close_spool()
        if os.path.exists(self.path):
            os.unlink(self.path)

    def _close_spool(self) -> None:
        if not self._out.closed:
            self.writer.close()
            self._out.close()


def own_name(rel: str, build: str) -> str:
    """``index/samples.parquet`` -> ``index/samples-<build>.parquet``: each build's index files have names of their
    own, so two builds of one generation never overwrite each other's (the manifest names the winner's)."""
    stem, dot, ext = rel.rpartition(".")
    return f"{stem}-{build}.{ext}" if build else rel


def upload(local: str, gen_dir: str, rel: str, rows: int) -> dict:
    """Upload a finished local index file to ``rel`` inside ``gen_dir`` (atomically: the manifest, written last,
    names it), remove the local file, and return the manifest's entry for it."""
    try:
        nbytes = os.path.getsize(local)
        storage.upload_atomic(local, storage.join(gen_dir, rel))
    finally:
        if os.path.exists(local):
            os.unlink(local)
    return {"path": rel, "rows": rows, "bytes": nbytes}


def read(manifest: dict, kind: str, columns: list[str] | None = None) -> pa.Table:
    """One of a committed generation's index tables (``samples``, ``captions`` or ``sidecars``), whole or some
    columns."""
    fs, inner = storage.resolve(Manifest.of(manifest).index_path(kind))
    # One file: a handful of requests however many rows it holds.
    with fs.open_input_file(inner) as f:
        return pq.read_table(f, columns=columns)


BATCH_ROWS = 1024
"""Rows per :func:`batches` batch: what a batch costs the driver grows with it, downstream too, and every row is read
either way (a batch is only what is decoded at once). Measured: docs/observability.md, "Probes behind the defaults"."""


def batches(manifest: dict, kind: str) -> Iterator[pa.RecordBatch]:
    """One of a committed generation's index tables :data:`BATCH_ROWS` rows at a time: for a look-up that keeps only
    some rows, without holding the whole table."""
    yield from file_batches(Manifest.of(manifest).index_path(kind))


def file_batches(path: str) -> Iterator[pa.RecordBatch]:
    """Any Parquet file (local or URI) :data:`BATCH_ROWS` rows at a time."""
    fs, inner = storage.resolve(path)
    with fs.open_input_file(inner) as f:
        yield from pq.ParquetFile(f).iter_batches(batch_size=BATCH_ROWS, use_threads=False)


def caption_table(manifest: dict) -> str:
    """The full path of a committed generation's caption index (one row per caption, with its text)."""
    return Manifest.of(manifest).index_path("captions")


def empty_caption(manifest: dict) -> dict:
    """Where the empty caption's embeddings are (its caption index row), with the file resolved to a full path, the
    generation's stored ``text_dtype`` and its named text tensors (``text``): :meth:`Manifest.empty_caption`."""
    return Manifest.of(manifest).empty_caption()
