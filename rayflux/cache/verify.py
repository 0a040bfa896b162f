"""``python -m rayflux cache verify <cache_dir>``: check committed generations against their manifests and buckets.

``<cache_dir>`` may be one generation (``.../<key>/g00003-<inputs hash>``), one cache key (its generation
children), or a whole ``cache.dir`` (``<key>/<generation>`` grandchildren). For each committed generation it prints
the rows, latent shape, dtype and bytes of every bucket, then every problem it found. The exit status is 0 when
everything is consistent, 1 when anything is not (or when no committed generation is found at all, as for a named
generation that was never committed), 2 for usage errors. Directories without a manifest, or retired ones, are
listed: readers ignore them, and so does the exit status.

Checks: every listed file exists with its recorded size, schema, layout and row count; every row has its bucket's
latent shape and dtype, byte lengths that match its shape columns (a compressed text tensor's once decoded by the
codec its caption index row names, :mod:`rayflux.cache.codec`), finite values, and the crop and sample id that
:func:`rayflux.buckets.plan` gives for it; the generation index has one row per sample (ids unique) and per caption,
each pointing into a file the generation owns or lists as borrowed, at exactly its tensor's bytes (checked against
the file's own Parquet metadata and rows), whose checksum is still the one its writer recorded (see
:mod:`rayflux.cache.integrity`; the damaged samples and captions are recorded beside the generation, and the next
run of the job re-encodes exactly those), and every own row is indexed; every sample's caption is indexed, the empty
one included; per-file and per-bucket counts match the manifest; ``cached + skipped == discovered`` and
``skipped.jsonl`` agrees; and the directory holds no file the manifest does not list. ``--quick`` skips the
checksums and the value checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from rayflux import buckets, storage
from rayflux.cache import codec, generations, index, integrity, shards
from rayflux.cache.manifest import Manifest
from rayflux.cache.prepare import sample_id


def find_generations(path: str) -> list[str]:
    """Generation directories at, under, or two levels under ``path``."""
    if generations.generation_number(path) is not None or storage.exists(storage.join(path, generations.MANIFEST)):
        return [path]
    direct = generations.generation_dirs(path)
    if direct:
        return direct
    return [g for key_dir in generations.list_dirs(path) for g in generations.generation_dirs(key_dir)]


def _plain_error(what: str, expected, actual) -> shards.CacheShapeError:
    return shards.CacheShapeError(f"{what} expected {expected}, got {actual}")


def _size(path: str) -> int | None:
    fs, inner = storage.resolve(path)
    info = fs.get_file_info(inner)
    return info.size if info.type == pafs.FileType.File else None


class _Checker:
    """Collects the problems of one committed generation and its per-bucket numbers."""

    def __init__(self, gen_dir: str, manifest: dict, quick: bool = False):
        self.dir, self.m, self.quick = gen_dir, manifest, quick
        self.damage = integrity.Damage()
        """The samples and captions whose tensors fail their checksums."""
        self.problems: list[str] = []
        self.buckets: dict[str, dict] = {}
        self.m = Manifest.of(manifest)
        self.layout = self.m.layout
        # Each dataset of a multi-dataset cache has its own resolution and crop.
        self.spec, self.specs = self.m.bucket_specs()
        self.own_rows: set[tuple[str, int]] = set()
        """(index-style file, row) of every row in the generation's own shards."""
        self.name = generations.generation_name(gen_dir)

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def _own(self, entry: dict, i: int) -> None:
        self.own_rows.add((f"{self.name}/{entry['path']}", i))

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
        want = dataclasses.replace(self.layout, kind=kind)
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
                    self._own(entry, i)
                    yield i, f.read_row_group(i), f.metadata.row_group(i).total_byte_size
        except Exception as exc:  # noqa: BLE001 - any unreadable shard is a finding, not a crash
            self.problem(f"{entry['path']}: unreadable Parquet: {type(exc).__name__}: {exc}")

    def check_text(self) -> None:
        codecs = self._text_codecs()
        for entry in self.m.shard_files("text"):
            file = f"{self.name}/{entry['path']}"
            for i, table, _ in self._row_groups(entry, "text"):
                for row in table.to_pylist():
                    where = f"{entry['path']}: caption {row['caption_id']}"
                    try:
                        stored = codecs.get((file, i))
                        shards.check_text(row, self.layout, _plain_error, values=not self.quick, codecs=stored)
                    except shards.CacheShapeError as exc:
                        self.problem(f"{where}: {exc}")

    def _text_codecs(self) -> dict[tuple[str, int], dict[str, str]]:
        """How each indexed text row's tensors are stored, by (index-style file, row): the caption index's codec
        columns (none in an index written before them: raw). An unreadable index is check_index's finding."""
        try:
            captions = index.read(self.m, "captions").to_pylist()
        except Exception:  # noqa: BLE001
            return {}
        return {
            (c["file"], c["row"]): {t.name: c.get(f"{t.key}_{codec.COLUMN}") or codec.RAW for t in self.layout.text}
            for c in captions
        }

    def check_samples(self) -> None:
        seen: set[str] = set()
        for entry in self.m.shard_files("samples"):
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

    def check_index(self) -> None:
        """The index against the manifest, the layout and the very bytes of the files it points into."""
        try:
            samples = index.read(self.m, "samples").to_pylist()
            captions = index.read(self.m, "captions").to_pylist()
        except Exception as exc:  # noqa: BLE001 - a missing or unreadable index is a finding
            self.problem(f"generation index unreadable: {type(exc).__name__}: {exc}")
            return
        allowed = {f"{self.name}/{f['path']}" for f in self.m.shard_files("samples") + self.m.shard_files("text")}
        allowed |= set(self.m.borrowed)
        caption_ids = [c["caption_id"] for c in captions]
        if len(set(caption_ids)) != len(caption_ids):
            self.problem("caption index: a caption appears twice")
        empty = self.m.empty_caption_row()
        if empty.get("caption") != "" or empty.get("caption_id") not in caption_ids:
            self.problem("caption index: no empty caption where the manifest says it is")
        known = set(caption_ids)
        seen: set[str] = set()
        by_file: dict[str, list[dict]] = {}
        for e in samples:
            where = f"index: sample {e['sample_id']} ({e['source_uri']})"
            if e["sample_id"] in seen:
                self.problem(f"{where}: appears twice")
            seen.add(e["sample_id"])
            if e["caption_id"] not in known:
                self.problem(f"{where}: caption {e['caption_id']} is not in the caption index")
            want = self.layout.latent_shape(e["bucket"])
            got = (e["latent_c"], e["latent_h"], e["latent_w"])
            for t in self.layout.samples:
                length, nbytes = e[t.columns()[1]], t.nbytes(want, e, self.layout.dtype_of(t))
                if got != want or (length != nbytes and not (t.optional and length == 0)):
                    self.problem(
                        f"{where}: bucket {e['bucket']}: {t.name} of latent shape {got} and {length} bytes, "
                        f"expected {want} and {nbytes}"
                    )
            for t in self.layout.samples:  # an uncounted tensor's hash names bytes the row must hold
                if t.hash and not t.counts() and e.get(t.hash) and not e.get(t.columns()[1]):
                    self.problem(f"{where}: {t.name} {e[t.hash][:12]} recorded but no {t.name} bytes")
            by_file.setdefault(e["file"], []).append(e)
        for c in captions:
            by_file.setdefault(c["file"], []).append(c)
        for file, entries in sorted(by_file.items()):
            if file not in allowed:
                self.problem(f"index: {file} is neither this generation's file nor listed as borrowed")
                continue
            self._check_locations(file, entries)
        indexed = {(e["file"], e["row"]) for e in samples + captions}
        for file, row in sorted(self.own_rows - indexed):
            self.problem(f"{file} row {row}: written by this generation but not in its index")
        self.index_buckets = {}
        for e in samples:
            b = self.index_buckets.setdefault(
                e["bucket"],
                {
                    "rows": 0,
                    "latent_shape": [e["latent_c"], e["latent_h"], e["latent_w"]],
                    "dtype": self.layout.dtype,
                    "latent_bytes": 0,
                },
            )
            b["rows"] += 1
            b["latent_bytes"] += e["length"]

    def _check_locations(self, file: str, entries: list[dict]) -> None:
        """Each entry's row of ``file`` holds what the entry says, and its tensors are at the entry's byte ranges."""
        path = index.resolve(self.m, file)
        size = _size(path)
        if size is None:
            self.problem(f"index: {file} is missing")
            return
        if any(e["file_bytes"] != size for e in entries):
            self.problem(f"index: {file}: {size} bytes on disk, index says {entries[0]['file_bytes']}")
        try:
            with shards.open_shard(path) as f:
                md, names = f.metadata, f.schema_arrow.names
                for e in entries:
                    row = f.read_row_group(e["row"]).to_pylist()[0]
                    text = "sample_id" not in e
                    key = "caption_id" if text else "sample_id"
                    where = f"index: {file} row {e['row']}"
                    if row[key] != e[key]:
                        self.problem(f"{where}: holds {key} {row[key]}, index says {e[key]}")
                        continue
                    rg = md.row_group(e["row"])
                    samples = {t.key: t.name for t in self.layout.samples}
                    cols = {f"{t.key}_": t.name for t in self.layout.text} if text else samples
                    for prefix, col in cols.items():
                        chunk = rg.column(names.index(col))
                        end = chunk.data_page_offset + chunk.total_compressed_size
                        off, n = e[f"{prefix}offset"], e[f"{prefix}length"]
                        at = (end - len(row[col]), len(row[col]))
                        if (off, n) != at:
                            self.problem(f"{where}: {col} is at {at[0]}+{at[1]}, index says {off}+{n}")
                        elif not self.quick:
                            self._checksum(file, e, prefix, col, row[col])
                    if not text and not file.startswith(self.name + "/"):  # borrowed rows: own ones were checked above
                        try:
                            shards.check_row(row, self.layout, values=not self.quick)
                        except shards.CacheShapeError as exc:
                            self.problem(f"{where}: {exc}")
        except Exception as exc:  # noqa: BLE001 - any unreadable shard is a finding, not a crash
            self.problem(f"index: {file}: unreadable Parquet: {type(exc).__name__}: {exc}")

    def _checksum(self, file: str, e: dict, prefix: str, col: str, data: bytes) -> None:
        """The tensor's bytes against the checksum the index recorded when they were written."""
        got, want = integrity.checksum(data), e[f"{prefix}{integrity.COLUMN}"]
        if got == want:
            return
        text = "sample_id" not in e
        what = f"caption {e['caption_id']}" if text else f"sample {e['sample_id']} ({e['source_uri']})"
        what = f"{col} of {what}"
        self.problem(f"index: {integrity.mismatch(file, e[f'{prefix}offset'], len(data), what, got, want)}")
        (self.damage.captions if text else self.damage.samples).append(e["caption_id" if text else "sample_id"])

    def _check_row(self, where: str, row: dict, seen: set[str]) -> None:
        sid = row["sample_id"]
        if sid in seen:
            self.problem(f"{where}: sample {sid} appears twice")
        seen.add(sid)
        try:
            shards.check_row(row, self.layout, values=not self.quick)
        except shards.CacheShapeError as exc:
            self.problem(f"{where}: {exc}")
            return
        try:
            spec = self.specs.get(row.get("dataset") or "", self.spec)
            p = buckets.plan(row["orig_w"], row["orig_h"], spec, seed=self.m.seed, salt=row["rel_path"])
        except ValueError as exc:
            self.problem(f"{where}: sample {sid}: the bucket function refuses its size: {exc}")
            return
        geometry = (row["bucket"], row["crop_left"], row["crop_top"], row["crop_w"], row["crop_h"])
        if geometry != (p.key, p.crop_left, p.crop_top, p.crop_width, p.crop_height):
            self.problem(f"{where}: sample {sid}: bucket/crop {geometry} but the bucket function gives {p}")
        refs = tuple(h for h in row["ref_sha256"].split(",") if h)
        if sid != sample_id(row["rel_path"], row["source_sha256"], p, refs):
            self.problem(f"{where}: sample id {sid} does not match its path, content hash, crop and references")
        if row["generation"] != self.m.generation:
            self.problem(f"{where}: sample {sid}: generation {row['generation']}, manifest says {self.m.generation}")

    def check_totals(self) -> None:
        m, n = self.m, self.m.skip_counts()
        got = getattr(self, "index_buckets", None)
        if got is not None and got != m.buckets:
            self.problem(f"per-bucket totals {got} differ from the manifest's {m.buckets}")
        rows = sum(e["rows"] for e in (got or {}).values())
        if got is not None and rows != n.cached:
            self.problem(f"{rows} samples in the index, manifest says cached={n.cached}")
        if n.cached + n.skipped != n.discovered:
            self.problem(f"cached {n.cached} + skipped {n.skipped} != discovered {n.discovered}")
        try:
            skipped = generations.load_skipped(self.dir)
        except (OSError, ValueError) as exc:
            self.problem(f"{generations.SKIPPED}: unreadable: {exc}")
            return
        if len(skipped) != n.skipped or skipped != (m.skipped_inputs or skipped):
            self.problem(f"{generations.SKIPPED} lists {len(skipped)} inputs, manifest says {n.skipped}")

    def unlisted(self) -> list[str]:
        """Files in the generation's directory that its manifest does not list: commit removes them, so any one
        is damage (or a write that did not go through the cache stage)."""
        keep = generations.listed(self.m)
        found = [f for f in generations.files_in(self.dir) if f not in keep]
        for f in found:
            self.problem(f"{f}: inside a committed generation but not listed in its manifest")
        return found


