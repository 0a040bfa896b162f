"""Caption strategies: sidecar files, file names, metadata tables and a fixed instance prompt.

Every strategy yields a list of caption options per image (several sidecar lines, or a list in a metadata row, are
several options); discovery then picks one per generation. Metadata tables follow the Hugging Face imagefolder
convention: a ``metadata.jsonl``, ``metadata.csv`` or ``metadata.parquet`` whose ``file_name`` column names an image
relative to the table's own folder.
"""

from __future__ import annotations

import csv
import io
import json
import posixpath
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.fs as pafs

from rayflux import storage
from rayflux.config import DatasetConfig

METADATA_NAMES = ("metadata.jsonl", "metadata.csv", "metadata.parquet")


class CaptionError(ValueError):
    """A dataset's captions cannot be read at all (for example a metadata table without a ``file_name`` column)."""


@dataclass
class MetadataIndex:
    """Captions from metadata tables, by image path relative to the dataset root, and what was wrong with them."""

    captions: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    references: dict[str, list[str]] = field(default_factory=dict)
    """With ``reference_column``: each image's reference files, relative to ``reference_dir`` when it is set, else to
    the dataset root (in the order the table lists them)."""
    masks: dict[str, str] = field(default_factory=dict)
    """With ``mask=column``: each image's mask file, relative to ``mask_dir`` when it is set, else to the dataset
    root."""


def read_sidecar(fs: pafs.FileSystem, path: str) -> list[str]:
    """Non-empty lines of a caption file. Raises UnicodeDecodeError for non-UTF-8 bytes (the caller records a skip)."""
    text = storage.read_object(fs, path).decode("utf-8-sig")
    return [line.strip() for line in text.splitlines() if line.strip()]


def from_filename(name: str) -> str:
    """``a_red-circle.png`` -> ``a red circle``."""
    stem = name[: name.rfind(".")] if "." in name else name
    return " ".join(stem.replace("_", " ").replace("-", " ").split())


