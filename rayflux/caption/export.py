"""``rayflux captions export``: a committed captions table written out where the user asks, as ``.txt`` sidecar
files (one beside each image's relative path) or as one ``metadata.jsonl`` (Hugging Face imagefolder's
``file_name`` and ``text``), so the captions can be read, edited or used by another tool. The table itself stays
in the cache directory; the image folder is only written when the user names it."""

from __future__ import annotations

import argparse
import json
import posixpath
import sys

import pyarrow.compute as pc

from rayflux import storage
from rayflux.caption import table

DESCRIPTION = """\
Write the VLM captions a job committed (data.caption_strategy=vlm or data.missing_caption=vlm) as .txt sidecars or
one metadata.jsonl. SOURCE is a captions generation (<cache.dir>/captions/<captioner>/g<N>), a captioner's folder
(its newest generation), or a cache.dir (the most recently committed generation of any captioner there). Images the
captioner could not read have no caption and are left out (counted)."""


def resolve(source: str) -> str:
    """The captions generation ``source`` names (see :data:`DESCRIPTION`); ValueError when it names none."""
    if storage.exists(storage.join(source, table.MANIFEST)):
        return source
    found = table.latest(source)
    if found is not None:
        return found[0]
    root = storage.join(source, table.ROOT)
    newest = []
    for cdir in _dirs(root):
        got = table.latest(cdir)
        if got is not None:
            newest.append((got[1].get("committed", 0.0), got[0]))
    if not newest:
        raise ValueError(f"{source} holds no committed captions table (nor does {root})")
    return max(newest)[1]


def _dirs(parent: str) -> list[str]:
    import pyarrow.fs as pafs

    fs, inner = storage.resolve(parent)
    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    return [storage.join(parent, i.base_name) for i in infos if i.type == pafs.FileType.Directory]


def sidecar_name(rel_path: str, ext: str = ".txt") -> str:
    """``a/b/img.png`` -> ``a/b/img.txt``: the caption file the cache's sidecar strategy matches to the image."""
    stem, dot, _ = rel_path.rpartition(".")
    return (stem if dot else rel_path) + ext


def export(gdir: str, out: str, jsonl: bool = False, overwrite: bool = False) -> tuple[int, int]:
    """Write the captions of generation ``gdir`` under ``out``; (written, left out)."""
    rows = table.read_table(gdir)
    captioned = rows.filter(pc.not_equal(rows["caption"], ""))
    paths, captions = captioned["rel_path"].to_pylist(), captioned["caption"].to_pylist()
    targets = [storage.join(out, "metadata.jsonl")] if jsonl else [storage.join(out, sidecar_name(p)) for p in paths]
    if not overwrite:
        clash = next((t for t in targets if storage.exists(t)), None)
        if clash:
            raise FileExistsError(f"{clash} exists; pass --overwrite to replace it")
    if jsonl:
        lines = (json.dumps({"file_name": p, "text": c}, ensure_ascii=False) for p, c in zip(paths, captions))
        storage.write_bytes_atomic(targets[0], ("\n".join(lines) + "\n").encode())
    else:
        for target, caption in zip(targets, captions):
            storage.write_bytes_atomic(target, (caption + "\n").encode())
    return len(paths), rows.num_rows - captioned.num_rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rayflux captions export", description=DESCRIPTION)
    p.add_argument("source", help="a captions generation, a captioner's folder, or a cache.dir")
    p.add_argument("--out", required=True, help="folder (or URI) to write the .txt files or metadata.jsonl into")
    p.add_argument("--jsonl", action="store_true", help="one metadata.jsonl (file_name, text) instead of .txt files")
    p.add_argument("--overwrite", action="store_true", help="replace files that already exist")
    args = p.parse_args(argv)
    try:
        gdir = resolve(args.source)
        written, left = export(gdir, args.out, jsonl=args.jsonl, overwrite=args.overwrite)
    except (ValueError, FileExistsError) as exc:
        print(f"rayflux captions export: {exc}", file=sys.stderr)
        return 1
    what = posixpath.join(args.out, "metadata.jsonl") if args.jsonl else f".txt files under {args.out}"
    print(
        f"exported {written} captions from {gdir} to {what}" + (f"; {left} unreadable images left out" if left else "")
    )
    return 0