def verify_generation(gen_dir: str, manifest: dict, quick: bool = False) -> tuple[list[str], dict, list[str]]:
    """(problems, per-bucket numbers, unlisted files) of one committed generation. Tensors whose checksums fail are
    recorded for the next build to re-encode (:func:`rayflux.cache.integrity.record`); ``quick`` skips checksums and
    value checks."""
    manifest = Manifest.of(manifest)
    if manifest.schema_version != shards.SCHEMA_VERSION:
        return (
            [
                f"schema version {manifest.schema_version}; this rayflux reads {shards.SCHEMA_VERSION} (a run "
                "of the job builds a new cache for it)"
            ],
            {},
            [],
        )
    c = _Checker(gen_dir, manifest, quick)
    c.check_text()
    c.check_samples()
    c.check_index()
    c.check_totals()
    unlisted = c.unlisted()
    if c.damage.samples or c.damage.captions:
        path = integrity.record(gen_dir, c.damage)
        n, k = len(set(c.damage.samples)), len(set(c.damage.captions))
        c.problem(
            f"recorded {n} damaged sample(s) and {k} caption(s) in {path}: the next run of the job re-encodes "
            "exactly those, reusing the rest"
        )
    per_bucket = {
        b: {**e, "stored_bytes": c.buckets.get(b, {}).get("stored_bytes", 0)}
        for b, e in getattr(c, "index_buckets", {}).items()
    }
    return c.problems, per_bucket, unlisted


