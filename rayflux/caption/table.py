"""The captions table: a captioner's captions in the run's cache directory, committed like a cache generation.

Layout, under ``<cache root>/captions/<captioner id>/`` (never in the image folder):

- ``parts/<id>.parquet``: one captioner batch's rows (:data:`PART`: a :data:`TABLE` row per image and whether the
  batch generated its caption), each written atomically by the actor before its batch returns. Their content hashes
  and captions are facts that stay true: a killed actor or job loses at most the batch in flight, and the next run
  reads them as known captions.
- ``g<N>/captions.parquet`` then ``g<N>/manifest.json``, written last (the commit): one :data:`TABLE` row per image
  the job wanted captioned, by its path and ``size:mtime`` stamp, with its content hash, streamed from the earlier
  generation's reused rows and this run's part files (:func:`commit`), so the driver never holds the captions.
  Readers only trust a directory with a manifest. The cache's discovery reads the newest one (:class:`Committed`),
  and a rerun reuses its rows for images listed with the same stamp, without reading them.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import time
from collections.abc import Iterable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from rayflux import storage

ROOT = "captions"
MANIFEST = "manifest.json"
TABLE_FILE = "captions.parquet"
PARTS = "parts"

TABLE = pa.schema(
    [
        ("dataset", pa.string()),
        ("rel_path", pa.string()),
        ("stamp", pa.string()),
        ("sha256", pa.string()),
        ("caption", pa.string()),
        ("skip_reason", pa.string()),
    ]
)
"""A committed caption: the image's dataset key, its path as discovery lists it, its ``size:mtime``, its content
hash, and its caption ("" with the ``skip_reason`` of an image the captioner could not read)."""

PART = pa.schema([*TABLE, ("made", pa.bool_())])
"""A captioner batch's output, one row per image: its :data:`TABLE` row and whether this batch generated its caption
(False: a caption known by its content, or an image that could not be read)."""
KNOWN = pa.schema([TABLE.field("sha256"), TABLE.field("caption"), TABLE.field("skip_reason")])
"""A known caption: a content hash and its caption, or why that content has none (a bad image)."""
ROW_GROUP_ROWS = 16384
"""Rows per row group of a committed table: the commit holds at most this many rows at once."""


def captioner_dir(cache_root: str, captioner_id: str) -> str:
    return storage.join(cache_root, ROOT, captioner_id)


def _generation_dirs(cdir: str) -> list[tuple[int, str]]:
    fs, inner = storage.resolve(cdir)
    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    out = []
    for info in infos:
        name = info.base_name
        if info.type == pafs.FileType.Directory and name.startswith("g") and name[1:].isdigit():
            out.append((int(name[1:]), storage.join(cdir, name)))
    return sorted(out)


def latest(cdir: str) -> tuple[str, dict] | None:
    """The newest committed generation of a captioner: its directory and manifest; None when there is none."""
    for _, gdir in reversed(_generation_dirs(cdir)):
        path = storage.join(gdir, MANIFEST)
        if storage.exists(path):
            return gdir, json.loads(storage.read_bytes(path))
    return None


def read_table(gdir: str, columns: list[str] | None = None) -> pa.Table:
    fs, inner = storage.resolve(storage.join(gdir, TABLE_FILE))
    out = pq.read_table(inner, filesystem=fs, columns=columns)
    return out.cast(pa.schema([TABLE.field(n) for n in out.column_names]))


def write_part(cdir: str, rows: pa.Table) -> str:
    """One batch's :data:`PART` rows as a part file, atomically; its path."""
    path = storage.join(cdir, PARTS, f"{os.urandom(8).hex()}.parquet")
    storage.write_bytes_atomic(path, parquet_bytes(rows.cast(PART)))
    return path


