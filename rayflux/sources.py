"""Discover training images and their captions, on local disk, an object store, or any pyarrow/fsspec filesystem."""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import tempfile
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from rayflux import captions, datasets, storage
from rayflux.config import DataConfig, DatasetConfig
from rayflux.listing import IMAGE_EXTENSIONS, Listing, list_dataset  # noqa: F401 - discovery's public names

_SIDECAR_READERS = 32  # concurrent caption-file reads: hides object-store latency, not the request count
_CHUNK = 4096  # listed rows settled through Python at a time in this process

SIDECARS = pa.schema([("path", pa.string()), ("stamp", pa.string()), ("lines", pa.string())])
"""A caption file as discovery read it: its path on the dataset's filesystem, its ``size:mtime`` from the listing
and its non-empty lines (a JSON list), before any caption policy: the same lines serve every seed and setting."""


@dataclass(frozen=True)
class Source:
    """One discovered image and the caption chosen for it in this generation."""

    uri: str
    """Full path or URI of the image."""
    rel_path: str
    """Path under the dataset root, prefixed by the dataset's name when the job lists several datasets; part of the
    cache key, so same-named files in different folders or datasets differ."""
    size: int
    """File size in bytes (with mtime, a cheap change detector for incremental caching)."""
    mtime_ns: int
    caption: str
    dataset: str = ""
    """The shards' ``dataset`` column: the dataset's name, or "" for ``data.images_dir``."""
    references: tuple[str, ...] = ()
    """Edit pairs: the URIs of the image's reference images, in order (see :mod:`rayflux.edit_pairs`)."""
    references_stamp: str = ""
    """The references' ``size:mtime``, comma-joined: a changed reference changes the generation's inputs signature."""
    mask_uri: str = ""
    """With ``data.mask=dir`` or ``column``: the URI of the image's mask file ("" when it has none and
    ``missing_mask=ones``)."""
    mask_stamp: str = ""
    """The mask file's ``size:mtime``: a changed mask changes the generation's inputs signature."""


SKIPS = pa.schema([("source_uri", pa.string()), ("dataset", pa.string()), ("reason", pa.string())])
"""A skipped input: its URI, its dataset's key and why it is not used."""

SETTLED = pa.schema(
    [("rel_path", pa.string()), ("size", pa.int64()), ("mtime_ns", pa.int64()),
     ("dataset", pa.string()), ("caption", pa.string()), ("skip_reason", pa.string()), ("uncaptioned", pa.bool_()),
     ("references", pa.list_(pa.string())), ("references_stamp", pa.string()), ("sidecar", pa.string()),
     ("mask_uri", pa.string()), ("mask_stamp", pa.string()), ("sidecar_stamp", pa.string()),
     ("sidecar_lines", pa.string())]
)  # fmt: skip
"""A listed image once settled (:func:`settle`): its caption or ``skip_reason``, whether it had no caption of its
own, and its caption file's lines when they were read or known. Like a listed row it has no URI column: the
:class:`Discovery` tables get theirs from the relative path (:meth:`rayflux.listing.Listing.uris`)."""

SOURCES = pa.schema(
    [("rel_path", pa.string()), ("size", pa.int64()), ("mtime_ns", pa.int64()),
     ("caption", pa.string()), ("dataset", pa.string()), ("references", pa.list_(pa.string())),
     ("references_stamp", pa.string()), ("mask_uri", pa.string()), ("mask_stamp", pa.string())]
)  # fmt: skip
"""The :class:`Source` fields as Arrow columns but the URI: how a discovery holds its images (bytes per image on the
driver, not a Python object each), in relative-path order per dataset. A URI is the dataset's root and the relative
path, so it is made where it is needed (:func:`uris`), not held for every image."""


def uris(table: pa.Table, roots: dict[str, tuple[str, int]]) -> pa.ChunkedArray:
    """The URI of each row of ``table`` (``rel_path`` and ``dataset`` columns), from :attr:`Discovery.roots`."""
    out = None
    for key, (root, skip) in roots.items():
        made = pc.binary_join_element_wise(root, pc.utf8_slice_codeunits(table["rel_path"], skip), "")
        out = made if out is None else pc.if_else(pc.equal(table["dataset"], key), made, out)
    return out if out is not None else pa.chunked_array([], pa.string())


