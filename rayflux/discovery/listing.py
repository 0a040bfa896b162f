"""List a dataset into Arrow: one row per image with what its caption will come from, no caption file read yet.

The listing is columnar from the start: every file under the dataset's root comes as Arrow (:mod:`rayflux.discovery.walk`
builds no object per file), and matching images to caption files, hidden files, extensions and orphans are Arrow
compute over whole columns. Nothing here builds a Python object per image, except for edit pairs and metadata
captions, which map one image at a time in bounded chunks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs

from rayflux import datasets, storage
from rayflux.allocator import trim
from rayflux.config import DatasetConfig
from rayflux.discovery import captions, edit_pairs
from rayflux.discovery.walk import files

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
_CHUNK = 4096  # rows mapped through Python at a time where a value needs Python (edit pairs, metadata captions)
PART = 2048  # listed files turned into rows at a time: bounds the listing's short-lived columns

LISTED = pa.schema(
    [
        ("rel_path", pa.string()),
        ("size", pa.int64()),
        ("mtime_ns", pa.int64()),
        ("dataset", pa.string()),
        ("sidecar", pa.string()),
        ("sidecar_stamp", pa.string()),
        ("sidecar_lines", pa.string()),
        ("options", pa.list_(pa.string())),
        ("references", pa.list_(pa.string())),
        ("references_stamp", pa.string()),
        ("missing_reference", pa.string()),
        ("mask_uri", pa.string()),
        ("mask_stamp", pa.string()),
    ]
)
"""A listed image: its path under the dataset root (prefixed by the dataset's key when the job lists several),
size and mtime; either its caption file (``sidecar``, "" when none, with the ``size:mtime`` stamp the listing gave
it and, when known from the previous generation, its ``sidecar_lines``) or the caption ``options`` of the other
strategies; edit pairs' references (``missing_reference``: why they cannot be found); with ``data.mask=dir`` the URI
of its mask file and the mask's ``size:mtime`` ("" when it has none, see :func:`_masks`). The image's URI and file
name are not columns: both follow from the relative path (:func:`uris`), and the driver holds every listed row."""

_STRINGS = pa.list_(pa.string())
_REFERENCES = pa.struct([("r", _STRINGS), ("s", pa.string()), ("m", pa.string())])


@dataclass
class Listing:
    """One dataset listed: a :data:`LISTED` row per image, in path order, and what the listing found."""

    ds: DatasetConfig
    key: str
    table: pa.Table = field(default_factory=LISTED.empty_table)
    problems: list[str] = field(default_factory=list)
    prefixed: bool = False
    """Relative paths start with ``key/`` (see :func:`list_dataset`)."""

    def root(self) -> tuple[str, int]:
        """What the images' URIs start with, and how many leading characters of a ``rel_path`` they leave out."""
        return storage.join(self.ds.images_dir, "x")[:-1], len(self.key) + 1 if self.prefixed else 0

    def uris(self, rel_path) -> pa.ChunkedArray:
        """The images' URIs from their ``rel_path`` values: the dataset's root, then the path under it."""
        root, skip = self.root()
        return pc.binary_join_element_wise(root, pc.utf8_slice_codeunits(rel_path, skip) if skip else rel_path, "")

    def with_uris(self, table: pa.Table) -> pa.Table:
        """``table`` (with ``rel_path``) and a ``uri`` column: for the few steps that open the image itself."""
        return table.append_column("uri", self.uris(table["rel_path"]))


def stamps(table: pa.Table) -> pa.ChunkedArray:
    """``size:mtime`` per file: the cheap change detector of caption files and references."""
    return pc.binary_join_element_wise(
        pc.cast(table["size"], pa.string()), pc.cast(table["mtime_ns"], pa.string()), ":"
    )


def per_row(values: pa.ChunkedArray, fn: Callable, type_: pa.DataType) -> pa.ChunkedArray:
    """``fn`` of each value, through Python a bounded chunk at a time."""
    parts = [
        pa.array([fn(v) for v in values.slice(i, _CHUNK).to_pylist()], type_) for i in range(0, len(values), _CHUNK)
    ]
    return pa.chunked_array(parts, type_)


def _repeat(value: str, n: int) -> pa.Array:
    return pa.repeat(pa.scalar(value, pa.string()), n)


def _lists(n: int, items: list[str]) -> pa.Array:
    """``n`` copies of the same short list of strings (empty or one item), built without a Python list per row."""
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * len(items))
    values = pa.repeat(pa.scalar(items[0] if items else "", pa.string()), n * len(items))
    return pa.ListArray.from_arrays(offsets, values)


