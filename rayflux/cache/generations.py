"""Cache generations: a directory of shards that becomes visible only when its ``manifest.json`` is written.

Layout: ``<cache.dir>/<cache_key>/g00000-<inputs hash>/{samples,text}/*.parquet`` (and, while it builds, the passes'
inputs in ``staging/``), then ``skipped.jsonl`` and the generation index (``index/*.parquet``), then ``manifest.json``
last. Readers trust a generation only through its committed manifest, and a directory without one (a build that
crashed or is still running) or with a ``RETIRED`` mark is never read or reused.

Every file a build writes carries its build id (the manifest's ``encode_id``) in its name, and the manifest is
created only if none exists yet (:func:`rayflux.storage.create_exclusive`), so two builds of one generation that
ran at once (the cache key's lease, :mod:`rayflux.lease`, normally prevents that) cannot destroy each other: the
first commit wins, each commit removes only its own build's files the manifest does not list (shards of a write task
that was killed after writing and ran again, a killed write's temporary file, the build's staged inputs), and the
losing build removes all of its own files and takes the winner's manifest. A committed generation thus holds exactly
what its manifest lists. Before a committed generation is reused, :func:`missing` checks against one listing that
every file it lists (and borrows) is still there.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time

import pyarrow.fs as pafs

from rayflux import storage
from rayflux.cache.manifest import Manifest

log = logging.getLogger("rayflux")

MANIFEST = "manifest.json"
SKIPPED = "skipped.jsonl"
_GENERATION = re.compile(r"^g(\d{5})(?:-[0-9a-f]+)?$")


def generation_dir(cache_root: str, cache_key: str, generation: int, inputs: str) -> str:
    """``<root>/<cache key>/g00001-<inputs hash>``: the inputs hash (file list, sizes, mtimes, chosen captions) makes
    a changed dataset land in a new directory instead of silently reusing a stale one."""
    return storage.join(cache_root, cache_key, f"g{generation:05d}-{inputs}")


def generation_number(gen_dir: str) -> int | None:
    """``.../g00003-<inputs hash>`` -> 3; None for a directory that is not named like a generation."""
    m = _GENERATION.match(gen_dir.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def generation_name(gen_dir: str) -> str:
    """``g00003-<inputs hash>``: the directory's own name, how the generation index refers to it."""
    return gen_dir.rstrip("/").rsplit("/", 1)[-1]


def listed(manifest: dict) -> set[str]:
    """Every file a committed generation's directory holds, relative to it: what its manifest lists."""
    return Manifest.of(manifest).listed() | {SKIPPED, MANIFEST}


def files_in(gen_dir: str) -> list[str]:
    """Every file under ``gen_dir``, relative to it (one recursive listing)."""
    fs, inner = storage.resolve(gen_dir)
    infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True, allow_not_found=True))
    return sorted(i.path[len(inner) + 1 :] for i in infos if i.type == pafs.FileType.File)


def _remove_empty_dirs(root: str) -> None:
    """Remove every empty directory below local ``root`` (the build's staging directory, once swept; object
    stores have no directories to leave behind)."""
    for parent, _, _ in os.walk(root, topdown=False):
        if parent != root and not os.listdir(parent):
            os.rmdir(parent)


def commit(gen_dir: str, manifest: dict, skipped: list[dict], build: str) -> Manifest:
    """Write the skipped report, remove every file of build ``build`` the manifest does not list, then create the
    manifest (the commit point) unless another build of this generation committed first. Returns the committed
    manifest: this one as written, or the winner's (this build's files removed).

    Every write task of the build has finished when this runs, so a file of it that nobody listed is an attempt whose
    result never arrived (its task was retried) or a temporary file a killed write left.
    """
    storage.write_bytes_atomic(
        storage.join(gen_dir, SKIPPED), "".join(json.dumps(s, sort_keys=True) + "\n" for s in skipped).encode()
    )
    _remove_own(gen_dir, build, keep=listed(manifest))
    manifest = Manifest({**manifest, "committed_at": time.time()})
    data = json.dumps(manifest, indent=1, sort_keys=True).encode()
    if storage.create_exclusive(storage.join(gen_dir, MANIFEST), data):
        return manifest
    _remove_own(gen_dir, build, keep=set())
    winner = load_manifest(gen_dir)
    log.warning(
        "cache %s: another build (%s) committed this generation first; this build's files are removed and "
        "its commit is used",
        gen_dir,
        winner.encode_id,
    )
    return winner


def _remove_own(gen_dir: str, build: str, keep: set[str]) -> None:
    """Delete the files of build ``build`` under ``gen_dir`` (those whose names carry its id) that ``keep`` does not
    list, in one listing; then, locally, the folders that left empty."""
    fs, inner = storage.resolve(gen_dir)
    for rel in files_in(gen_dir):
        if build in rel and rel not in keep:
            fs.delete_file(f"{inner}/{rel}")
    if isinstance(fs, pafs.LocalFileSystem):
        _remove_empty_dirs(inner)


