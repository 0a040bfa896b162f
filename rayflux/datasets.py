"""The job's datasets as the stages see them: names, cache keys, sample weights and the epoch's mix.

Resolving ``data.images_dir`` or the ``data.datasets`` list into checked DatasetConfigs is the data section's own
work (:func:`rayflux.config.data.datasets_of`, also reachable here as ``datasets.datasets_of``).
"""

from __future__ import annotations

import dataclasses

from rayflux.config import identity
from rayflux.config.data import MASK_KEYS, DataConfig, DatasetConfig, datasets_of, default_name


def images_key(data: DataConfig, index: int) -> str:
    """The config key that set the ``images_dir`` of dataset ``index`` of :func:`datasets_of`, for messages."""
    return f"data.datasets[{index}].images_dir" if data.datasets else "data.images_dir"


def prefixes_paths(data: DataConfig) -> bool:
    """Listed datasets prefix their samples' relative paths with their name, so equal file names in two datasets
    never share a cache key. The single ``data.images_dir`` dataset keeps bare paths (and the sample ids it had
    before datasets could be listed)."""
    return bool(data.datasets)


def label(ds: DatasetConfig) -> str:
    """How a dataset is named in summaries and reports."""
    if ds.name:
        return ds.name
    return default_name(ds.images_dir) if ds.images_dir else "demo"


def key(data: DataConfig, ds: DatasetConfig) -> str:
    """The value of the shards' ``dataset`` column for this dataset's samples ("" for ``data.images_dir``)."""
    return ds.name if prefixes_paths(data) else ""


def cache_identity(ds: DatasetConfig, canonical_images_dir: str) -> dict:
    """The parts of a dataset that decide what its cache holds: the fields that declare so
    (:data:`rayflux.config.identity.CACHED`), its folders in their one canonical form; without masks, none of the
    mask keys (:data:`~rayflux.config.data.MASK_KEYS`)."""
    from rayflux.storage import canonical

    d = identity.values(ds, "cache")
    if ds.mask == "none":
        d = {k: v for k, v in d.items() if k not in MASK_KEYS}
    elif ds.mask_dir:
        d["mask_dir"] = canonical(ds.mask_dir)
    return {**d, "images_dir": canonical_images_dir}


def sample_weights(data: DataConfig) -> dict[str, tuple[int, float]]:
    """Dataset name (as stored in the shards' ``dataset`` column) -> (repeats, loss weight)."""
    return {key(data, ds): (ds.repeats, data.reg_loss_weight if ds.regularisation else 1.0) for ds in datasets_of(data)}


def mask_floors(data: DataConfig) -> dict[str, float]:
    """Dataset name -> ``data.mask_floor``: the loss weight its masks' black area keeps."""
    return {key(data, ds): ds.mask_floor for ds in datasets_of(data)}


def mix(refs: list, weights: dict[str, tuple[int, float]], floors: dict[str, float] | None = None) -> list:
    """Repeat each sample reference ``repeats`` times and attach its dataset's loss weight (and its mask floor,
    ``floors``: :func:`mask_floors`).

    ``refs`` are frozen dataclasses with ``dataset`` and ``weight`` fields (the trainer's sample references). A
    repeated sample is the same reference several times, so it lands in several (shuffled) batches of an epoch.
    """
    out = []
    for r in refs:
        if r.dataset not in weights:
            raise ValueError(
                f"cached sample {r.sample_id} belongs to dataset {r.dataset!r}, which the config does not list"
            )
        repeats, weight = weights[r.dataset]
        floor = (floors or {}).get(r.dataset, 0.0)
        out.extend([dataclasses.replace(r, weight=weight, mask_floor=floor)] * repeats)
    return out