def _check_case(paths: pa.ChunkedArray, base: str, ds: DatasetConfig) -> None:
    """Two files that differ only by case are refused: case-insensitive sidecar matching could not tell their captions
    apart, and copied to a case-insensitive disk they would overwrite each other."""
    # Found by sorting, not hashing: a hash table of every path (value_counts, count_distinct) costs about three
    # times the paths' own bytes; sorted, equal paths are neighbours. The sorted paths are compared a part at a
    # time, so besides the lower-cased paths only their order (8 bytes a path) is held.
    # The paths under the root, lower-cased a part at a time: the root's own characters are the same in every path.
    lower = pa.chunked_array(
        [pc.utf8_lower(pc.utf8_slice_codeunits(paths.slice(i, PART), len(base))) for i in range(0, len(paths), PART)],
        pa.string(),
    )
    order = pc.sort_indices(lower)
    twice = []
    for i in range(0, max(len(order) - 1, 0), PART):
        ordered = pc.take(lower, order.slice(i, PART + 1))
        n = len(ordered)
        same = pc.equal(ordered.slice(1), ordered.slice(0, n - 1))
        if pc.any(same).as_py():
            twice.append(pc.unique(ordered.slice(1).filter(same)))
    del order
    if not twice:
        return
    twice = pa.concat_arrays([t.combine_chunks() if isinstance(t, pa.ChunkedArray) else t for t in twice])
    first: dict[str, str] = {}
    for path in paths.filter(pc.is_in(lower, value_set=twice)).to_pylist():  # in path order
        other = first.setdefault(path.lower(), path)
        if other != path:
            names = f"{other[len(base) :]} and {path[len(base) :]}"
            raise captions.CaptionError(f"dataset {datasets.label(ds)}: {names} differ only by case; rename one")


def _pairing(ds: DatasetConfig, metadata, table: pa.Table, base: str) -> edit_pairs.Pairing:
    """The dataset's edit pairing: ``reference_dir`` listed once (concurrently, like ``images_dir``)."""
    if not (ds.reference_dir or ds.reference_column):
        return edit_pairs.Pairing(ds)
    refs: dict[str, str] = {}
    if ds.reference_dir:
        fs, root = storage.resolve(ds.reference_dir)
        if fs.get_file_info(root).type != pafs.FileType.Directory:
            name = datasets.label(ds)
            raise FileNotFoundError(f"reference_dir {ds.reference_dir!r} is not a directory (dataset {name})")
        listed = files(fs, root)
        prefix = root.rstrip("/") + "/"
        for path, stamp in zip(listed["path"].to_pylist(), stamps(listed).to_pylist()):
            rel_ref = path[len(prefix) :]
            if not _hidden(rel_ref) and rel_ref.lower().endswith(IMAGE_EXTENSIONS):
                refs[rel_ref] = stamp
    named = metadata.references if metadata else {}
    inside = table.filter(pc.starts_with(table["path"], base))
    own = {p[len(base) :]: st for p, st in zip(inside["path"].to_pylist(), stamps(inside).to_pylist())}
    return edit_pairs.pairing(ds, refs, named, own)


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def _image_mask(rel: pa.ChunkedArray, name: pa.ChunkedArray, excluded: pa.Array) -> pa.ChunkedArray:
    """Images: not hidden (no path part starting with a dot), an image extension in any case, not a reference."""
    ext = "|".join(re.escape(e) for e in IMAGE_EXTENSIONS)
    mask = pc.and_(
        pc.invert(pc.match_substring_regex(rel, r"(^|/)\.")), pc.match_substring_regex(pc.utf8_lower(name), f"({ext})$")
    )
    if len(excluded):
        mask = pc.and_(mask, pc.invert(pc.is_in(rel, value_set=excluded)))
    return mask


LONE = pa.schema([("path", pa.string()), ("stamp", pa.string()), ("lower", pa.string())])
"""A caption file no image of its own part of the listing named (see :func:`list_dataset`): its path as listed,
its ``size:mtime`` and its path lower-cased, the key images are matched by."""