class Spool:
    """The caption files a discovery knows, as :data:`SIDECARS` rows written to a local Parquet file as they are
    settled: the driver does not hold their paths, stamps and lines (a third of a settled row's bytes) while the
    rest of the discovery is gathered and the generation builds; the build uploads the file at commit. The file is
    made on the first row and removed with the spool."""

    def __init__(self) -> None:
        self.path = ""
        self.rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._closed = False

    def add(self, settled: pa.Table) -> None:
        """Write the caption files of settled rows (:data:`SETTLED`) whose lines are known."""
        known = settled.filter(pc.and_(pc.not_equal(settled["sidecar"], ""), pc.is_valid(settled["sidecar_lines"])))
        self.write(pa.table([known["sidecar"], known["sidecar_stamp"], known["sidecar_lines"]], schema=SIDECARS))

    def write(self, rows: pa.Table) -> None:
        """Write :data:`SIDECARS` rows."""
        if not rows.num_rows:
            return
        if self._closed:
            raise RuntimeError("rows added to a closed sidecar spool")
        if self._writer is None:
            fd, self.path = tempfile.mkstemp(prefix="rayflux-sidecars-", suffix=".parquet")
            os.close(fd)
            weakref.finalize(self, _remove, self.path)
            # Statistics on the path only: the next generation's discovery finds a listed part's rows by the paths'
            # span in each row group (rayflux.cache.sidecars.Known); the writer keeps every row group's statistics
            # until it closes, so none for the stamps and lines. No dictionaries: paths and lines rarely repeat.
            self._writer = pq.ParquetWriter(self.path, SIDECARS, compression="zstd", use_dictionary=False,
                                            write_statistics=["path"])  # fmt: skip
        self._writer.write_table(rows)
        self.rows += rows.num_rows

    def close(self) -> str:
        """Finish the file and return its path ("" when no row was written); nothing can be added after."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._closed = True
        return self.path

    def table(self) -> pa.Table:
        """Every row written, read back, the spool closed: for small uses (a test, merging another discovery)."""
        path = self.close()
        return pq.read_table(path) if self.rows else SIDECARS.empty_table()


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@dataclass
class Discovery:
    """Everything discovery found: usable sources, skipped inputs with reasons, and dataset-level problems."""

    table: pa.Table = field(default_factory=lambda: SOURCES.empty_table())
    """The usable images, one :data:`SOURCES` row each."""
    skips: pa.Table = field(default_factory=lambda: SKIPS.empty_table())
    """The skipped inputs, one :data:`SKIPS` row each, in relative-path order per dataset."""
    problems: list[str] = field(default_factory=list)
    """Trouble that costs no image by itself but needs a look: orphan caption files, bad metadata rows..."""
    unsampled: dict[str, int] = field(default_factory=dict)
    """Per dataset, usable images left out by its ``max_samples``; not counted as discovered."""
    roots: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Per ``dataset`` value: what its images' URIs start with, and how many leading characters of a relative path
    (the dataset's key and a slash, when paths carry it) the URI leaves out (see :func:`uris`)."""
    sidecars: Spool = field(default_factory=lambda: Spool())
    """Every caption file whose lines are known (read now, or taken from the previous generation's table), as
    :data:`SIDECARS` rows in a local file: the generation records it, so the next discovery reads only the files
    that changed."""

    @property
    def sources(self) -> list[Source]:
        """The usable images as :class:`Source` objects, built on each call: for small uses (a report, a test);
        the cache stage reads :attr:`table`."""
        table = self.table.append_column("uri", uris(self.table, self.roots)) if self.table.num_rows else self.table
        return [Source(**{"uri": "", **r, "references": tuple(r["references"] or ())}) for r in table.to_pylist()]

    @property
    def skipped(self) -> list[dict]:
        """The skipped inputs as ``{"source_uri", "dataset", "reason"}`` dicts, built on each call: for the report."""
        return self.skips.to_pylist()

    @property
    def discovered(self) -> int:
        return self.table.num_rows + self.skips.num_rows

    def found_by_dataset(self) -> dict[str, int]:
        """Images discovered (usable or skipped) per ``dataset`` column value: what the job's summary reports once
        the rows themselves are gone."""
        counts: dict[str, int] = {}
        for t in (self.table, self.skips):
            for r in t.group_by("dataset").aggregate([([], "count_all")]).to_pylist():
                counts[r["dataset"]] = counts.get(r["dataset"], 0) + r["count_all"]
        return counts

    def extend(self, other: Discovery) -> None:
        self.table = pa.concat_tables([self.table, other.table])
        self.skips = pa.concat_tables([self.skips, other.skips])
        self.problems.extend(other.problems)
        self.unsampled.update(other.unsampled)
        self.roots.update(other.roots)
        if other.sidecars is not self.sidecars:
            self.sidecars.write(other.sidecars.table())