_ROW = "  {:>10} {:>6}  {:<14} {:<9} {:>13} {:>13}"


def _report(gen_dir: str, manifest: dict, out, quick: bool = False) -> bool:
    problems, per_bucket, unlisted = verify_generation(gen_dir, manifest, quick)
    m = manifest
    print(
        f"{gen_dir}: generation {m['generation']}, {m['discovered']} discovered = {m['cached']} cached"
        f" + {m['skipped']} skipped; {len(m['text_files'])} text and {len(m['files'])} sample shards",
        file=out,
    )
    print(_ROW.format("bucket", "rows", "latent shape", "dtype", "latent bytes", "written bytes"), file=out)
    for b, e in sorted(per_bucket.items()):
        shape = "x".join(str(s) for s in e["latent_shape"])
        print(_ROW.format(b, e["rows"], shape, e["dtype"], e["latent_bytes"], e["stored_bytes"]), file=out)
    for p in problems:
        print(f"  PROBLEM: {p}", file=out)
    print(f"  {'OK' if not problems else f'FAILED: {len(problems)} problem(s)'}", file=out)
    return not problems


def main(argv: list[str] | None = None, out=None) -> int:
    out = out or sys.stdout
    parser = argparse.ArgumentParser(prog="python -m rayflux cache verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("cache_dir", help="a generation dir, a cache key dir, or a whole cache.dir (local or URI)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="skip each tensor's checksum and value checks (layout, places and counts only)",
    )
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
            ok = _report(gen_dir, manifest, out, args.quick) and ok
        except (KeyError, TypeError, ValueError) as exc:
            print(f"{gen_dir}: PROBLEM: cannot check this generation: {type(exc).__name__}: {exc}", file=out)
            ok = False
    if not committed:
        print(f"{args.cache_dir}: no committed cache generation found", file=out)
        return 1
    return 0 if ok else 1
