"""Path safety: the cache and output directories must never overlap the image directory.

SimpleTuner once allowed an image directory equal to its cache directory; a cache clear then deleted training
data. rayflux refuses such a configuration before any Ray work starts.

Paths are compared in :func:`rayflux.storage.canonical` form (the same one cache identities use).
"""

from __future__ import annotations

from rayflux import storage


class PathOverlapError(ValueError):
    """Two directories that must be disjoint overlap."""


def _inside(child: str, parent: str) -> bool:
    """True when ``child`` is ``parent`` or below it; "s3://b/data" does not contain "s3://b/database"."""
    return child == parent or child.startswith(parent.rstrip("/") + "/")


def overlap(a: str, b: str) -> str:
    """How canonical path ``a`` relates to canonical path ``b``: ``same``, ``inside``, ``contains`` or ``""``."""
    if a == b:
        return "same"
    if _inside(a, b):
        return "inside"
    if _inside(b, a):
        return "contains"
    return ""


HOW = {"same": "is the same directory as", "inside": "lies inside", "contains": "contains"}


def check_disjoint(images_dir: str, images_key: str = "data.images_dir", **others: str) -> None:
    """Raise PathOverlapError if any of ``others`` equals, lies inside, or contains ``images_dir``.

    ``others`` maps a config key (``cache.dir``) to its path, and ``images_key`` is the key ``images_dir`` came from.
    Empty paths are ignored. The message names both keys and both paths, as given and as resolved.
    """
    img = storage.canonical(images_dir)
    for label, other in others.items():
        if not other:
            continue
        resolved = storage.canonical(other)
        how = overlap(resolved, img)
        if how:
            raise PathOverlapError(
                f"{label} {other!r} {HOW[how]} {images_key} {images_dir!r} (resolved: {resolved} vs {img}); "
                "choose a separate directory so that cache or run files can never touch training images"
            )