def choose(options: list[str], seed: int, rel_path: str) -> str:
    """Pick one caption of several, stably for a (seed, image) pair and independently of discovery order."""
    if len(options) == 1:
        return options[0]
    digest = hashlib.sha256(f"{seed}:{rel_path}".encode()).digest()
    return options[int.from_bytes(digest[:8], "little") % len(options)]


def rank(rel_path: str) -> bytes:
    """Where an image stands in the ``max_samples`` draw: a hash of its path, the same on every run and node."""
    return hashlib.sha256(rel_path.encode()).digest()


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
        # BENCHMARKS.md, "Probes behind the defaults").
        return [one(r) for r in rows]
    with concurrent.futures.ThreadPoolExecutor(max_workers=_SIDECAR_READERS) as pool:
        return list(pool.map(one, rows))


def missing_mask_reason(row: dict, ds: DatasetConfig) -> str:
    """Why a listed image is skipped for want of a mask file ("" when it has one, or ``missing_mask=ones``)."""
    if ds.mask not in ("dir", "column") or row.get("mask_uri") or ds.missing_mask != "skip":
        return ""
    if ds.mask == "column":
        return (f"mask missing: metadata column {ds.mask_column!r} names no mask file for it, or names one that does "
                "not exist (missing_mask=skip)")  # fmt: skip
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


def draw(table: pa.Table, k: int) -> tuple[pa.Table, int]:
    """The ``k`` usable rows of lowest :func:`rank` (in their order) and how many usable rows were left out.

    Applied to any part of a dataset it keeps a superset of that part's share of the whole draw, so preparation
    tasks draw locally and the driver draws again among what they kept: the same result as one draw over all.
    """
    if table.num_rows <= k:
        return table, 0
    ranks = [rank(p) for p in table["rel_path"].to_pylist()]
    kept = sorted(sorted(range(len(ranks)), key=ranks.__getitem__)[:k])
    return table.take(pa.array(kept, pa.int64())), table.num_rows - k


def where(table: pa.Table, mask) -> pa.Table:
    """``table.filter(mask)``, without a copy when every row is kept."""
    return table if pc.all(mask).as_py() in (True, None) else table.filter(mask)


GATHERED = [n for n in SETTLED.names if not n.startswith("sidecar")]
"""The columns of settled rows that :func:`gather` reads: all but the caption file's, which go to a :class:`Spool`."""