def missing(manifest: dict, present: set[str]) -> list[str]:
    """The files a committed generation needs that are not in ``present`` (every file under its cache key's
    directory, relative to it: :func:`files_in` of the key's directory): its own listed files and those it
    borrows from earlier generations. Empty when it can be reused."""
    manifest = Manifest.of(manifest)
    name = generation_name(manifest.dir)
    need = {f"{name}/{rel}" for rel in listed(manifest)} | set(manifest.borrowed)
    return sorted(need - present)


def load_manifest(gen_dir: str) -> Manifest | None:
    """The committed manifest of a generation, or None when it was never committed.

    ``dir`` is set to where the manifest was found, so a cache that was moved or synced elsewhere still reads its
    own files rather than the paths it was built at.
    """
    path = storage.join(gen_dir, MANIFEST)
    if not storage.exists(path):
        return None
    return Manifest({**json.loads(storage.read_bytes(path)), "dir": gen_dir})


def load_skipped(gen_dir: str) -> list[dict]:
    """The skipped report beside a manifest: one ``{"source_uri", "reason"}`` per line."""
    return [json.loads(line) for line in storage.read_bytes(storage.join(gen_dir, SKIPPED)).decode().splitlines()]


def list_dirs(parent: str) -> list[str]:
    """Immediate subdirectories of ``parent`` (local or URI), sorted; empty when it does not exist."""
    fs, inner = storage.resolve(parent)
    try:
        infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    except (FileNotFoundError, NotADirectoryError):
        return []
    names = sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory)
    return [storage.join(parent, n) for n in names]


def generation_dirs(key_dir: str) -> list[str]:
    """Every generation directory of one cache key, committed or not, in generation order."""
    found = [d for d in list_dirs(key_dir) if generation_number(d) is not None]
    return sorted(found, key=lambda d: (generation_number(d), d))


def latest_committed(key_dir: str, exclude: str | set[str] = "") -> Manifest | None:
    """The manifest of the most recently committed, unretired generation of a cache key (other than ``exclude``, a
    generation directory or a set of them).

    Directories without a manifest are skipped whatever their number: a crashed build is never anyone's source.
    """
    found = []
    for gen_dir in generation_dirs(key_dir):
        if gen_dir in ({exclude} if isinstance(exclude, str) else exclude) or is_retired(gen_dir):
            continue
        manifest = load_manifest(gen_dir)
        if manifest is not None:
            found.append(manifest)
    return max(found, key=lambda m: m.committed_at, default=None)


def latest_intact(key_dir: str, present: set[str]) -> tuple[Manifest | None, dict[str, str]]:
    """(the newest committed generation of a cache key that still holds every file it lists, {generation directory:
    what is missing} for the newer ones that do not). ``present``: every file under ``key_dir`` (one listing)."""
    broken: dict[str, str] = {}
    while True:
        manifest = latest_committed(key_dir, exclude=set(broken))
        lost = missing(manifest, present) if manifest is not None else []
        if not lost:
            return manifest, broken
        broken[manifest.dir] = f"{len(lost)} of its listed files are missing (first: {lost[0]})"
        log.warning("cache generation %s: %s; it is not reused", manifest.dir, broken[manifest.dir])


def sample_files(manifest: dict) -> list[str]:
    manifest = Manifest.of(manifest)
    return [storage.join(manifest.dir, f["path"]) for f in manifest.shard_files("samples")]


def text_files(manifest: dict) -> list[str]:
    manifest = Manifest.of(manifest)
    return [storage.join(manifest.dir, f["path"]) for f in manifest.shard_files("text")]


RETIRED = "RETIRED"


def is_retired(gen_dir: str) -> bool:
    return storage.exists(storage.join(gen_dir, RETIRED))


def remove_tree(gen_dir: str) -> None:
    """Delete a generation directory. Only the stage runner's ``retire`` and ``discard`` stages call this."""
    fs, inner = storage.resolve(gen_dir)
    if storage.exists(gen_dir):
        fs.delete_dir(inner)


def retire(gen_dir: str) -> None:
    """Retire a committed generation: mark it (so a straggling reader fails loudly), then delete every file of a
    retired generation of its cache key that no live generation's index points into.

    A refresh generation's index references the rows of earlier generations it did not change (listed in its
    manifest's ``borrowed``), so a retired directory keeps exactly those files until the last generation that
    references them is retired too. Runs only as the job's ``retire`` stage, after the train stage has returned,
    i.e. after every worker finished every epoch that read this generation, and after the next generation
    committed (so every reference to these files is in a committed manifest).
    """
    storage.write_bytes_atomic(storage.join(gen_dir, RETIRED), b"retired\n")
    key = gen_dir.rstrip("/").rsplit("/", 1)[0]
    live, retired = [], []
    for d in generation_dirs(key):
        if is_retired(d):
            retired.append(d)
        else:
            m = load_manifest(d)
            if m is not None:
                live.append(m)
    referenced = {f for m in live for f in m.borrowed}
    for d in retired:
        fs, inner = storage.resolve(d)
        name = generation_name(d)
        for rel in files_in(d):
            if rel != RETIRED and f"{name}/{rel}" not in referenced:
                fs.delete_file(f"{inner}/{rel}")
        for sub in list_dirs(d):
            if not files_in(sub):
                fs.delete_dir(storage.resolve(sub)[1])
