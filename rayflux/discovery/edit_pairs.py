"""Edit pairs: which reference images belong to each training image.

An edit dataset pairs every target image (the edit's result; its caption is the instruction) with one or more
reference images, either by name (``reference_dir`` holds the same relative paths, any image extension) or through
a metadata column (``reference_column``). Discovery resolves them here, from one listing of ``reference_dir``, so no
per-image request reaches the storage; an image whose reference is missing is skipped with a reason that names the
file it looked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rayflux import storage
from rayflux.config import DatasetConfig


def _stem(rel: str) -> str:
    dot, slash = rel.rfind("."), rel.rfind("/")
    return (rel[:dot] if dot > slash else rel).lower()


@dataclass
class Pairing:
    """How one dataset's images find their references."""

    ds: DatasetConfig
    reference_files: dict[str, str] = field(default_factory=dict)
    """Every image under ``reference_dir``, relative to it: lower-cased path -> path (and lower-cased stem -> path,
    so ``a.png`` finds ``a.jpg``)."""
    named: dict[str, list[str]] = field(default_factory=dict)
    """With ``reference_column``: image -> its references as the metadata table names them."""
    dataset_files: set[str] = field(default_factory=set)
    """Every file under ``images_dir``, relative to it (where references live without ``reference_dir``)."""
    stamps: dict[str, str] = field(default_factory=dict)
    """Relative path (under ``reference_dir``, else ``images_dir``) -> ``size:mtime`` of every candidate reference."""

    @property
    def active(self) -> bool:
        return bool(self.ds.reference_dir or self.ds.reference_column)

    def reference_only(self) -> set[str]:
        """Files the metadata names as references inside ``images_dir``: they are never training images themselves."""
        if self.ds.reference_dir:
            return set()
        return {r for refs in self.named.values() for r in refs}

    def references(self, rel: str) -> tuple[tuple[str, ...], str, str]:
        """``(reference URIs, their size:mtime stamps, "")`` for image ``rel`` (relative to ``images_dir``), or
        ``((), "", skip reason)``. The stamps go into the generation's inputs signature, so a changed reference
        rebuilds like a changed image."""
        ds = self.ds
        if ds.reference_column:
            wanted = self.named.get(rel, [])
            if not wanted:
                return (), "", f"no reference image: metadata column {ds.reference_column!r} names none for it"
        else:
            wanted = [rel]
        out, stamps = [], []
        for want in wanted:
            found = self._find(want, exact=bool(ds.reference_column))
            if not found:
                where = ds.reference_dir or ds.images_dir
                return (), "", f"no reference image: {storage.join(where, want)} does not exist"
            out.append(storage.join(ds.reference_dir or ds.images_dir, found))
            stamps.append(self.stamps.get(found, ""))
        return tuple(out), ",".join(stamps), ""

    def _find(self, want: str, exact: bool) -> str:
        if not self.ds.reference_dir:
            return want if want in self.dataset_files else ""
        hit = self.reference_files.get(want.lower(), "")
        # Matched by name, a reference may be stored in another image format than its target.
        return hit or ("" if exact else self.reference_files.get("stem:" + _stem(want), ""))


def pairing(ds: DatasetConfig, reference_files: dict[str, str], named: dict[str, list[str]], dataset_files: dict):
    """A dataset's :class:`Pairing` from the images listed under ``reference_dir`` and the dataset's own files (each
    relative path -> ``size:mtime``), and the metadata table's named references."""
    files: dict[str, str] = {}
    for rel in sorted(reference_files):
        files.setdefault(rel.lower(), rel)
        files.setdefault("stem:" + _stem(rel), rel)
    stamps = reference_files if ds.reference_dir else dataset_files
    return Pairing(ds, files, named, set(dataset_files), stamps)
