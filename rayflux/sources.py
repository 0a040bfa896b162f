"""Discover training images and their captions, on local disk, an object store, or any pyarrow/fsspec filesystem."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs

from rayflux import captions, datasets, edit_pairs, storage
from rayflux.config import DataConfig, DatasetConfig

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
_SIDECAR_READERS = 32  # concurrent listings and caption-file reads: hides object-store latency, not the request count

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


SOURCES = pa.schema(
    [("uri", pa.string()), ("rel_path", pa.string()), ("size", pa.int64()), ("mtime_ns", pa.int64()),
     ("caption", pa.string()), ("dataset", pa.string()), ("references", pa.list_(pa.string())),
     ("references_stamp", pa.string())]
)  # fmt: skip
"""The :class:`Source` fields as Arrow columns: how a discovery holds its images (bytes per image on the driver,
not a Python object each), in relative-path order per dataset."""


@dataclass
class Discovery:
    """Everything discovery found: usable sources, skipped inputs with reasons, and dataset-level problems."""

    table: pa.Table = field(default_factory=lambda: SOURCES.empty_table())
    """The usable images, one :data:`SOURCES` row each."""
    skipped: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """Trouble that costs no image by itself but needs a look: orphan caption files, bad metadata rows..."""
    unsampled: dict[str, int] = field(default_factory=dict)
    """Per dataset, usable images left out by its ``max_samples``; not counted as discovered."""
    sidecars: pa.Table = field(default_factory=lambda: SIDECARS.empty_table())
    """Every caption file whose lines are known (read now, or taken from the previous generation's table), as
    :data:`SIDECARS` rows: the generation records it, so the next discovery reads only the files that changed."""

    @property
    def sources(self) -> list[Source]:
        """The usable images as :class:`Source` objects, built on each call: for small uses (a report, a test);
        the cache stage reads :attr:`table`."""
        return [Source(**{**r, "references": tuple(r["references"] or ())}) for r in self.table.to_pylist()]

    @property
    def discovered(self) -> int:
        return self.table.num_rows + len(self.skipped)

    def extend(self, other: Discovery) -> None:
        self.table = pa.concat_tables([self.table, other.table])
        self.skipped.extend(other.skipped)
        self.problems.extend(other.problems)
        self.unsampled.update(other.unsampled)
        self.sidecars = pa.concat_tables([self.sidecars, other.sidecars])


def choose(options: list[str], seed: int, rel_path: str) -> str:
    """Pick one caption of several, stably for a (seed, image) pair and independently of discovery order."""
    if len(options) == 1:
        return options[0]
    digest = hashlib.sha256(f"{seed}:{rel_path}".encode()).digest()
    return options[int.from_bytes(digest[:8], "little") % len(options)]


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def _by_lower_case(files: dict, base: str, ds: DatasetConfig) -> dict[str, str]:
    """Lower-cased path -> path. Two files that differ only by case are refused: case-insensitive sidecar matching
    could not tell their captions apart, and copied to a case-insensitive disk they would overwrite each other."""
    out: dict[str, str] = {}
    for path in sorted(files):
        other = out.setdefault(path.lower(), path)
        if other != path:
            names = f"{other[len(base) :]} and {path[len(base) :]}"
            raise captions.CaptionError(f"dataset {datasets.label(ds)}: {names} differ only by case; rename one")
    return out


def _list(fs: pafs.FileSystem, root: str) -> list[pafs.FileInfo]:
    """Every entry under ``root``: its top level, then each subfolder listed recursively, concurrently. An object
    store lists one page of keys per request, so one folder per thread spreads the pages of a large dataset."""
    top = fs.get_file_info(pafs.FileSelector(root))
    subdirs = [e.path for e in top if e.type == pafs.FileType.Directory]

    def below(path: str) -> list[pafs.FileInfo]:
        return fs.get_file_info(pafs.FileSelector(path, recursive=True))

    with concurrent.futures.ThreadPoolExecutor(max_workers=_SIDECAR_READERS) as pool:
        return [*top, *(e for part in pool.map(below, subdirs) for e in part)]


def rank(rel_path: str) -> bytes:
    """Where an image stands in the ``max_samples`` draw: a hash of its path, the same on every run and node."""
    return hashlib.sha256(rel_path.encode()).digest()


def _pairing(ds: DatasetConfig, metadata, base: str, files: dict) -> edit_pairs.Pairing:
    """The dataset's edit pairing: ``reference_dir`` listed once (concurrently, like ``images_dir``)."""
    if not (ds.reference_dir or ds.reference_column):
        return edit_pairs.Pairing(ds)
    refs: dict[str, str] = {}
    if ds.reference_dir:
        fs, root = storage.resolve(ds.reference_dir)
        if fs.get_file_info(root).type != pafs.FileType.Directory:
            name = datasets.label(ds)
            raise FileNotFoundError(f"reference_dir {ds.reference_dir!r} is not a directory (dataset {name})")
        prefix = root.rstrip("/") + "/"
        for e in _list(fs, root):
            rel = e.path[len(prefix) :]
            if e.type == pafs.FileType.File and not _hidden(rel) and rel.lower().endswith(IMAGE_EXTENSIONS):
                refs[rel] = _stamp(e)
    named = metadata.references if metadata else {}
    own = {p[len(base) :]: _stamp(e) for p, e in files.items() if p.startswith(base)}
    return edit_pairs.pairing(ds, refs, named, own)


def _stamp(e: pafs.FileInfo) -> str:
    return f"{e.size or 0}:{e.mtime_ns or 0}"


def draw(rows: list[dict], k: int) -> tuple[list[dict], int]:
    """The ``k`` usable rows of lowest :func:`rank` and how many usable rows were left out.

    Applied to any part of a dataset it keeps a superset of that part's share of the whole draw, so preparation
    tasks draw locally and the driver draws again among what they kept: the same result as one draw over all.
    """
    ranked = sorted(rows, key=lambda r: rank(r["rel_path"]))
    return ranked[:k], max(len(ranked) - k, 0)


@dataclass
class Listing:
    """One dataset listed (no caption file read yet): a row per image, in path order, and what the listing found."""

    ds: DatasetConfig
    key: str
    rows: list[dict] = field(default_factory=list)
    """uri, rel_path, size, mtime_ns, dataset, file_name, and either ``sidecar`` (the caption file's path on the
    dataset's filesystem, "" when there is none) with its ``sidecar_stamp`` (``size:mtime`` from the listing), or
    ``options`` (the captions of the other strategies)."""
    problems: list[str] = field(default_factory=list)


def list_dataset(ds: DatasetConfig, key: str = "", prefix: bool = False) -> Listing:
    """List every image under ``ds.images_dir`` (recursively, sorted) with what its caption will come from.

    Only listings (and a metadata table) are read here: caption files are read by :func:`settle`, which the cache
    stage runs inside its preparation tasks. Raises FileNotFoundError or CaptionError when the dataset as a whole
    is unusable.
    """
    fs, root = storage.resolve(ds.images_dir)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        raise FileNotFoundError(f"images_dir {ds.images_dir!r} is not a directory (dataset {datasets.label(ds)})")
    files = {e.path: e for e in _list(fs, root) if e.type == pafs.FileType.File}
    metadata = captions.load_metadata(fs, root, set(files), ds) if ds.caption_strategy == "metadata" else None
    name = datasets.label(ds)
    out = Listing(ds, key, problems=[f"dataset {name}: {p}" for p in (metadata.problems if metadata else [])])
    base = root.rstrip("/") + "/"
    by_lower = _by_lower_case(files, base, ds)
    pairs = _pairing(ds, metadata, base, files)
    reference_only = pairs.reference_only()
    images = set()
    for path in sorted(files):
        rel = path[len(base) :] if path.startswith(base) else path
        file_name = rel.rsplit("/", 1)[-1]
        if _hidden(rel) or not file_name.lower().endswith(IMAGE_EXTENSIONS) or rel in reference_only:
            continue
        images.add(path[: path.rfind(".")].lower())
        e = files[path]
        row = dict(uri=storage.join(ds.images_dir, rel), rel_path=f"{key}/{rel}" if prefix else rel,
                   size=e.size or 0, mtime_ns=e.mtime_ns or 0, dataset=key, file_name=file_name)  # fmt: skip
        if ds.caption_strategy == "sidecar":
            # Extensions match in any case, as image extensions do: IMG_0001.PNG takes IMG_0001.TXT.
            row["sidecar"] = by_lower.get((path[: path.rfind(".")] + ds.caption_ext).lower(), "")
            row["sidecar_stamp"] = _stamp(files[row["sidecar"]]) if row["sidecar"] else ""
        elif ds.caption_strategy == "metadata":
            row["options"] = list(metadata.captions.get(rel, []))
        elif ds.caption_strategy == "filename":
            row["options"] = [captions.from_filename(file_name)]
        else:
            row["options"] = [ds.instance_prompt]
        # Edit pairs: the references travel with the row (JSON, like ``options``, so every row has the same
        # columns in the preparation tasks); a missing one makes the row a recorded skip when it is settled.
        references, stamps, missing = pairs.references(rel) if pairs.active else ((), "", "")
        row.update(references=json.dumps(list(references)), references_stamp=stamps, missing_reference=missing)
        out.rows.append(row)
    if ds.caption_strategy == "sidecar":
        ext = ds.caption_ext.lower()
        orphans = [p for p in sorted(files) if p.lower().endswith(ext) and p[: -len(ext)].lower() not in images]
        out.problems += [f"dataset {name}: caption file without an image: {p[len(base) :]}" for p in orphans]
    if not images:
        out.problems.append(f"dataset {name}: no images ({', '.join(IMAGE_EXTENSIONS)}) under {ds.images_dir}")
    return out


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
        options, reason = captions.finish(options, ds, row["file_name"])
        if reason:
            row["skip_reason"] = reason
            return row
        row["caption"] = choose(options, seed, row["rel_path"])
        if usable is not None:
            row["skip_reason"] = usable(row)
        return row

    with concurrent.futures.ThreadPoolExecutor(max_workers=_SIDECAR_READERS) as pool:
        return list(pool.map(one, rows))


def gather(listing: Listing, settled: list[dict], left_out: int = 0) -> Discovery:
    """A dataset's Discovery from its settled rows: sources (drawn to ``max_samples`` among the usable ones),
    recorded skips and the dataset's problems. ``left_out``: usable images already left out by earlier draws."""
    ds, name = listing.ds, datasets.label(listing.ds)
    found = Discovery(problems=list(listing.problems))
    good = [r for r in settled if not r["skip_reason"]]
    if ds.max_samples:
        kept, more = draw(good, ds.max_samples)
        keep = {r["rel_path"] for r in kept}
        good = [r for r in good if r["rel_path"] in keep]
        if more + left_out:
            found.unsampled[name] = more + left_out
    for r in sorted(settled, key=lambda r: r["rel_path"]):
        if r["skip_reason"]:
            found.skipped.append({"source_uri": r["uri"], "dataset": r["dataset"], "reason": r["skip_reason"]})
    good.sort(key=lambda r: r["rel_path"])
    found.table = pa.table(
        [[r[c] for r in good] for c in ("uri", "rel_path", "size", "mtime_ns", "caption", "dataset")]
        + [[json.loads(r.get("references") or "[]") for r in good], [r.get("references_stamp") or "" for r in good]],
        schema=SOURCES,
    )
    known = [r for r in settled if r.get("sidecar") and r.get("sidecar_lines") is not None]
    found.sidecars = pa.table(
        [[r["sidecar"] for r in known], [r["sidecar_stamp"] for r in known], [r["sidecar_lines"] for r in known]],
        schema=SIDECARS,
    )
    uncaptioned = sorted(r["rel_path"] for r in settled if r["uncaptioned"])
    if uncaptioned and ds.missing_caption != "skip":
        found.problems.append(
            f"dataset {name}: {len(uncaptioned)} images have no {ds.caption_strategy} caption and got a "
            f"missing_caption={ds.missing_caption} one instead (first: {uncaptioned[0]})"
        )
    if ds.max_samples and found.table.num_rows < ds.max_samples and found.discovered:
        found.problems.append(
            f"dataset {name}: max_samples={ds.max_samples}, but only {found.table.num_rows} of its images are usable "
            f"({len(found.skipped)} skipped); all of them are used"
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
    return gather(listing, settle(listing.rows, ds, seed, usable))


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
