"""A ``model.path`` in object storage (``s3://``, or any URI :mod:`rayflux.storage` reaches), copied to node-local disk
once per node.

Every process that loads weights calls :func:`local_dir`; the first on a node copies, under a file lock, and the
others wait for it and then read the same directory, so 16 workers on a node pull 24 GB once, not 16 times. A copy
is complete only when its marker file exists (written last), so a process killed mid-copy leaves a copy the next
one finishes. The driver, which only reads configs, copies only the small JSON and tokenizer files.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pyarrow.fs as pafs

from rayflux import storage

_SMALL = (".json", ".txt", ".model")
"""Config, tokenizer vocabulary and merges files: all a driver needs to read a model's facts."""


def cache_root() -> Path:
    """Node-local model copies: ``$RAYFLUX_MODEL_CACHE`` or ``<$RAYFLUX_HOME or ~/.cache/rayflux>/models``."""
    if os.environ.get("RAYFLUX_MODEL_CACHE"):
        return Path(os.environ["RAYFLUX_MODEL_CACHE"]).expanduser()
    home = os.environ.get("RAYFLUX_HOME", Path.home() / ".cache" / "rayflux")
    return Path(home).expanduser() / "models"


def local_dir(uri: str, configs_only: bool = False) -> str:
    """A local directory holding ``uri``'s files (only its small config files when ``configs_only``)."""
    from filelock import FileLock

    key = hashlib.sha256(storage.canonical(uri).encode()).hexdigest()[:16]
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    dest = root / key
    done = dest / (".rayflux-configs" if configs_only else ".rayflux-complete")
    if done.exists() or (dest / ".rayflux-complete").exists():
        return str(dest)
    with FileLock(str(root / f"{key}.lock")):
        if not done.exists():
            _copy(uri, dest, configs_only)
            done.write_text(uri)
    return str(dest)


def _copy(uri: str, dest: Path, configs_only: bool) -> None:
    fs, inner = storage.resolve(uri)
    infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True))
    files = [i for i in infos if i.type == pafs.FileType.File]
    if not files:
        raise FileNotFoundError(f"model.path={uri}: no files there")
    local = pafs.LocalFileSystem()
    for info in files:
        rel = info.path[len(inner) :].lstrip("/")
        if configs_only and not rel.endswith(_SMALL):
            continue
        target = dest / rel
        if target.exists() and target.stat().st_size == info.size:
            continue  # copied by an earlier, interrupted attempt
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        pafs.copy_files(info.path, str(partial), source_filesystem=fs, destination_filesystem=local)
        os.replace(partial, target)
