"""The ``data`` section: the training images, one dataset or a list of them, and how each resolves and is checked.

A listed dataset starts from the ``data.*`` values and overrides what its mapping sets, so that shared settings are
written once. Errors name the key the user actually wrote: ``data.datasets[1].crop`` when the mapping set it,
``data.crop`` when the value came from the shared default.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from rayflux.config.identity import CACHED, CAPTIONS, TRAINED, added
from rayflux.config.values import ConfigError, coerce


@dataclass
class DatasetConfig:
    """One folder of training images: how it is captioned, cropped, and mixed into each epoch."""

    name: str = field(default="", metadata=CACHED)
    """Short name (letters, digits, ``.``, ``_``, ``-``) shown in summaries. In ``data.datasets`` it also prefixes the
    dataset's sample paths in the cache, so it must be unique there. Empty: the last folder name of ``images_dir``."""
    images_dir: str = field(default="", metadata=CACHED)
    """Folder or URI (``s3://bucket/prefix``, or any pyarrow/fsspec filesystem) of training images. Empty: the
    generated demo images."""
    caption_strategy: str = field(default="sidecar", metadata=CAPTIONS)
    """Where captions come from: ``sidecar`` files, the ``filename``, a ``metadata`` table (``metadata.jsonl``,
    ``.csv`` or ``.parquet`` with ``file_name`` and ``text`` columns, as Hugging Face imagefolder), the fixed
    ``instance`` prompt, or ``vlm``: every image captioned by the ``caption`` section's model (docs/captions.md)."""
    caption_ext: str = field(default=".txt", metadata=CAPTIONS)
    """Sidecar caption extension. Several lines in one file are several captions; one is chosen per generation."""
    metadata_file: str = field(default="", metadata=CAPTIONS)
    """For ``caption_strategy=metadata``: the table's path relative to ``images_dir`` (or a URI). Empty: every
    ``metadata.jsonl``, ``metadata.csv`` or ``metadata.parquet`` in the tree, each naming files relative to its own
    folder."""
    caption_column: str = field(default="text", metadata=CAPTIONS)
    """Metadata column holding the caption: a string, or a list of strings (one chosen per generation)."""
    missing_caption: str = field(default="filename", metadata=CAPTIONS)
    """When an image has no caption: ``skip`` it, use an ``empty`` caption, its ``filename``, ``instance``, or ``vlm``:
    a caption from the ``caption`` section's model (docs/captions.md)."""
    instance_prompt: str = field(default="", metadata=CAPTIONS)
    """Fixed caption for ``caption_strategy=instance`` and ``missing_caption=instance``; the prefix for
    ``prepend_instance_prompt``."""
    prepend_instance_prompt: bool = field(default=False, metadata=CAPTIONS)
    """Put ``instance_prompt`` and a space in front of every caption (e.g. a trigger word)."""
    resolution: int = field(default=512, metadata=CACHED)
    """Target size in pixels: the shorter edge, or the square root of the area (see ``resolution_type``)."""
    resolution_type: str = field(default="area", metadata=CACHED)
    """``area`` keeps about resolution² pixels per image (SimpleTuner's ``pixel_area``, not its megapixel ``area``);
    ``shorter_edge`` fixes the shorter side."""
    bucket_step: int = field(default=64, metadata=CACHED)
    """Bucket sides are multiples of this many pixels (kohya's ``bucket_reso_steps``): fewer, fuller buckets than the
    model's 16. Rounded down to the model's alignment and capped at ``resolution / 8``."""
    alignment: int = field(default=0, metadata=CACHED)
    """Exact bucket granularity in pixels, overriding ``bucket_step``; a multiple of the model's own alignment, 2 x its
    VAE downscale (16 for FLUX). 0: use ``bucket_step``."""
    crop: str = field(default="center", metadata=CACHED)
    """How an image is cut to its bucket's aspect ratio: ``center`` or ``random`` (seeded per generation)."""
    max_aspect: float = field(default=2.5, metadata=CACHED)
    """Aspect ratios beyond this (either way) are cropped down to it."""
    min_image_size: int = field(default=64, metadata=CACHED)
    """Images whose shorter edge is below this many pixels are skipped with a reason."""
    repeats: int = field(default=1, metadata=TRAINED)
    """Times each cached sample of this dataset appears in every epoch."""
    max_samples: int = field(default=0, metadata=CACHED)
    """Use at most this many images of the dataset (a stable choice by path hash). 0: all of them."""
    regularisation: bool = field(default=False, metadata=TRAINED)
    """A regularisation (prior-preservation) set: its samples' loss is weighted by ``data.reg_loss_weight``."""
    reference_dir: str = field(default="", metadata=CACHED)
    """Edit pairs: a folder or URI of reference images with the same relative paths as ``images_dir`` (any image
    extension). Each training image is the edit's result, its caption the instruction; an image without its reference
    is skipped with the reason. Empty: no references (unless ``reference_column`` names them)."""
    reference_column: str = field(default="", metadata=CACHED)
    """Edit pairs from a metadata table (``caption_strategy=metadata``): the column naming each image's reference
    file, or a list of them (FLUX.2 takes several), relative to ``reference_dir`` when it is set, else to the table's
    folder. Files named there are references only, never training images themselves."""
    mask: str = field(default="none", metadata=CACHED)
    """Loss masks (see docs/masks.md): ``none``; ``dir``, a grayscale image per training image in ``mask_dir`` with
    the same relative path and any image extension; ``column``, the file a metadata column names
    (``mask_column``); or ``alpha``, the image's own alpha channel (the VAE still sees the image composited on white). White trains fully, black keeps ``mask_floor``; an RGB mask counts by its
    luminance. The mask is cut and resized with its image and reduced to the latent grid by area average."""
    mask_dir: str = field(default="", metadata=CACHED)
    """For ``mask=dir``: the folder or URI (``s3://bucket/prefix``) of the masks; for ``mask=column``, what the
    column's file names are relative to (empty: the metadata table's folder). It must not overlap ``images_dir``,
    ``cache.dir`` or ``run.output_dir``."""
    mask_column: str = field(default="mask", metadata=CACHED)
    """For ``mask=column`` (``caption_strategy=metadata``): the metadata column naming each image's mask file. Files
    named there inside ``images_dir`` are masks only, never training images."""
    mask_floor: float = field(default=0.0, metadata=TRAINED)
    """The loss weight the masked-out (black) area keeps, from 0 (no gradient from it) to 1 (masks have no effect),
    as ai-toolkit's minimum mask value: a token's weight is ``floor + (1 - floor) * mask``."""
    missing_mask: str = field(default="skip", metadata=CACHED)
    """When an image has no mask (no file in ``mask_dir``, or no alpha channel with ``mask=alpha``): ``skip`` it
    with the reason recorded, or train it with a mask of ``ones`` (its whole area, counted in the report)."""
    # issue 45: output preservation (rayflux.preservation)
    trigger_word: str = field(default="", metadata=added(CAPTIONS))
    """With ``train.flow.preservation=class``: the word (or phrase) in this dataset's captions that names the trained
    concept, e.g. ``sks``. Each caption's preservation prompt is the caption with it replaced by ``class_word``
    (whole words only); the cache encodes those prompts beside the captions."""
    class_word: str = field(default="", metadata=added(CAPTIONS))
    """With ``train.flow.preservation=class``: what ``trigger_word`` becomes in the preservation prompt, e.g. ``woman``
    ("photo of sks" -> "photo of woman"). Empty: the trigger is dropped."""