def gather(listing: Listing, settled: pa.Table, left_out: int = 0) -> Discovery:
    """A dataset's Discovery from its settled rows (:data:`GATHERED` columns of :data:`SETTLED` rows): sources
    (drawn to ``max_samples`` among the usable ones), recorded skips and the dataset's problems, all as Arrow.
    ``left_out``: usable images already left out by earlier draws. Its caption files are the caller's to spool."""
    ds, name = listing.ds, datasets.label(listing.ds)
    found = Discovery(problems=list(listing.problems))
    # Each step copies only when it changes something: at the peak the driver holds few copies of the images.
    paths = settled["rel_path"]
    if len(paths) > 1 and not pc.all(pc.greater(paths.slice(1), paths.slice(0, len(paths) - 1))).as_py():
        settled = settled.sort_by("rel_path")
    del paths
    skipping = pc.not_equal(settled["skip_reason"], "")
    good = where(settled, pc.invert(skipping))
    if ds.max_samples:
        good, more = draw(good, ds.max_samples)
        if more + left_out:
            found.unsampled[name] = more + left_out
    skips = where(settled, skipping)
    found.skips = pa.table([listing.uris(skips["rel_path"]), skips["dataset"], skips["skip_reason"]], schema=SKIPS)
    del skips
    found.table = good.select(SOURCES.names).cast(SOURCES)
    found.roots[listing.key] = listing.root()
    del good
    uncaptioned = settled["rel_path"].filter(settled["uncaptioned"])
    if len(uncaptioned) and ds.missing_caption != "skip":
        found.problems.append(
            f"dataset {name}: {len(uncaptioned)} images have no {ds.caption_strategy} caption and got a "
            f"missing_caption={ds.missing_caption} one instead (first: {uncaptioned[0].as_py()})"
        )
    if ds.mask in ("dir", "column") and ds.missing_mask == "ones":
        maskless = settled["rel_path"].filter(pc.and_(pc.equal(settled["mask_uri"], ""), pc.invert(skipping)))
        if len(maskless):
            found.problems.append(f"dataset {name}: {len(maskless)} images have no mask file and train on "
                                  f"their whole area (missing_mask=ones; first: {maskless[0].as_py()})")  # fmt: skip
    if ds.max_samples and found.table.num_rows < ds.max_samples and found.discovered:
        found.problems.append(
            f"dataset {name}: max_samples={ds.max_samples}, but only {found.table.num_rows} of its images are usable "
            f"({found.skips.num_rows} skipped); all of them are used"
        )
    return found


def discover_dataset(
    ds: DatasetConfig, seed: int = 0, key: str = "", prefix: bool = False, usable: Callable[[dict], str] | None = None
) -> Discovery:
    """List and settle one dataset in this process (see :func:`list_dataset` and :func:`settle`).

    ``key`` is the dataset's value of the ``dataset`` column; with ``prefix``, relative paths start with ``key/``.
    Raises FileNotFoundError or CaptionError when the dataset as a whole is unusable.
    """
    listing = list_dataset(ds, key, prefix)
    listed = listing.with_uris(listing.table) if usable else listing.table  # usable() opens the image
    settled = settle_table(listed, ds, seed, usable)
    found = gather(listing, settled)
    found.sidecars.add(settled)
    return found


def discover(data: DataConfig, *, seed: int = 0) -> Discovery:
    """Discover every dataset of the job (``data.images_dir``, or each of ``data.datasets``), in config order, in
    this process. The job's cache stage settles in its preparation tasks instead (:mod:`rayflux.cache.draw`)."""
    found = Discovery()
    prefix = datasets.prefixes_paths(data)
    for ds in datasets.datasets_of(data):
        found.extend(discover_dataset(ds, seed, key=datasets.key(data, ds), prefix=prefix))
    return found


def caption_id(caption: str) -> str:
    return hashlib.sha256(caption.encode("utf-8")).hexdigest()[:24]


def unique_captions(column: pa.ChunkedArray) -> pa.Array:
    """A generation's captions, each once and sorted, with the empty caption among them, as Arrow."""
    found = pa.concat_arrays([pc.unique(column), pa.array([""], pa.string())]).unique()
    return found.take(pc.sort_indices(found))


def caption_ids(captions: pa.Array) -> pa.Array:
    """:func:`caption_id` of each caption, through Python a bounded chunk at a time."""
    parts = [pa.array([caption_id(t) for t in captions.slice(i, _CHUNK).to_pylist()], pa.string())
             for i in range(0, len(captions), _CHUNK)]  # fmt: skip
    return pa.concat_arrays(parts) if parts else pa.array([], pa.string())
