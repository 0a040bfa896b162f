"""A committed generation rewritten as rayflux wrote it before :mod:`rayflux.cache.codec`: every text tensor stored
raw, a caption index without codec columns, the manifest's sizes and empty caption to match. Tests use it to show
that such a cache still reads, verifies and is reused; ``benchmarks/bench_cache_storage.py`` to measure compressed
text against raw on the same rows."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rayflux.cache import codec, generations, index, shards


def rewrite_without_codecs(gen: Path) -> None:
    """Rewrite the generation directory ``gen`` (a copy: it is changed in place) in the format before codecs."""
    path = gen / generations.MANIFEST
    manifest = json.loads(path.read_text())
    layout = shards.ShardLayout(**{**manifest["layout"], "kind": "text"})
    entry = manifest["index"]["captions"]
    captions = pq.read_table(gen / entry["path"]).to_pylist()
    by_row = {(c["file"], c["row"]): c for c in captions}
    for f in manifest["text_files"]:
        rows, file = pq.read_table(gen / f["path"]).to_pylist(), f"{gen.name}/{f['path']}"
        for i, row in enumerate(rows):
            for t in layout.text:
                stored = by_row[(file, i)].pop(f"{t.key}_{codec.COLUMN}")
                row[t.name] = codec.decode(row[t.name], stored, layout.dtype, tuple(row[d] for d in t.dims))
        data = shards.encode_table(pa.Table.from_pylist(rows, schema=layout.schema()), layout)
        (gen / f["path"]).write_bytes(data)
        f["bytes"] = len(data)
        ranges = shards.value_ranges(data, layout.tensor_columns)
        for i in range(len(rows)):
            c = by_row[(file, i)]
            c["file_bytes"] = len(data)
            for t in layout.text:
                c[f"{t.key}_offset"], c[f"{t.key}_length"], c[f"{t.key}_crc32"] = ranges[t.name][i]
    schema = pa.schema([fld for fld in index.caption_index(layout.text) if not fld.name.endswith(f"_{codec.COLUMN}")])
    pq.write_table(pa.Table.from_pylist(captions, schema=schema), gen / entry["path"], compression="zstd")
    entry["bytes"] = (gen / entry["path"]).stat().st_size
    manifest["empty_caption"] = next(c for c in captions if c["caption"] == "")
    path.write_text(json.dumps(manifest))