MASK_KEYS = ("mask", "mask_dir", "mask_column", "missing_mask", "mask_floor")
"""A dataset's mask settings: left out of its cache identity and of the run identity while ``mask`` is ``none`` (they
say nothing then), so caches and runs made before masks existed keep their keys."""


@dataclass
class DataConfig(DatasetConfig):
    """Where the training images and their captions come from.

    The ``data.*`` keys inherited from a dataset describe the single dataset ``data.images_dir``; with
    ``data.datasets`` they are the defaults every listed dataset starts from.
    """

    datasets: list = field(default_factory=list, metadata=CACHED)
    """Several datasets in one job: a list of mappings with the dataset keys above (``images_dir``, ``name``,
    ``caption_strategy``, ``resolution``, ``repeats``, ``max_samples``, ``regularisation``...). A key a mapping leaves
    out takes its ``data.*`` value. Empty: the one dataset ``data.images_dir``."""
    reg_loss_weight: float = field(default=1.0, metadata=TRAINED)
    """Loss weight of samples from regularisation datasets (1.0: weighted like any other sample)."""
    eval_samples: int = field(default=0, metadata=TRAINED)
    """Hold out this many cached samples for the eval loss (``train.eval.every``): a stable choice by sample id hash
    (the same for every world size, cache generation and rerun), never trained on, named in ``<output_dir>/
    eval_samples.txt``. 0: no eval loss."""
    max_image_pixels: int = field(default=178_956_970, metadata=CACHED)
    """Images with more pixels than this are refused as decompression bombs (Pillow's own default limit)."""


