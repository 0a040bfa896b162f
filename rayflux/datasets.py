"""The job's datasets: ``data.images_dir`` or the ``data.datasets`` list, resolved into checked DatasetConfigs.

A listed dataset starts from the ``data.*`` values and overrides what its mapping sets, so that shared settings are
written once. Errors name the key the user actually wrote: ``data.datasets[1].crop`` when the mapping set it,
``data.crop`` when the value came from the shared default.
"""

from __future__ import annotations

import dataclasses
import re

from rayflux.config import TRAINING_ONLY_KEYS, ConfigError, DataConfig, DatasetConfig, _coerce

_DATASET_FIELDS = {f.name: f for f in dataclasses.fields(DatasetConfig)}
_CHOICES = {
    "caption_strategy": ("sidecar", "filename", "metadata", "instance"),
    "missing_caption": ("skip", "empty", "filename", "instance"),
    "resolution_type": ("area", "shorter_edge"),
    "crop": ("center", "random"),
}
_POSITIVE = ("resolution", "min_image_size", "repeats", "bucket_step")
MIN_RESOLUTION = 16
"""Smaller ``data.resolution`` values are refused: less than one bucket step, they are another tool's units
(SimpleTuner's megapixels), not a target size."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _default_name(images_dir: str) -> str:
    last = images_dir.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"[^A-Za-z0-9._-]", "_", last).lstrip("._-") or "images"


def _check(ds: DatasetConfig, label) -> None:
    """Range and choice checks of one dataset; ``label(key)`` is the config key to blame."""
    for key, choices in _CHOICES.items():
        if getattr(ds, key) not in choices:
            raise ConfigError(f"{label(key)} must be one of {', '.join(choices)}; got {getattr(ds, key)!r}")
    for key in _POSITIVE:
        if getattr(ds, key) <= 0:
            raise ConfigError(f"{label(key)} must be positive, got {getattr(ds, key)}")
    if 0 < ds.resolution < MIN_RESOLUTION:
        raise ConfigError(_resolution_hint(ds, label("resolution")))
    if ds.max_samples < 0:
        raise ConfigError(f"{label('max_samples')} must be >= 0 (0: all images), got {ds.max_samples}")
    if ds.max_aspect < 1:
        raise ConfigError(f"{label('max_aspect')} must be >= 1, got {ds.max_aspect}")
    needs_prompt = ds.caption_strategy == "instance" or ds.missing_caption == "instance" or ds.prepend_instance_prompt
    if needs_prompt and not ds.instance_prompt:
        raise ConfigError(
            f"{label('instance_prompt')} is empty, but caption_strategy=instance, missing_caption=instance or "
            "prepend_instance_prompt needs it"
        )
    if ds.reference_column and ds.caption_strategy != "metadata":
        raise ConfigError(
            f"{label('reference_column')} names a metadata column, so it needs caption_strategy=metadata (got "
            f"{ds.caption_strategy}); for a folder of references with the images' own names use reference_dir"
        )
    if ds.name and not _NAME.match(ds.name):
        raise ConfigError(f"{label('name')} {ds.name!r} may only hold letters, digits, '.', '_' and '-'")


def _resolution_hint(ds: DatasetConfig, key: str) -> str:
    """What a too-small resolution probably meant: SimpleTuner's ``area`` counts megapixels (1.0 = 1024²)."""
    said = f"{key}={ds.resolution} with resolution_type={ds.resolution_type} means {ds.resolution} px"
    if ds.resolution_type == "area":
        meant = round((ds.resolution * 1e6) ** 0.5 / 64) * 64
        return (f"{said}; SimpleTuner's resolution_type=area counts megapixels: for {ds.resolution} MP write "
                f"resolution: {meant} (about {meant}x{meant} pixels) with resolution_type: area")  # fmt: skip
    return f"{said}; the shorter edge is in pixels (at least {MIN_RESOLUTION}), e.g. resolution: 512"


def images_key(data: DataConfig, index: int) -> str:
    """The config key that set the ``images_dir`` of dataset ``index`` of :func:`datasets_of`, for messages."""
    return f"data.datasets[{index}].images_dir" if data.datasets else "data.images_dir"


def datasets_of(data: DataConfig) -> list[DatasetConfig]:
    """The job's datasets, each complete and checked. Raises ConfigError naming the offending key."""
    shared = {name: getattr(data, name) for name in _DATASET_FIELDS}
    if not isinstance(data.datasets, list):
        example = "[{images_dir: /data/a}, {images_dir: /data/b}]"
        raise ConfigError(f"data.datasets must be a YAML list of mappings, e.g. {example}; got {data.datasets!r}")
    if not data.datasets:
        ds = DatasetConfig(**shared)
        _check(ds, lambda key: f"data.{key}")
        return [ds]
    if data.images_dir:
        raise ConfigError(
            "data.images_dir and data.datasets are exclusive: list that folder as one more entry of data.datasets"
        )
    out: list[DatasetConfig] = []
    for i, entry in enumerate(data.datasets):
        where = f"data.datasets[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be a mapping of dataset keys, got {entry!r}")
        values = dict(shared)
        for key, raw in entry.items():
            if key not in _DATASET_FIELDS:
                known = ", ".join(sorted(_DATASET_FIELDS))
                raise ConfigError(f"unknown dataset key {where}.{key}; known keys: {known}")
            values[key] = _coerce(f"{where}.{key}", raw, shared[key], _DATASET_FIELDS[key].type)
        if not values["images_dir"]:
            raise ConfigError(f"{where}.images_dir is required")
        values["name"] = values["name"] if "name" in entry else _default_name(values["images_dir"])
        ds = DatasetConfig(**values)
        _check(ds, lambda key, entry=entry, where=where: f"{where}.{key}" if key in entry else f"data.{key}")
        out.append(ds)
    names = [d.name for d in out]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(
                f"data.datasets: the name {name!r} is used {names.count(name)} times; give each dataset its own name"
            )
    return out


def prefixes_paths(data: DataConfig) -> bool:
    """Listed datasets prefix their samples' relative paths with their name, so equal file names in two datasets
    never share a cache key. The single ``data.images_dir`` dataset keeps bare paths (and the sample ids it had
    before datasets could be listed)."""
    return bool(data.datasets)


def label(ds: DatasetConfig) -> str:
    """How a dataset is named in summaries and reports."""
    if ds.name:
        return ds.name
    return _default_name(ds.images_dir) if ds.images_dir else "demo"


def key(data: DataConfig, ds: DatasetConfig) -> str:
    """The value of the shards' ``dataset`` column for this dataset's samples ("" for ``data.images_dir``)."""
    return ds.name if prefixes_paths(data) else ""


def cache_identity(ds: DatasetConfig, canonical_images_dir: str) -> dict:
    """The parts of a dataset that decide what its cache holds: everything except how often samples are used."""
    d = dataclasses.asdict(ds)
    for key in TRAINING_ONLY_KEYS:
        d.pop(key)
    d["images_dir"] = canonical_images_dir
    return d


def sample_weights(data: DataConfig) -> dict[str, tuple[int, float]]:
    """Dataset name (as stored in the shards' ``dataset`` column) -> (repeats, loss weight)."""
    return {key(data, ds): (ds.repeats, data.reg_loss_weight if ds.regularisation else 1.0) for ds in datasets_of(data)}


def mix(refs: list, weights: dict[str, tuple[int, float]]) -> list:
    """Repeat each sample reference ``repeats`` times and attach its dataset's loss weight.

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
        out.extend([dataclasses.replace(r, weight=weight)] * repeats)
    return out
