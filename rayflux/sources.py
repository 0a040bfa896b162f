"""Discover training images and their captions, on local disk or an object store."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from rayflux import storage
from rayflux.config import DataConfig

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


@dataclass(frozen=True)
class Source:
    """One discovered image and the caption chosen for it in this generation."""

    uri: str
    """Full path or URI of the image."""
    rel_path: str
    """Path relative to the dataset root; part of the cache key, so same-named files in different folders differ."""
    size: int
    """File size in bytes (with mtime, a cheap change detector for incremental caching)."""
    mtime_ns: int
    caption: str


@dataclass
class Discovery:
    """Everything discovery found: the usable sources, and each skipped input with its reason."""

    sources: list[Source] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)

    @property
    def discovered(self) -> int:
        return len(self.sources) + len(self.skipped)


def choose(options: list[str], seed: int, rel_path: str) -> str:
    """Pick one caption of several, stably for a (seed, image) pair and independently of discovery order."""
    if len(options) == 1:
        return options[0]
    digest = hashlib.sha256(f"{seed}:{rel_path}".encode()).digest()
    return options[int.from_bytes(digest[:8], "little") % len(options)]


def _read_caption(fs: pafs.FileSystem, path: str) -> list[str]:
    with fs.open_input_stream(path) as f:
        raw = f.read()
    text = raw.decode("utf-8-sig")  # UnicodeDecodeError is reported by the caller as a skip reason
    return [line.strip() for line in text.splitlines() if line.strip()]


def discover(data: DataConfig, images_dir: str, seed: int = 0) -> Discovery:
    """List every image under ``images_dir`` (recursively, sorted) and resolve its caption per ``data``."""
    fs, root = storage.resolve(images_dir)
    info = fs.get_file_info(root)
    if info.type != pafs.FileType.Directory:
        raise FileNotFoundError(f"data.images_dir {images_dir!r} is not a directory")
    entries = fs.get_file_info(pafs.FileSelector(root, recursive=True))
    files = {e.path: e for e in entries if e.type == pafs.FileType.File}
    found = Discovery()
    prefix = root.rstrip("/") + "/"
    for path in sorted(files):
        rel = path[len(prefix) :] if path.startswith(prefix) else path
        name = rel.rsplit("/", 1)[-1]
        if name.startswith(".") or not name.lower().endswith(IMAGE_EXTENSIONS):
            continue
        uri = storage.join(images_dir, rel)
        stem = path[: path.rfind(".")]
        sidecar = stem + data.caption_ext
        options: list[str] = []
        if sidecar in files:
            try:
                options = _read_caption(fs, sidecar)
            except UnicodeDecodeError as exc:
                found.skipped.append({"source_uri": uri, "reason": f"caption file is not UTF-8 ({exc.reason})"})
                continue
        if not options:
            policy = data.missing_caption
            if policy == "skip":
                found.skipped.append({"source_uri": uri, "reason": "no caption (data.missing_caption=skip)"})
                continue
            if policy == "empty":
                options = [""]
            elif policy == "instance":
                options = [data.instance_prompt]
            else:
                options = [name[: name.rfind(".")].replace("_", " ").replace("-", " ")]
        e = files[path]
        found.sources.append(
            Source(uri=uri, rel_path=rel, size=e.size or 0, mtime_ns=e.mtime_ns or 0, caption=choose(options, seed, rel))
        )
    return found


def caption_id(caption: str) -> str:
    return hashlib.sha256(caption.encode("utf-8")).hexdigest()[:24]
