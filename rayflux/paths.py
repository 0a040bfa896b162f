"""Path safety: the cache and output directories must never overlap the image directory.

SimpleTuner once allowed an image directory equal to its cache directory; a cache clear then deleted training
data. rayflux refuses such a configuration before any Ray work starts.
"""

from __future__ import annotations

from rayflux import storage


class PathOverlapError(ValueError):
    """Two directories that must be disjoint overlap."""


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip("/") + "/")


def check_disjoint(images_dir: str, **others: str) -> None:
    """Raise PathOverlapError if any of ``others`` equals, lies inside, or contains ``images_dir``.

    Paths are compared after resolving symlinks, ``..`` and trailing slashes; URIs compare by scheme, bucket and key.
    """
    img = storage.canonical(images_dir)
    for label, other in others.items():
        if not other:
            continue
        o = storage.canonical(other)
        if o == img:
            how = "is the same directory as"
        elif _inside(o, img):
            how = "lies inside"
        elif _inside(img, o):
            how = "contains"
        else:
            continue
        raise PathOverlapError(
            f"{label} {other!r} {how} data.images_dir {images_dir!r} (resolved: {o} vs {img}); "
            "choose a separate directory so that cache or run files can never touch training images"
        )