_DATASET_FIELDS = {f.name: f for f in dataclasses.fields(DatasetConfig)}
_CHOICES = {
    "caption_strategy": ("sidecar", "filename", "metadata", "instance", "vlm"),
    "missing_caption": ("skip", "empty", "filename", "instance", "vlm"),
    "resolution_type": ("area", "shorter_edge"),
    "crop": ("center", "random"),
    "mask": ("none", "dir", "column", "alpha"),
    "missing_mask": ("skip", "ones"),
}
_POSITIVE = ("resolution", "min_image_size", "repeats", "bucket_step")
MIN_RESOLUTION = 16
"""Smaller ``data.resolution`` values are refused: less than one bucket step, they are another tool's units
(SimpleTuner's megapixels), not a target size."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def default_name(images_dir: str) -> str:
    """A dataset's name when its mapping sets none: the last folder name of ``images_dir``, made safe."""
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
    _check_mask(ds, label)
    if ds.name and not _NAME.match(ds.name):
        raise ConfigError(f"{label('name')} {ds.name!r} may only hold letters, digits, '.', '_' and '-'")


def _check_mask(ds: DatasetConfig, label) -> None:
    """The mask keys agree with each other: a folder only with ``mask=dir``, a floor in [0, 1], a folder apart from
    the images (masks listed as training images, or images as masks, would train on the wrong files)."""
    if ds.mask == "dir" and not ds.mask_dir:
        raise ConfigError(f"{label('mask')}=dir needs {label('mask_dir')}: the folder of mask images")
    if ds.mask_dir and ds.mask not in ("dir", "column"):
        raise ConfigError(
            f"{label('mask_dir')} is set but {label('mask')}={ds.mask}; set mask: dir to train with those masks"
        )
    if ds.mask == "column" and (ds.caption_strategy != "metadata" or not ds.mask_column):
        raise ConfigError(
            f"{label('mask')}=column reads {label('mask_column')} of the metadata table, so it needs "
            f"caption_strategy=metadata (got {ds.caption_strategy}) and a column name"
        )
    if not 0.0 <= ds.mask_floor <= 1.0:
        raise ConfigError(
            f"{label('mask_floor')} must be in [0, 1] (the masked-out area's weight), got {ds.mask_floor}"
        )
    if ds.mask_dir and ds.images_dir:
        from rayflux import paths, storage

        how = paths.overlap(storage.canonical(ds.mask_dir), storage.canonical(ds.images_dir))
        if how:
            raise ConfigError(
                f"{label('mask_dir')} {ds.mask_dir!r} {paths.HOW[how]} {label('images_dir')} {ds.images_dir!r}; "
                "keep masks in a folder of their own, or they would be listed as training images"
            )


def _resolution_hint(ds: DatasetConfig, key: str) -> str:
    """What a too-small resolution probably meant: SimpleTuner's ``area`` counts megapixels (1.0 = 1024²)."""
    said = f"{key}={ds.resolution} with resolution_type={ds.resolution_type} means {ds.resolution} px"
    if ds.resolution_type == "area":
        meant = round((ds.resolution * 1e6) ** 0.5 / 64) * 64
        return (
            f"{said}; SimpleTuner's resolution_type=area counts megapixels: for {ds.resolution} MP write "
            f"resolution: {meant} (about {meant}x{meant} pixels) with resolution_type: area"
        )
    return f"{said}; the shorter edge is in pixels (at least {MIN_RESOLUTION}), e.g. resolution: 512"


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
            values[key] = coerce(f"{where}.{key}", raw, shared[key], _DATASET_FIELDS[key].type)
        if not values["images_dir"]:
            raise ConfigError(f"{where}.images_dir is required")
        values["name"] = values["name"] if "name" in entry else default_name(values["images_dir"])
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
