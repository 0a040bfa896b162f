"""Cache generations: a directory of shards that becomes visible only when its ``manifest.json`` is written.

Layout: ``<cache.dir>/<cache_key>/g00000/{samples,text}/*.parquet``, then ``skipped.jsonl``, then ``manifest.json``
last. Readers trust a generation only through its committed manifest; files not listed there do not exist to them.
"""

from __future__ import annotations

import json
import time

import pyarrow.fs as pafs

from rayflux import storage

MANIFEST = "manifest.json"
SKIPPED = "skipped.jsonl"


def generation_dir(cache_root: str, cache_key: str, generation: int, inputs: str) -> str:
    """``<root>/<cache key>/g00001-<inputs hash>``: the inputs hash (file list, sizes, mtimes, chosen captions) makes
    a changed dataset land in a new directory instead of silently reusing a stale one."""
    return storage.join(cache_root, cache_key, f"g{generation:05d}-{inputs}")


def commit(gen_dir: str, manifest: dict, skipped: list[dict]) -> dict:
    """Write the skipped report, then the manifest (the commit point). Returns the manifest as written."""
    storage.write_bytes_atomic(
        storage.join(gen_dir, SKIPPED), "".join(json.dumps(s, sort_keys=True) + "\n" for s in skipped).encode()
    )
    manifest = {**manifest, "committed_at": time.time()}
    storage.write_bytes_atomic(storage.join(gen_dir, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


def load_manifest(gen_dir: str) -> dict | None:
    """The committed manifest of a generation, or None when it was never committed."""
    path = storage.join(gen_dir, MANIFEST)
    if not storage.exists(path):
        return None
    return json.loads(storage.read_bytes(path))


def sample_files(manifest: dict) -> list[str]:
    return [storage.join(manifest["dir"], f["path"]) for f in manifest["files"]]


def text_files(manifest: dict) -> list[str]:
    return [storage.join(manifest["dir"], f["path"]) for f in manifest["text_files"]]


RETIRED = "RETIRED"


def is_retired(gen_dir: str) -> bool:
    return storage.exists(storage.join(gen_dir, RETIRED))


def remove_tree(gen_dir: str) -> None:
    """Delete a generation directory. Only the stage runner's ``retire`` and ``discard`` stages call this."""
    fs, inner = storage.resolve(gen_dir)
    if storage.exists(gen_dir):
        fs.delete_dir(inner)


def retire(gen_dir: str) -> None:
    """Retire a committed generation: mark it (so a straggling reader fails loudly), then delete it.

    Runs only as the job's ``retire`` stage, after the train stage has returned, i.e. after every worker finished
    every epoch that read this generation.
    """
    storage.write_bytes_atomic(storage.join(gen_dir, RETIRED), b"retired\n")
    fs, inner = storage.resolve(gen_dir)
    for info in fs.get_file_info(pafs.FileSelector(inner)):
        if info.base_name != RETIRED:
            if info.type == pafs.FileType.Directory:
                fs.delete_dir(info.path)
            else:
                fs.delete_file(info.path)