def list_dataset(ds: DatasetConfig, key: str = "", prefix: bool = False) -> Listing:
    """List every image under ``ds.images_dir`` (recursively, sorted) with what its caption will come from.

    Only listings (and a metadata table) are read here: caption files are read by :func:`rayflux.discovery.settling.settle`,
    which the cache stage runs inside its preparation tasks. Raises FileNotFoundError or CaptionError when the
    dataset as a whole is unusable.

    The listed files become :data:`LISTED` rows a bounded part at a time (:func:`_part_rows`), each part released
    once it is converted, so the short-lived columns (paths lower-cased, file names, regex results) never span
    the whole dataset and the listing's peak is the listed files plus the rows made of them. An image and its
    caption file almost always fall in the same part; a caption file that matched nothing in its own part is
    matched against the other parts' captionless images at the end (:func:`_adopt`), and is an orphan only then.
    """
    fs, root = storage.resolve(ds.images_dir)
    if fs.get_file_info(root).type != pafs.FileType.Directory:
        raise FileNotFoundError(f"images_dir {ds.images_dir!r} is not a directory (dataset {datasets.label(ds)})")
    listed = files(fs, root)
    trim()
    base = root.rstrip("/") + "/"
    _check_case(listed["path"], base, ds)
    trim()
    metadata = None
    if ds.caption_strategy == "metadata":
        # The table's rows are checked against every listed file: a set of paths while it is read (a metadata
        # dataset's captions are a Python dict per image anyway, see captions.MetadataIndex).
        metadata = captions.load_metadata(fs, root, set(listed["path"].to_pylist()), ds)
    label = datasets.label(ds)
    out = Listing(
        ds, key, problems=[f"dataset {label}: {p}" for p in (metadata.problems if metadata else [])], prefixed=prefix
    )
    pairs = _pairing(ds, metadata, listed, base)
    masks = _masks(ds, out.problems, listed, base)
    # Files a metadata table names as references or masks inside images_dir are never training images themselves.
    mask_only = _named_masks(metadata, listed, base) if metadata and metadata.masks and not ds.mask_dir else set()
    excluded = pa.array(sorted(pairs.reference_only() | mask_only), pa.string())
    # Slices of the listing's own chunks (one per subfolder): popping them one by one frees each subfolder's
    # columns as soon as its rows are made.
    todo = [listed.slice(i, PART) for i in range(0, listed.num_rows, PART)]
    del listed
    parts, lone = [], [LONE.empty_table()]
    while todo:
        rows, caps = _part_rows(
            todo.pop(0), base, ds, key, prefix, excluded, metadata=metadata, pairs=pairs, masks=masks
        )
        parts.append(rows)
        lone.append(caps)
        trim()
    orphans = _adopt(parts, pa.concat_tables(lone), base, ds, key, prefix)
    out.table = pa.concat_tables(parts) if parts else LISTED.empty_table()
    del parts
    trim()
    out.problems += [f"dataset {label}: caption file without an image: {p[len(base) :]}" for p in orphans]
    if not out.table.num_rows:
        out.problems.append(f"dataset {label}: no images ({', '.join(IMAGE_EXTENSIONS)}) under {ds.images_dir}")
    return out


def _part_rows(
    part: pa.Table,
    base: str,
    ds: DatasetConfig,
    key: str,
    prefix: bool,
    excluded: pa.Array,
    *,
    metadata,
    pairs: edit_pairs.Pairing,
    masks: pa.Table | None = None,
) -> tuple[pa.Table, pa.Table]:
    """One part of the sorted listing (:data:`rayflux.discovery.walk.FILES` rows) as :data:`LISTED` rows, and its caption
    files that no image of the part named (:data:`LONE` rows)."""
    paths = part["path"]
    rel = pc.if_else(pc.starts_with(paths, base), pc.utf8_slice_codeunits(paths, len(base)), paths)
    name = pc.replace_substring_regex(rel, r"^.*/", "")
    mask = _image_mask(rel, name, excluded)
    images, rel, name = part.filter(mask), rel.filter(mask), name.filter(mask)
    del mask
    n = images.num_rows
    cols = {
        "rel_path": pc.binary_join_element_wise(f"{key}/", rel, "") if prefix else rel,
        "size": images["size"],
        "mtime_ns": images["mtime_ns"],
        "dataset": _repeat(key, n),
        "sidecar": _repeat("", n),
        "sidecar_stamp": _repeat("", n),
        "sidecar_lines": pa.nulls(n, pa.string()),
    }
    lone = LONE.empty_table()
    if ds.caption_strategy == "sidecar":
        lone = _match_sidecars(part, paths, images, ds, cols)
    if ds.caption_strategy == "metadata":
        cols["options"] = per_row(rel, lambda r: list(metadata.captions.get(r, [])), _STRINGS)
    elif ds.caption_strategy == "filename":
        cols["options"] = per_row(name, lambda f: [captions.from_filename(f)], _STRINGS)
    else:
        cols["options"] = _lists(n, [] if ds.caption_strategy in ("sidecar", "vlm") else [ds.instance_prompt])
    # Edit pairs: the references travel with the row; a missing one makes the row a recorded skip when settled.
    if pairs.active:
        found = per_row(rel, lambda r: dict(zip(("r", "s", "m"), pairs.references(r))), _REFERENCES).combine_chunks()
        cols.update(references=found.field("r"), references_stamp=found.field("s"), missing_reference=found.field("m"))
    else:
        cols.update(references=_lists(n, []), references_stamp=_repeat("", n), missing_reference=_repeat("", n))
    cols.update(_mask_columns(rel, n, ds, metadata, masks))
    return pa.table(cols, schema=LISTED), lone


