"""Discover training images and their captions, on local disk, an object store, or any pyarrow/fsspec filesystem."""

from __future__ import annotations

import concurrent.futures
import hashlib
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from rayflux import captions, datasets, edit_pairs, storage
from rayflux.config import DataConfig, DatasetConfig

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
_SIDECAR_READERS = 32  # concurrent listings and caption-file reads: hides object-store latency, not the request count


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


@dataclass
class Discovery:
    """Everything discovery found: usable sources, skipped inputs with reasons, and dataset-level problems."""

    sources: list[Source] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """Trouble that costs no image by itself but needs a look: orphan caption files, bad metadata rows..."""
    unsampled: dict[str, int] = field(default_factory=dict)
    """Per dataset, usable images left out by its ``max_samples``; not counted as discovered."""

    @property
    def discovered(self) -> int:
        return len(self.sources) + len(self.skipped)

    def extend(self, other: Discovery) -> None:
        self.sources.extend(other.sources)
        self.skipped.extend(other.skipped)
        self.problems.extend(other.problems)
        self.unsampled.update(other.unsampled)


def choose(options: list[str], seed: int, rel_path: str) -> str:
    """Pick one caption of several, stably for a (seed, image) pair and independently of discovery order."""
    if len(options) == 1:
        return options[0]
    digest = hashlib.sha256(f"{seed}:{rel_path}".encode()).digest()
    return options[int.from_bytes(digest[:8], "little") % len(options)]


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def _limit(found: Discovery, ds: DatasetConfig, name: str) -> None:
    """Keep ``max_samples`` sources, chosen by a hash of their path: the same subset on every run and node."""
    if not ds.max_samples or len(found.sources) <= ds.max_samples:
        return
    ranked = sorted(found.sources, key=lambda s: hashlib.sha256(s.rel_path.encode()).digest())
    keep = {s.rel_path for s in ranked[: ds.max_samples]}
    found.unsampled[name] = len(found.sources) - ds.max_samples
    found.sources = [s for s in found.sources if s.rel_path in keep]


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


def _read_sidecars(fs: pafs.FileSystem, files: dict, ds: DatasetConfig) -> dict:
    """Every caption file beside an image, read concurrently: on an object store each read is a round trip, and
    one after the other they would cost the driver hours at a million images. Path -> options, or the
    UnicodeDecodeError of a file that is not UTF-8."""
    # Extensions match in any case, as image extensions do: IMG_0001.PNG takes IMG_0001.TXT.
    stems = {p[: p.rfind(".")].lower() for p in files if p.rsplit("/", 1)[-1].lower().endswith(IMAGE_EXTENSIONS)}
    ext = ds.caption_ext.lower()
    wanted = sorted(p for p in files if p.lower().endswith(ext) and p[: -len(ext)].lower() in stems)

    def read(path: str):
        try:
            return captions.read_sidecar(fs, path)
        except UnicodeDecodeError as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(max_workers=_SIDECAR_READERS) as pool:
        return dict(zip(wanted, pool.map(read, wanted)))


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


def discover_dataset(ds: DatasetConfig, seed: int = 0, key: str = "", prefix: bool = False) -> Discovery:
    """List every image under ``ds.images_dir`` (recursively, sorted) and resolve its caption.

    ``key`` is the dataset's value of the ``dataset`` column; with ``prefix``, relative paths start with ``key/``.
    Raises FileNotFoundError or CaptionError when the dataset as a whole is unusable.
    """
    fs, root = storage.resolve(ds.images_dir)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        raise FileNotFoundError(f"images_dir {ds.images_dir!r} is not a directory (dataset {datasets.label(ds)})")
    files = {e.path: e for e in _list(fs, root) if e.type == pafs.FileType.File}
    metadata = captions.load_metadata(fs, root, set(files), ds) if ds.caption_strategy == "metadata" else None
    name = datasets.label(ds)
    found = Discovery(problems=[f"dataset {name}: {p}" for p in (metadata.problems if metadata else [])])
    base = root.rstrip("/") + "/"
    by_lower = _by_lower_case(files, base, ds)
    sidecars = _read_sidecars(fs, files, ds) if ds.caption_strategy == "sidecar" else {}
    pairs = _pairing(ds, metadata, base, files)
    reference_only = pairs.reference_only()
    images, uncaptioned = set(), []
    for path in sorted(files):
        rel = path[len(base) :] if path.startswith(base) else path
        file_name = rel.rsplit("/", 1)[-1]
        if _hidden(rel) or not file_name.lower().endswith(IMAGE_EXTENSIONS) or rel in reference_only:
            continue
        images.add(path[: path.rfind(".")].lower())
        uri = storage.join(ds.images_dir, rel)
        sample_path = f"{key}/{rel}" if prefix else rel
        options: list[str] = []
        if ds.caption_strategy == "sidecar":
            # Extensions match in any case, as image extensions do: IMG_0001.PNG takes IMG_0001.TXT.
            sidecar = sidecars.get(by_lower.get((path[: path.rfind(".")] + ds.caption_ext).lower(), ""), [])
            if isinstance(sidecar, UnicodeDecodeError):
                found.skipped.append(
                    {"source_uri": uri, "dataset": key, "reason": f"caption file is not UTF-8 ({sidecar.reason})"}
                )
                continue
            options = sidecar
        elif ds.caption_strategy == "metadata":
            options = list(metadata.captions.get(rel, []))
        elif ds.caption_strategy == "filename":
            options = [captions.from_filename(file_name)]
        else:
            options = [ds.instance_prompt]
        if not options:
            uncaptioned.append(rel)
        options, reason = captions.finish(options, ds, file_name)
        references, stamps, missing = pairs.references(rel) if pairs.active else ((), "", "")
        if reason or missing:
            found.skipped.append({"source_uri": uri, "dataset": key, "reason": reason or missing})
            continue
        e = files[path]
        found.sources.append(
            Source(
                uri=uri,
                rel_path=sample_path,
                size=e.size or 0,
                mtime_ns=e.mtime_ns or 0,
                caption=choose(options, seed, sample_path),
                dataset=key,
                references=references,
                references_stamp=stamps,
            )
        )
    if ds.caption_strategy == "sidecar":
        ext = ds.caption_ext.lower()
        orphans = [p for p in sorted(files) if p.lower().endswith(ext) and p[: -len(ext)].lower() not in images]
        found.problems += [f"dataset {name}: caption file without an image: {p[len(base) :]}" for p in orphans]
    if uncaptioned and ds.missing_caption != "skip":
        found.problems.append(
            f"dataset {name}: {len(uncaptioned)} images have no {ds.caption_strategy} caption and got a "
            f"missing_caption={ds.missing_caption} one instead (first: {uncaptioned[0]})"
        )
    if not images:
        found.problems.append(f"dataset {name}: no images ({', '.join(IMAGE_EXTENSIONS)}) under {ds.images_dir}")
    _limit(found, ds, name)
    return found


def discover(data: DataConfig, *, seed: int = 0) -> Discovery:
    """Discover every dataset of the job (``data.images_dir``, or each of ``data.datasets``), in config order."""
    found = Discovery()
    prefix = datasets.prefixes_paths(data)
    for ds in datasets.datasets_of(data):
        found.extend(discover_dataset(ds, seed, key=datasets.key(data, ds), prefix=prefix))
    return found


def caption_id(caption: str) -> str:
    return hashlib.sha256(caption.encode("utf-8")).hexdigest()[:24]