def known(cdir: str) -> pa.Table:
    """Every caption the captioner already made (:data:`KNOWN` rows, one per content hash): the newest committed
    table's and the part files' (a killed run's batches included)."""
    parts = [KNOWN.empty_table()]
    found = latest(cdir)
    if found is not None:
        parts.append(read_table(found[0], KNOWN.names))
    for path in part_paths(cdir):
        fs, inner = storage.resolve(path)
        parts.append(pq.read_table(inner, filesystem=fs, columns=KNOWN.names).cast(KNOWN))
    table = pa.concat_tables(parts)
    table = table.filter(pc.not_equal(table["sha256"], ""))  # an unreadable file's row: no content to know
    if not table.num_rows:
        return table
    # One row per hash: a caption over a skip (a later run may read a file an earlier one could not).
    order = pc.sort_indices(table, [("sha256", "ascending"), ("skip_reason", "ascending")])
    table = table.take(order)
    first = np.ones(table.num_rows, dtype=bool)
    hashes = table["sha256"].to_numpy(zero_copy_only=False)
    first[1:] = hashes[1:] != hashes[:-1]
    return table.filter(pa.array(first))


def part_paths(cdir: str) -> list[str]:
    """The part files written so far (a killed run's included)."""
    fs, inner = storage.resolve(storage.join(cdir, PARTS))
    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    names = sorted(i.base_name for i in infos if i.base_name.endswith(".parquet") and not i.base_name.startswith("."))
    return [storage.join(cdir, PARTS, n) for n in names]


def read_part(path: str) -> pa.Table:
    """A part file's :data:`TABLE` rows."""
    fs, inner = storage.resolve(path)
    return pq.read_table(inner, filesystem=fs, columns=TABLE.names).cast(TABLE)


def read_kept(gdir: str, kept: pa.Array) -> Iterator[pa.Table]:
    """A committed table's rows that the boolean ``kept`` (one per row) marks, a row group at a time."""
    fs, inner = storage.resolve(storage.join(gdir, TABLE_FILE))
    at = 0
    with fs.open_input_file(inner) as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=ROW_GROUP_ROWS, columns=TABLE.names):
            rows = pa.Table.from_batches([batch]).cast(TABLE)
            yield rows.filter(kept.slice(at, rows.num_rows))
            at += rows.num_rows


def commit(cdir: str, pieces: pa.Table | Iterable[pa.Table], counts: dict, captioner: dict) -> str:
    """Commit ``pieces`` (:data:`TABLE` rows, one table or an iterable of them, each read only when the commit comes
    to it) as the captioner's next generation: the table, then the manifest (last). Returns the generation
    directory."""
    gens = _generation_dirs(cdir)
    gdir = storage.join(cdir, f"g{gens[-1][0] + 1 if gens else 0}")
    rows = _write_table(storage.join(gdir, TABLE_FILE), [pieces] if isinstance(pieces, pa.Table) else pieces)
    manifest = {
        "rows": rows,
        "files": [TABLE_FILE],
        "captioner": captioner,
        "committed": time.time(),
        **counts,
    }
    storage.write_bytes_atomic(storage.join(gdir, MANIFEST), json.dumps(manifest, indent=1).encode())
    return gdir


def drop_parts(cdir: str) -> None:
    """Remove the part files once a commit holds what they hold (called under the captioner's lease, after the
    pipeline: no actor writes or reads them any more). A part of an image no longer listed goes with them."""
    drop_files(storage.join(cdir, PARTS))


def drop_files(folder: str) -> None:
    """Remove the files of ``folder`` (none when it does not exist)."""
    fs, inner = storage.resolve(folder)
    for info in fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True)):
        if info.type == pafs.FileType.File:
            fs.delete_file(info.path)