def _match_sidecars(part: pa.Table, paths, images: pa.Table, ds: DatasetConfig, cols: dict) -> pa.Table:
    """Each image's caption file into ``cols`` (``sidecar``, ``sidecar_stamp``); the part's caption files that no image
    named (:data:`LONE` rows). Matched among the part's caption files only: an image's stem + ext can only name one
    of them. An image's stem is lower-cased: IMG_0001.PNG takes IMG_0001.TXT (caption extensions match in any case
    too)."""
    ext = ds.caption_ext.lower()
    lower = pc.utf8_lower(paths)
    is_caption = pc.ends_with(lower, ext)
    caps, cap_lower = part.filter(is_caption), lower.filter(is_caption)
    del lower, is_caption
    wanted = _caption_keys(images["path"], ext)
    at = pc.index_in(wanted, value_set=cap_lower)
    cols["sidecar"] = pc.fill_null(pc.take(caps["path"], at), "")
    cols["sidecar_stamp"] = pc.fill_null(pc.take(stamps(caps), at), "")
    named = pc.is_in(cap_lower, value_set=wanted)
    return pa.table([caps["path"], stamps(caps), cap_lower], schema=LONE).filter(pc.invert(named))


def _mask_columns(rel, n: int, ds: DatasetConfig, metadata, masks: pa.Table | None) -> dict:
    """``mask_uri`` and ``mask_stamp`` of each image: mask=dir matches as caption files are, by the path without
    its extension, in any case; mask=column by the path the metadata names (in any case); no masks: empty."""
    if masks is None:
        return {"mask_uri": _repeat("", n), "mask_stamp": _repeat("", n)}
    wanted = _stems(rel) if ds.mask == "dir" else per_row(rel, lambda r: metadata.masks.get(r, "").lower(), pa.string())
    at = pc.index_in(wanted, value_set=masks["key"])
    return {
        "mask_uri": pc.fill_null(pc.take(masks["uri"], at), ""),
        "mask_stamp": pc.fill_null(pc.take(masks["stamp"], at), ""),
    }


MASKS = pa.schema([("key", pa.string()), ("uri", pa.string()), ("stamp", pa.string())])
"""A candidate mask file: the key images find it by (``mask=dir``: its path under ``mask_dir`` without the
extension; ``mask=column``: its path; both lower-cased), its URI and its ``size:mtime``."""


def _named_masks(metadata, listed: pa.Table, base: str) -> set[str]:
    """The dataset's own files a metadata table names as masks, as listed (the table may name them in another case,
    as masks are matched)."""
    rel = pc.utf8_slice_codeunits(listed["path"], len(base))
    named = pa.array(sorted({m.lower() for m in metadata.masks.values()}), pa.string())
    return set(rel.filter(pc.is_in(pc.utf8_lower(rel), value_set=named)).to_pylist())


def _stems(rel) -> pa.ChunkedArray:
    """Relative paths without their extension, lower-cased: the key an image and its mask share."""
    return pc.utf8_lower(pc.replace_substring_regex(rel, r"\.[^./]*$", ""))


