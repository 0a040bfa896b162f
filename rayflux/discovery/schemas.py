"""The Arrow schemas discovery hands on: caption files as read, skipped inputs, settled rows, and the sources a
generation caches (with :class:`Source`, one of them as an object, for small uses)."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

SIDECARS = pa.schema([("path", pa.string()), ("stamp", pa.string()), ("lines", pa.string())])
"""A caption file as discovery read it: its path on the dataset's filesystem, its ``size:mtime`` from the listing
and its non-empty lines (a JSON list), before any caption policy: the same lines serve every seed and setting."""


@dataclass(frozen=True)
class Source:
    """One discovered image and the caption chosen for it in this generation."""

    uri: str
    """Full path or URI of the image."""
    rel_path: str
    """Path under the dataset root, prefixed by the dataset's name when the job lists several datasets; part of the
    cache key, so same-named files in different folders or datasets differ."""
    size: int
    """File size in bytes (with mtime, a cheap change detector for incremental caching)."""
    mtime_ns: int
    caption: str
    dataset: str = ""
    """The shards' ``dataset`` column: the dataset's name, or "" for ``data.images_dir``."""
    references: tuple[str, ...] = ()
    """Edit pairs: the URIs of the image's reference images, in order (see :mod:`rayflux.discovery.edit_pairs`)."""
    references_stamp: str = ""
    """The references' ``size:mtime``, comma-joined: a changed reference changes the generation's inputs signature."""
    mask_uri: str = ""
    """With ``data.mask=dir`` or ``column``: the URI of the image's mask file ("" when it has none and
    ``missing_mask=ones``)."""
    mask_stamp: str = ""
    """The mask file's ``size:mtime``: a changed mask changes the generation's inputs signature."""


SKIPS = pa.schema([("source_uri", pa.string()), ("dataset", pa.string()), ("reason", pa.string())])
"""A skipped input: its URI, its dataset's key and why it is not used."""


SETTLED = pa.schema(
    [
        ("rel_path", pa.string()),
        ("size", pa.int64()),
        ("mtime_ns", pa.int64()),
        ("dataset", pa.string()),
        ("caption", pa.string()),
        ("skip_reason", pa.string()),
        ("uncaptioned", pa.bool_()),
        ("references", pa.list_(pa.string())),
        ("references_stamp", pa.string()),
        ("sidecar", pa.string()),
        ("mask_uri", pa.string()),
        ("mask_stamp", pa.string()),
        ("sidecar_stamp", pa.string()),
        ("sidecar_lines", pa.string()),
    ]
)
"""A listed image once settled (:func:`settle`): its caption or ``skip_reason``, whether it had no caption of its
own, and its caption file's lines when they were read or known. Like a listed row it has no URI column: the
:class:`Discovery` tables get theirs from the relative path (:meth:`rayflux.discovery.listing.Listing.uris`)."""


SOURCES = pa.schema(
    [
        ("rel_path", pa.string()),
        ("size", pa.int64()),
        ("mtime_ns", pa.int64()),
        ("caption", pa.string()),
        ("dataset", pa.string()),
        ("references", pa.list_(pa.string())),
        ("references_stamp", pa.string()),
        ("mask_uri", pa.string()),
        ("mask_stamp", pa.string()),
    ]
)
"""The :class:`Source` fields as Arrow columns but the URI: how a discovery holds its images (bytes per image on the
driver, not a Python object each), in relative-path order per dataset. A URI is the dataset's root and the relative
path, so it is made where it is needed (:func:`uris`), not held for every image."""


GATHERED = [n for n in SETTLED.names if not n.startswith("sidecar")]
"""The columns of settled rows that :func:`gather` reads: all but the caption file's, which go to a :class:`Spool`."""
