"""The sidecar table: each generation records the caption files its discovery knew, so the next one reads only
the files that changed.

A generation's ``index/sidecars.parquet`` (:data:`rayflux.sources.SIDECARS` rows, named by the manifest like the
other index files) holds every caption file's path, its ``size:mtime`` as listed, and its lines. Discovery lists
every folder anyway; a caption file listed with the same path, size and mtime as in the newest committed generation
of the cache key has the same lines, so it is not read again. A rerun with nothing changed therefore reads no
caption file at all, and a refresh generation reads only new or changed ones. The lines are stored before any
caption policy (``missing_caption``, ``prepend_instance_prompt``, the per-seed choice among several), so one table
serves every seed and caption setting of the key.

As for images (see :mod:`rayflux.cache.prepare`), size and mtime are the change detector: a file rewritten with
the same size within the store's mtime resolution (one second on S3) is not noticed. A file listed without an mtime
is always read.
"""

from __future__ import annotations

import os
import tempfile

import pyarrow as pa
import pyarrow.parquet as pq

from rayflux import sources
from rayflux.cache import index

PATH = "index/sidecars.parquet"


def known(manifest: dict | None) -> dict[str, tuple[str, str]]:
    """Caption-file path -> (stamp, lines as JSON) from a committed generation's table; empty when it has none."""
    if not (manifest or {}).get("index", {}).get("sidecars"):
        return {}
    table = index.read(manifest, "sidecars", columns=sources.SIDECARS.names)
    return {p: (st, lines) for p, st, lines in zip(*(table[c].to_pylist() for c in sources.SIDECARS.names))}


def attach(rows: list[dict], table: dict[str, tuple[str, str]]) -> int:
    """Give each listed row whose caption file is unchanged its known lines (``sidecar_lines``), so settling does not
    read it. Returns how many rows got them."""
    n = 0
    for row in rows:
        path = row.get("sidecar")
        if not path or path not in table:
            continue
        stamp, lines = table[path]
        if stamp == row["sidecar_stamp"] and not stamp.endswith(":0"):
            row["sidecar_lines"] = lines
            n += 1
    return n


def write(gen_dir: str, table: pa.Table) -> dict:
    """Upload a discovery's sidecar table into ``gen_dir``; the manifest's ``index.sidecars`` entry."""
    fd, tmp = tempfile.mkstemp(prefix="rayflux-sidecars-", suffix=".parquet")
    os.close(fd)
    try:
        pq.write_table(table.cast(sources.SIDECARS), tmp, compression="zstd")
    except BaseException:
        os.unlink(tmp)
        raise
    return index.upload(tmp, gen_dir, PATH, table.num_rows)