def _masks(ds: DatasetConfig, problems: list[str], dataset_files: pa.Table, base: str) -> pa.Table | None:
    """The candidate mask files as :data:`MASKS` rows (None without ``data.mask=dir`` or ``column``): ``mask_dir``
    listed once, or for ``mask=column`` without ``mask_dir`` the dataset's own files (``dataset_files``, the
    :func:`rayflux.discovery.walk.files` rows under ``base``). Matching them to images is Arrow compute over whole columns, with
    no request and no Python object per image. ``mask=dir`` keys a mask by its path without the extension: two masks
    for one image (``a.png`` and ``a.jpg``) are a problem, and the first in path order is used."""
    if ds.mask not in ("dir", "column"):
        return None
    if ds.mask_dir:
        fs, root = storage.resolve(ds.mask_dir)
        if fs.get_file_info(root).type != pafs.FileType.Directory:
            raise FileNotFoundError(f"mask_dir {ds.mask_dir!r} is not a directory (dataset {datasets.label(ds)})")
        listed, base, where = files(fs, root), root.rstrip("/") + "/", ds.mask_dir
    else:
        listed, where = dataset_files, ds.images_dir
    rel = pc.utf8_slice_codeunits(listed["path"], len(base))
    keep = _image_mask(rel, pc.replace_substring_regex(rel, r"^.*/", ""), pa.array([], pa.string()))
    listed, rel = listed.filter(keep), rel.filter(keep)
    uri = pc.binary_join_element_wise(storage.join(where, "x")[:-1], rel, "")
    table = pa.table([_stems(rel) if ds.mask == "dir" else pc.utf8_lower(rel), uri, stamps(listed)], schema=MASKS)
    if pc.count_distinct(table["key"]).as_py() < table.num_rows:
        counts = pc.value_counts(table["key"].combine_chunks())
        twice = counts.filter(pc.greater(counts.field("counts"), 1)).field("values")
        problems.append(
            f"dataset {datasets.label(ds)}: {len(twice)} images have several masks (e.g. "
            f"{twice[0].as_py()}.*); the first in path order is used"
        )
    return table


def _caption_keys(image_paths, ext: str) -> pa.ChunkedArray:
    """The lower-cased path each image's caption file would have: its path without the extension, plus ``ext``."""
    return pc.binary_join_element_wise(pc.utf8_lower(pc.replace_substring_regex(image_paths, r"\.[^.]*$", "")), ext, "")


def _adopt(parts: list[pa.Table], lone: pa.Table, base: str, ds: DatasetConfig, key: str, prefix: bool) -> list[str]:
    """Give the caption files that matched nothing in their own part (``lone``) to the captionless images of the
    other parts that name them (in place, in ``parts``); return the paths of those that no image names: orphans.

    Parts are cut at fixed row counts, so an image and its caption file can land in neighbouring parts, and a
    caption file whose case differs from its image's sorts away from it. Both are rare, and only the captionless
    rows of each part are looked at."""
    if not lone.num_rows:
        return []
    keys = lone["lower"].combine_chunks()
    used = []
    ext = ds.caption_ext.lower()
    skip = len(key) + 1 if prefix else 0
    for i, rows in enumerate(parts):
        missing = pc.equal(rows["sidecar"], "")
        if not pc.any(missing).as_py():
            continue
        full = pc.binary_join_element_wise(base, pc.utf8_slice_codeunits(rows["rel_path"], skip), "")
        at = pc.index_in(pc.if_else(missing, _caption_keys(full, ext), pa.scalar(None, pa.string())), value_set=keys)
        del full
        if not pc.any(pc.is_valid(at)).as_py():
            continue
        used.append(at.filter(pc.is_valid(at)))
        sidecar = pc.fill_null(pc.take(lone["path"], at), "")
        stamp = pc.fill_null(pc.take(lone["stamp"], at), "")
        rows = rows.set_column(
            rows.schema.get_field_index("sidecar"), "sidecar", pc.if_else(pc.is_valid(at), sidecar, rows["sidecar"])
        )
        parts[i] = rows.set_column(
            rows.schema.get_field_index("sidecar_stamp"),
            "sidecar_stamp",
            pc.if_else(pc.is_valid(at), stamp, rows["sidecar_stamp"]),
        )
    named = pa.chunked_array(used, pa.int32()) if used else pa.chunked_array([], pa.int32())
    kept = pc.invert(pc.is_in(pa.array(range(lone.num_rows), pa.int32()), value_set=named.combine_chunks()))
    return lone["path"].filter(kept).to_pylist()
