"""``python -m rayflux cache verify <cache_dir>``: check committed generations against their manifests and buckets.

``<cache_dir>`` may be one generation (``.../<key>/g00003-<inputs hash>``), one cache key (its generation
children), or a whole ``cache.dir`` (``<key>/<generation>`` grandchildren). For each committed generation it prints
the rows, latent shape, dtype and bytes of every bucket, then every problem it found. The exit status is 0 when
everything is consistent, 1 when anything is not (or when no committed generation is found at all, as for a named
generation that was never committed), 2 for usage errors. Directories without a manifest, or retired ones, are
listed: readers ignore them, and so does the exit status.

Checks: every listed file exists with its recorded size, schema, layout and row count; every row has its bucket's
latent shape and dtype, byte lengths that match its shape columns, finite values, the crop and sample id that
:func:`rayflux.buckets.plan` gives for it, and its caption's text embedding; sample ids are unique; per-file and
per-bucket counts match the manifest; ``cached + skipped == discovered`` and ``skipped.jsonl`` agrees.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from rayflux import buckets, storage
from rayflux.cache import generations, shards
from rayflux.cache.prepare import sample_id


def find_generations(path: str) -> list[str]:
    """Generation directories at, under, or two levels under ``path``."""
    if generations.generation_number(path) is not None or storage.exists(storage.join(path, generations.MANIFEST)):
        return [path]
    direct = generations.generation_dirs(path)
    if direct:
        return direct
    return [g for key_dir in generations.list_dirs(path) for g in generations.generation_dirs(key_dir)]


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _plain_error(what: str, expected, actual) -> shards.CacheShapeError:
    return shards.CacheShapeError(f"{what} expected {expected}, got {actual}")


def _size(path: str) -> int | None:
    fs, inner = storage.resolve(path)
    info = fs.get_file_info(inner)
    return info.size if info.type == pafs.FileType.File else None


class _Checker:
    """Collects the problems of one committed generation and its per-bucket numbers."""

    def __init__(self, gen_dir: str, manifest: dict):
        self.dir, self.m = gen_dir, manifest
        self.problems: list[str] = []
        self.buckets: dict[str, dict] = {}
        self.layout = shards.ShardLayout(**manifest["layout"])
        self.spec = buckets.BucketSpec(**manifest["bucket_spec"])
        # Each dataset of a multi-dataset cache has its own resolution and crop.
        self.specs = {k: buckets.BucketSpec(**v) for k, v in manifest.get("bucket_specs", {}).items()}
        self.text: dict[str, bytes] = {}

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def _row_groups(self, entry: dict, kind: str) -> Iterator[tuple[int, pa.Table, int]]:
        """(index, one-row table, stored bytes) of each row of a listed file, after the file-level checks.

        One row group at a time, so verifying a cache of multi-megabyte rows needs little memory.
        """
        path = storage.join(self.dir, entry["path"])
        size = _size(path)
        if size is None:
            self.problem(f"{entry['path']}: listed in the manifest but missing")
            return
        if "bytes" in entry and size != entry["bytes"]:
            self.problem(f"{entry['path']}: {size} bytes on disk, manifest says {entry['bytes']}")
        want = shards.ShardLayout(**{**self.m["layout"], "kind": kind})
        try:
            with shards.open_shard(path) as f:
                if not f.schema_arrow.remove_metadata().equals(want.schema().remove_metadata()):
                    self.problem(f"{entry['path']}: columns differ from the {kind} schema")
                    return
                found = shards.layout_of(f.schema_arrow)
                if found != want:
                    self.problem(f"{entry['path']}: shard layout {found} is not the manifest's {want}")
                if f.metadata.num_rows != entry["rows"]:
                    self.problem(f"{entry['path']}: {f.metadata.num_rows} rows, manifest says {entry['rows']}")
                for i in range(f.num_row_groups):
                    yield i, f.read_row_group(i), f.metadata.row_group(i).total_byte_size
        except Exception as exc:  # noqa: BLE001 - any unreadable shard is a finding, not a crash
            self.problem(f"{entry['path']}: unreadable Parquet: {type(exc).__name__}: {exc}")

    def check_text(self) -> None:
        for entry in self.m["text_files"]:
            for _, table, _ in self._row_groups(entry, "text"):
                for row in table.to_pylist():
                    where = f"{entry['path']}: caption {row['caption_id']}"
                    if row["caption_id"] in self.text:
                        self.problem(f"{where}: appears twice")
                    try:
                        shards.check_text(row, self.layout, _plain_error)
                    except shards.CacheShapeError as exc:
                        self.problem(f"{where}: {exc}")
                    self.text[row["caption_id"]] = _digest(row["t5"])

    def check_samples(self) -> None:
        seen: set[str] = set()
        for entry in self.m["files"]:
            parts = []
            for i, table, stored in self._row_groups(entry, "samples"):
                part = shards.bucket_summary(table)
                parts.append(part)
                for row in table.to_pylist():
                    self._check_row(f"{entry['path']} row {i}", row, seen)
                for b, e in part.items():
                    total = self.buckets.setdefault(b, {**e, "rows": 0, "latent_bytes": 0, "stored_bytes": 0})
                    total["rows"] += e["rows"]
                    total["latent_bytes"] += e["latent_bytes"]
                    total["stored_bytes"] += stored
            try:
                file_buckets = shards.merge_summaries(parts)
            except shards.CacheShapeError as exc:
                self.problem(f"{entry['path']}: {exc}")
                continue
            if parts and file_buckets != entry.get("buckets", file_buckets):
                self.problem(f"{entry['path']}: per-bucket counts {file_buckets} differ from the manifest's")

    def _check_row(self, where: str, row: dict, seen: set[str]) -> None:
        sid = row["sample_id"]
        if sid in seen:
            self.problem(f"{where}: sample {sid} appears twice")
        seen.add(sid)
        try:
            shards.check_row(row, self.layout)
        except shards.CacheShapeError as exc:
            self.problem(f"{where}: {exc}")
            return
        try:
            spec = self.specs.get(row.get("dataset") or "", self.spec)
            p = buckets.plan(row["orig_w"], row["orig_h"], spec, seed=self.m["seed"], salt=row["rel_path"])
        except ValueError as exc:
            self.problem(f"{where}: sample {sid}: the bucket function refuses its size: {exc}")
            return
        geometry = (row["bucket"], row["crop_left"], row["crop_top"], row["crop_w"], row["crop_h"])
        if geometry != (p.key, p.crop_left, p.crop_top, p.crop_width, p.crop_height):
            self.problem(f"{where}: sample {sid}: bucket/crop {geometry} but the bucket function gives {p}")
        if sid != sample_id(row["rel_path"], row["source_sha256"], p):
            self.problem(f"{where}: sample id {sid} does not match its path, content hash and crop")
        if row["generation"] != self.m["generation"]:
            self.problem(f"{where}: sample {sid}: generation {row['generation']}, manifest says {self.m['generation']}")
        if self.text.get(row["caption_id"]) != _digest(row["t5"]):
            self.problem(f"{where}: sample {sid}: text embedding differs from caption {row['caption_id']}'s text row")

    def check_totals(self) -> None:
        m = self.m
        got = {b: {k: e[k] for k in ("rows", "latent_shape", "dtype", "latent_bytes")} for b, e in self.buckets.items()}
        if got != m["buckets"]:
            self.problem(f"per-bucket totals {got} differ from the manifest's {m['buckets']}")
        rows = sum(e["rows"] for e in self.buckets.values())
        if rows != m["cached"]:
            self.problem(f"{rows} rows in shards, manifest says cached={m['cached']}")
        if m["cached"] + m["skipped"] != m["discovered"]:
            self.problem(f"cached {m['cached']} + skipped {m['skipped']} != discovered {m['discovered']}")
        try:
            skipped = generations.load_skipped(self.dir)
        except (OSError, ValueError) as exc:
            self.problem(f"{generations.SKIPPED}: unreadable: {exc}")
            return
        if len(skipped) != m["skipped"] or skipped != m.get("skipped_inputs", skipped):
            self.problem(f"{generations.SKIPPED} lists {len(skipped)} inputs, manifest says {m['skipped']}")

    def unlisted(self) -> list[str]:
        """Parquet files in the generation that the manifest does not list (ignored by readers)."""
        listed = {f["path"] for f in self.m["files"] + self.m["text_files"]}
        fs, inner = storage.resolve(self.dir)
        infos = fs.get_file_info(pafs.FileSelector(inner, recursive=True, allow_not_found=True))
        files = [i.path for i in infos if i.type == pafs.FileType.File and i.path.endswith(".parquet")]
        found = {f[len(inner) + 1 :] for f in files}
        return sorted(found - listed)


def verify_generation(gen_dir: str, manifest: dict) -> tuple[list[str], dict, list[str]]:
    """(problems, per-bucket numbers, unlisted files) of one committed generation."""
    if manifest.get("schema_version") != shards.SCHEMA_VERSION:
        return [f"schema version {manifest.get('schema_version')}; this rayflux reads {shards.SCHEMA_VERSION}"], {}, []
    c = _Checker(gen_dir, manifest)
    c.check_text()
    c.check_samples()
    c.check_totals()
    return c.problems, c.buckets, c.unlisted()


_ROW = "  {:>10} {:>6}  {:<14} {:<9} {:>13} {:>13}"


def _report(gen_dir: str, manifest: dict, out) -> bool:
    problems, per_bucket, unlisted = verify_generation(gen_dir, manifest)
    m = manifest
    print(
        f"{gen_dir}: generation {m['generation']}, {m['discovered']} discovered = {m['cached']} cached"
        f" + {m['skipped']} skipped; {len(m['text_files'])} text and {len(m['files'])} sample shards",
        file=out,
    )
    print(_ROW.format("bucket", "rows", "latent shape", "dtype", "latent bytes", "stored bytes"), file=out)
    for b, e in sorted(per_bucket.items()):
        shape = "x".join(str(s) for s in e["latent_shape"])
        print(_ROW.format(b, e["rows"], shape, e["dtype"], e["latent_bytes"], e["stored_bytes"]), file=out)
    for f in unlisted:
        print(f"  note: {f} is not listed in the manifest; readers ignore it", file=out)
    for p in problems:
        print(f"  PROBLEM: {p}", file=out)
    print(f"  {'OK' if not problems else f'FAILED: {len(problems)} problem(s)'}", file=out)
    return not problems


def main(argv: list[str] | None = None, out=None) -> int:
    out = out or sys.stdout
    parser = argparse.ArgumentParser(prog="python -m rayflux cache verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("cache_dir", help="a generation dir, a cache key dir, or a whole cache.dir (local or URI)")
    args = parser.parse_args(argv)
    found = find_generations(args.cache_dir.rstrip("/") or "/")
    ok, committed = True, 0
    for gen_dir in found:
        try:
            if generations.is_retired(gen_dir):
                print(f"{gen_dir}: retired; readers refuse it", file=out)
                continue
            manifest = generations.load_manifest(gen_dir)
            if manifest is None:
                print(f"{gen_dir}: uncommitted (no {generations.MANIFEST}); readers ignore it", file=out)
                continue
            committed += 1
            ok = _report(gen_dir, manifest, out) and ok
        except (KeyError, TypeError, ValueError) as exc:
            print(f"{gen_dir}: PROBLEM: cannot check this generation: {type(exc).__name__}: {exc}", file=out)
            ok = False
    if not committed:
        print(f"{args.cache_dir}: no committed cache generation found", file=out)
        return 1
    return 0 if ok else 1
