"""Discovery in this process, dataset by dataset: for tools, tests and small uses. The job's cache stage settles in
Ray tasks instead (:mod:`rayflux.cache.discover`)."""

from __future__ import annotations

from collections.abc import Callable

from rayflux import datasets
from rayflux.config import DataConfig, DatasetConfig
from rayflux.discovery.discoveries import Discovery, gather
from rayflux.discovery.listing import list_dataset
from rayflux.discovery.settling import settle_table


def discover_dataset(
    ds: DatasetConfig, seed: int = 0, key: str = "", prefix: bool = False, usable: Callable[[dict], str] | None = None
) -> Discovery:
    """List and settle one dataset in this process (see :func:`list_dataset` and :func:`settle`).

    ``key`` is the dataset's value of the ``dataset`` column; with ``prefix``, relative paths start with ``key/``.
    Raises FileNotFoundError or CaptionError when the dataset as a whole is unusable.
    """
    listing = list_dataset(ds, key, prefix)
    listed = listing.with_uris(listing.table) if usable else listing.table  # usable() opens the image
    settled = settle_table(listed, ds, seed, usable)
    found = gather(listing, settled)
    found.sidecars.add(settled)
    return found


def discover(data: DataConfig, *, seed: int = 0) -> Discovery:
    """Discover every dataset of the job (``data.images_dir``, or each of ``data.datasets``), in config order, in
    this process. The job's cache stage settles in its preparation tasks instead (:mod:`rayflux.cache.discover`)."""
    found = Discovery()
    prefix = datasets.prefixes_paths(data)
    for ds in datasets.datasets_of(data):
        found.extend(discover_dataset(ds, seed, key=datasets.key(data, ds), prefix=prefix))
    return found