def _write_table(path: str, pieces: Iterable[pa.Table]) -> int:
    """Stream ``pieces`` into one Parquet file at ``path`` (atomically, through a local file), row groups of up to
    :data:`ROW_GROUP_ROWS`; its rows. No dictionaries or statistics: the writer would keep them per row group."""
    fd, local = tempfile.mkstemp(prefix="rayflux-captions-", suffix=".parquet")
    os.close(fd)
    rows, group = 0, []
    try:
        with pq.ParquetWriter(local, TABLE, use_dictionary=False, write_statistics=False) as out:
            for piece in pieces:
                group.append(piece.select(TABLE.names).cast(TABLE))
                if sum(t.num_rows for t in group) >= ROW_GROUP_ROWS:
                    rows += _flush(out, group)
            rows += _flush(out, group)
        storage.upload_atomic(local, path)
    finally:
        os.unlink(local)
    return rows


def _flush(out: pq.ParquetWriter, group: list[pa.Table]) -> int:
    if not group:
        return 0
    table = pa.concat_tables(group)
    group.clear()
    if table.num_rows:
        out.write_table(table, row_group_size=table.num_rows)
    return table.num_rows


def parquet_bytes(table: pa.Table) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def own_caption(listed: pa.Table) -> pa.Array:
    """Which listed images (:data:`rayflux.discovery.listing.LISTED` rows) have a caption of their own, for
    ``missing_caption=vlm``: another strategy's option, or a caption file with bytes in it. An empty caption file (0
    bytes by its listing's ``size:mtime`` stamp, so no read is needed to tell) is no caption: the VLM captions that
    image, as a user who made placeholder files for the images still to caption expects."""
    has_file = pc.and_(
        pc.not_equal(listed["sidecar"], ""),
        pc.invert(pc.fill_null(pc.starts_with(listed["sidecar_stamp"], "0:"), False)),
    )
    return pc.or_(has_file, pc.greater(pc.list_value_length(listed["options"]), 0))


class Committed:
    """A committed captions table as the cache's discovery reads it: each listed image of a captioned dataset gets
    its VLM caption as its caption option, as a sidecar's lines would give it.

    ``modes``: dataset key -> ``all`` (``caption_strategy=vlm``) or ``missing`` (``missing_caption=vlm``: only
    images with no caption file and no other option). ``prefix``: ``caption.prefix``."""

    def __init__(self, gdir: str, modes: dict[str, str], prefix: str = ""):
        self.gdir, self.modes, self.prefix = gdir, modes, prefix
        self._paths: pa.Array | None = None
        self.captions: pa.Array | None = None

    @property
    def paths(self) -> pa.Array:
        """The captioned paths, read at the first use (by discovery, which holds the captions as it holds a
        sidecar's lines), not when the caption stage commits: the stage's driver never holds the captions."""
        if self._paths is None:
            table = read_table(self.gdir)
            table = table.filter(pc.not_equal(table["caption"], ""))
            captions = table["caption"].combine_chunks()
            self.captions = pc.binary_join_element_wise(self.prefix, captions, " ") if self.prefix else captions
            self._paths = table["rel_path"].combine_chunks()
        return self._paths

    def attach(self, key: str, listed: pa.Table) -> pa.Table:
        """Listed rows (:data:`rayflux.discovery.listing.LISTED`) of dataset ``key`` with their VLM captions as
        ``options``."""
        mode = self.modes.get(key)
        if mode is None or not listed.num_rows:
            return listed
        at = pc.index_in(listed["rel_path"], value_set=self.paths)
        wanted = pc.is_valid(at)
        if mode == "missing":
            wanted = pc.and_(wanted, pc.invert(own_caption(listed)))
            # An empty caption file it replaces is not read afterwards (it would give the image no caption again).
            sidecar = pc.if_else(wanted, "", listed["sidecar"])
            listed = listed.set_column(listed.schema.get_field_index("sidecar"), "sidecar", sidecar)
        n = listed.num_rows
        found = pc.take(self.captions, pc.fill_null(at, 0)) if len(self.paths) else pa.nulls(n, pa.string())
        if isinstance(found, pa.ChunkedArray):
            found = found.combine_chunks()
        single = pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), found)
        options = pc.if_else(wanted, single, listed["options"])
        return listed.set_column(listed.schema.get_field_index("options"), "options", options)
