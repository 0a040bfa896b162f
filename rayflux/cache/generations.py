"""Cache generations: a directory of shards that becomes visible only when its ``manifest.json`` is written.

Layout: ``<cache.dir>/<cache_key>/g00000/{samples,text}/*.parquet``, then ``skipped.jsonl``, then ``manifest.json``
last. Readers trust a generation only through its committed manifest; files not listed there do not exist to them.
"""

from __future__ import annotations

import json
import time

from rayflux import storage

MANIFEST = "manifest.json"
SKIPPED = "skipped.jsonl"


def generation_dir(cache_root: str, cache_key: str, generation: int) -> str:
    return storage.join(cache_root, cache_key, f"g{generation:05d}")


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