def _options(value) -> list[str] | None:
    """A caption cell as a list of options; None when the cell is neither a string nor a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value.strip()] if value.strip() else []
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return [v.strip() for v in value if v.strip()]
    return None


def _rows(fs: pafs.FileSystem, path: str, column: str, extras: dict[str, str] | None = None) -> list[tuple]:
    """(where, file_name, caption cell, {extra column: its cell}) for every row of one metadata table. ``extras``:
    further columns to read, each with the config key that named it (for the message when no row has it)."""
    extras = extras or {}
    name = path.rsplit("/", 1)[-1]
    if name.endswith(".jsonl"):
        return _jsonl_rows(storage.read_object(fs, path), path, column, extras)
    table = _table(fs, path)
    if "file_name" not in table.column_names:
        raise CaptionError(f"{path}: no 'file_name' column (columns: {', '.join(table.column_names)})")
    names = table["file_name"].to_pylist()
    for col in (column, *extras):
        if col not in table.column_names:
            raise CaptionError(f"{path}: no {col!r} column (columns: {', '.join(table.column_names)})")
    cells = table[column].to_pylist()
    more = {e: table[e].to_pylist() for e in extras}
    return [
        (f"{name} row {i + 1}", n, c, {e: more[e][i] for e in extras}) for i, (n, c) in enumerate(zip(names, cells))
    ]


def _jsonl_rows(raw: bytes, path: str, column: str, extras: dict[str, str]) -> list[tuple]:
    """:func:`_rows` of a JSON Lines table: a JSON object per line, each with a ``file_name``."""
    name = path.rsplit("/", 1)[-1]
    try:
        lines = raw.decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as exc:
        raise CaptionError(f"{path}: not UTF-8 ({exc.reason})") from None
    rows, has_column, seen = [], False, set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise CaptionError(f"{path} line {n}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise CaptionError(f"{path} line {n}: expected a JSON object, got {type(obj).__name__}")
        if "file_name" not in obj:
            raise CaptionError(f"{path} line {n}: no 'file_name' key (keys: {', '.join(sorted(obj))})")
        rows.append((f"{name} line {n}", obj["file_name"], obj.get(column), {e: obj.get(e) for e in extras}))
        has_column = has_column or column in obj
        seen.update(e for e in extras if e in obj)
    if rows and not has_column:
        raise CaptionError(f"{path}: no row has a {column!r} key (set caption_column to the caption's key)")
    for extra, key in extras.items():
        if rows and extra not in seen:
            raise CaptionError(f"{path}: no row has a {extra!r} key (set {key} to the column's key)")
    return rows


def _table(fs: pafs.FileSystem, path: str) -> pa.Table:
    """A CSV (every column read as strings) or Parquet metadata table."""
    if path.endswith(".csv"):
        import pyarrow.csv as pacsv

        raw = storage.read_object(fs, path)
        try:
            lines = raw.decode("utf-8-sig").splitlines()
            # Strings stay strings: a caption like "1984" or a file named "001" must not become a number.
            types = {n: pa.string() for n in next(csv.reader(lines[:1]), [])}
            return pacsv.read_csv(io.BytesIO(raw), convert_options=pacsv.ConvertOptions(column_types=types))
        except UnicodeDecodeError as exc:
            raise CaptionError(f"{path}: not UTF-8 ({exc.reason})") from None
        except pa.ArrowInvalid as exc:
            raise CaptionError(f"{path}: not a readable CSV table ({exc})") from None
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path, filesystem=fs)
    except (pa.ArrowInvalid, OSError) as exc:
        raise CaptionError(f"{path}: not a readable Parquet table ({exc})") from None


def _tables(fs: pafs.FileSystem, prefix: str, files: set[str], ds: DatasetConfig) -> list[tuple]:
    """``(filesystem, path, folder its file names are relative to)`` of each metadata table of the dataset."""
    if ds.metadata_file:
        if "://" in ds.metadata_file:  # a table kept elsewhere names files relative to the dataset root
            tfs, path = storage.resolve(ds.metadata_file)
            tables = [(tfs, path, "")]
        else:
            rel = ds.metadata_file.lstrip("/")
            tables = [(fs, prefix + rel, posixpath.dirname(rel))]
        tfs, path, _ = tables[0]
        if tfs.get_file_info(path).type != pafs.FileType.File:
            raise CaptionError(f"metadata_file {ds.metadata_file!r} not found (looked for {path})")
        return tables
    found = sorted(p for p in files if p.rsplit("/", 1)[-1] in METADATA_NAMES)
    if not found:
        raise CaptionError(
            f"caption_strategy=metadata, but {ds.images_dir} holds no {', '.join(METADATA_NAMES)} "
            "(set metadata_file to name the table)"
        )
    return [(fs, p, posixpath.dirname(p[len(prefix) :])) for p in found]


def load_metadata(fs: pafs.FileSystem, root: str, files: set[str], ds: DatasetConfig) -> MetadataIndex:
    """Read the dataset's metadata tables. ``files`` are all file paths under ``root`` (as the filesystem names them).

    Raises CaptionError when a table is unusable as a whole; row-level trouble is collected in ``problems``.
    """
    prefix = root.rstrip("/") + "/"
    tables = _tables(fs, prefix, files, ds)
    index = MetadataIndex()
    seen: dict[str, str] = {}
    for tfs, path, folder in tables:
        for where, file_name, cell, more in _rows(tfs, path, ds.caption_column, _extras(ds)):
            if not isinstance(file_name, str) or not file_name.strip():
                index.problems.append(f"{path}: {where}: file_name is empty or not a string")
                continue
            rel = posixpath.normpath(posixpath.join(folder, file_name.strip()))
            if rel.startswith("../") or rel == ".." or rel.startswith("/"):
                index.problems.append(f"{path}: {where}: file_name {file_name!r} points outside the dataset")
                continue
            options = _options(cell)
            if options is None:
                index.problems.append(
                    f"{path}: {where}: {ds.caption_column!r} must be a string or a list of strings, got {cell!r}"
                )
                continue
            if rel in seen:
                index.problems.append(f"{path}: {where}: {rel} already has a caption ({seen[rel]}); kept the first")
                continue
            if prefix + rel not in files:
                index.problems.append(f"{path}: {where}: file_name {file_name!r} matches no file in the dataset")
                continue
            if ds.reference_column:
                named = _references(more[ds.reference_column], folder, ds)
                if isinstance(named, str):
                    index.problems.append(f"{path}: {where}: {named}")
                    continue
                index.references[rel] = named
            if ds.mask == "column":
                mask = _mask_file(more[ds.mask_column], folder, ds)
                if mask.startswith("!"):
                    index.problems.append(f"{path}: {where}: {mask[1:]}")
                elif mask:
                    index.masks[rel] = mask
            seen[rel] = where
            index.captions[rel] = options
    return index


def _extras(ds: DatasetConfig) -> dict[str, str]:
    """The metadata columns read besides the caption, each with the config key that names it."""
    out = {ds.reference_column: "reference_column"} if ds.reference_column else {}
    if ds.mask == "column":
        out[ds.mask_column] = "mask_column"
    return out


def _mask_file(cell, folder: str, ds: DatasetConfig) -> str:
    """A mask cell as a path (relative to ``mask_dir``, or to the dataset root), "" when the row names none, or
    ``"!"`` and what is wrong with it (the image then has no mask: ``missing_mask`` decides)."""
    if cell is None or (isinstance(cell, str) and not cell.strip()):
        return ""
    if not isinstance(cell, str):
        return f"!{ds.mask_column!r} must be a file name, got {cell!r}; the image has no mask"
    rel = posixpath.normpath(cell.strip() if ds.mask_dir else posixpath.join(folder, cell.strip()))
    if rel.startswith("../") or rel == ".." or rel.startswith("/"):
        return f"!mask {cell!r} points outside the {'mask_dir' if ds.mask_dir else 'dataset'}; the image has no mask"
    return rel


def _references(cell, folder: str, ds: DatasetConfig) -> list[str] | str:
    """A reference cell as paths (relative to ``reference_dir``, or to the dataset root), or what is wrong with it."""
    names = _options(cell)
    if names is None:
        return f"{ds.reference_column!r} must be a file name or a list of file names, got {cell!r}"
    out = []
    for name in names:
        rel = posixpath.normpath(name if ds.reference_dir else posixpath.join(folder, name))
        if rel.startswith("../") or rel == ".." or rel.startswith("/"):
            return f"reference {name!r} points outside the {'reference_dir' if ds.reference_dir else 'dataset'}"
        out.append(rel)
    return out


def finish(options: list[str], ds: DatasetConfig, file_name: str) -> tuple[list[str], str]:
    """Apply the missing-caption policy and the instance-prompt prefix. Returns (options, skip reason or "")."""
    if not options:
        policy = ds.missing_caption
        if policy in ("skip", "vlm"):
            # vlm: the caption stage made none for it (it could not read the image, or the image is new since).
            return [], f"no caption ({ds.caption_strategy}; missing_caption={policy})"
        options = {"empty": [""], "instance": [ds.instance_prompt], "filename": [from_filename(file_name)]}[policy]
    if ds.prepend_instance_prompt and ds.caption_strategy != "instance":
        # The instance caption itself is not doubled when it stood in for a missing caption.
        options = [o if o == ds.instance_prompt else f"{ds.instance_prompt} {o}".strip() for o in options]
    return options, ""
