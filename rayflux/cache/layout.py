"""The per-sample tensors of a sample row, declared once: what the writer, the index, reuse, ``cache verify``, the
training reads and the step's batch loop over.

A sample row holds one binary column per declared :class:`SampleTensor`. Each declaration gives the column's name,
the rule for its shape (from the row's bucket and the row's own count columns), its stored dtype, whether a row may
lack it (its bytes are then empty), the prefix of its ``offset``/``length``/``crc32`` columns in the generation
index, and where it lands in the step's :class:`~rayflux.train.step.Batch`. Adding a per-sample tensor costs a
declaration here, a producer (a stage that puts the tensor's bytes into the row under its name, or the
declaration's own ``produce``) and a consumer (whatever reads ``Batch.tensors[name]``). A declaration also names
the row's columns that go with its tensor: the count its shape names (``ref_count``) and its content hash
(``hash``); the shard and index schemas, the planned samples and the training refs carry them from here.

The tensor columns are the last columns of a sample shard, in declaration order, so a row's tensors lie back to
back in its row group and one ranged read fetches all of them (:mod:`rayflux.cache.ranges` merges close ranges).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple

import pyarrow as pa

from rayflux import buckets
from rayflux.cache import tensors
from rayflux.families.base import TextTensor

LATENT_AXES = ("c", "h", "w")
"""Axis rules that take the bucket's latent shape: channels, height and width of the stored latent."""


@dataclass(frozen=True)
class SampleTensor:
    """One per-sample tensor of a sample row."""

    name: str
    """Its binary column in the sample shards, the key its producer puts its bytes under, and its name in
    ``Batch.tensors``."""
    shape: tuple[int | str, ...]
    """One rule per axis: an int is a fixed size, ``c``/``h``/``w`` the bucket's latent channels/height/width, any
    other string a count column of the row (``ref_count``)."""
    key: str
    """Prefix of its byte-range columns in the sample index (``<key>offset``, ``<key>length``, ``<key>crc32``)."""
    dtype: str = ""
    """Stored dtype; empty: the layout's (``cache.dtype``)."""
    optional: bool = False
    """A row may lack it: its bytes are then empty (a count column of 0, or no producer output for that row). A
    training batch either has it for every sample or for none (see :func:`rayflux.train.data.batching.group`)."""
    batch: str = ""
    """The step's :class:`~rayflux.train.step.Batch` attribute it lands on (``latents``, ``references``); empty:
    ``Batch.tensors[name]``."""
    hash: str = ""
    """Its content-hash column (a string, comma-joined per item for a counted tensor), in the sample shards and the
    sample index: what the tensor was made from, so a rerun knows whether a cached row's tensor is current. Empty:
    none. Code, like the other columns of a row: not written into layouts; a layout read back takes the current
    declaration's (:func:`as_tensor`)."""
    produce: Callable[[dict], bytes] | None = field(default=None, compare=False, repr=False)
    """Optional producer run by the writer on each freshly encoded row that lacks the column: the row as a dict in,
    the tensor's stored bytes out. Not part of the layout written to manifests and shards."""

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(self.shape))

    def counts(self) -> tuple[str, ...]:
        """The row's count columns its shape depends on."""
        return tuple(a for a in self.shape if isinstance(a, str) and a not in LATENT_AXES)

    def shape_of(self, latent: tuple[int, int, int], row) -> tuple[int, ...]:
        """Its shape in a row of latent shape ``latent``; ``row`` gives the count columns (a dict or an object; a count
        it lacks is 0)."""
        axes = dict(zip(LATENT_AXES, latent))
        get = row.get if isinstance(row, dict) else lambda k: getattr(row, k, 0)
        return tuple(a if isinstance(a, int) else axes[a] if a in axes else int(get(a) or 0) for a in self.shape)

    def nbytes(self, latent: tuple[int, int, int], row, layout_dtype: str) -> int:
        return tensors.nbytes(self.shape_of(latent, row), self.dtype or layout_dtype)

    def columns(self) -> tuple[str, str, str]:
        """Its ``offset``, ``length`` and ``crc32`` columns in the sample index."""
        return f"{self.key}offset", f"{self.key}length", f"{self.key}crc32"

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "key": self.key,
            "dtype": self.dtype,
            "optional": self.optional,
            "batch": self.batch,
        }


SAMPLE_TENSORS: tuple[SampleTensor, ...] = (
    SampleTensor("latent", ("c", "h", "w"), key="", batch="latents"),
    # Edit pairs: ``ref_count`` reference latents of the row's own latent shape, back to back (empty for a plain
    # sample); their content hashes are ``ref_sha256``, comma-joined in the same order (part of the sample id).
    SampleTensor(
        "ref_latent", ("ref_count", "c", "h", "w"), key="ref_", optional=True, batch="references", hash="ref_sha256"
    ),
    # Loss masks (docs/masks.md): the mask on the latent grid, float16 in [0, 1] (rayflux.cache.masks), produced by
    # preparation (cache/prepare.py), empty for a dataset without masks; its content hash is the index's
    # ``mask_sha256`` (not part of the sample id: batch order and noise must not depend on it).
    SampleTensor("mask", ("h", "w"), key="mask_", dtype="float16", optional=True, batch="masks", hash="mask_sha256"),
)
"""The per-sample tensors every new layout declares, in column order. A layout read back from a manifest or a
shard carries its own list (:attr:`rayflux.cache.shards.ShardLayout.samples`)."""


def count_columns(samples: tuple[SampleTensor, ...] | None = None) -> tuple[str, ...]:
    """The count columns the declarations' shapes name (int32 columns of both the sample shards and the sample
    index), in declaration order."""
    samples = SAMPLE_TENSORS if samples is None else samples
    return tuple(dict.fromkeys(c for t in samples for c in t.counts()))


def hash_columns(samples: tuple[SampleTensor, ...] | None = None) -> tuple[str, ...]:
    """The declarations' content-hash columns (strings of both the sample shards and the sample index)."""
    samples = SAMPLE_TENSORS if samples is None else samples
    return tuple(t.hash for t in samples if t.hash)


def as_tensor(t) -> SampleTensor:
    """A declaration, from itself or from its JSON form (a manifest's or a shard's layout), with the current
    declaration's hash column (which layouts do not record)."""
    if isinstance(t, SampleTensor):
        return t
    current = declared(t["name"])
    return SampleTensor(**{"hash": current.hash if current else "", **t})


def declared(name: str) -> SampleTensor | None:
    """The current declaration named ``name`` (for its ``batch`` attribute), or None."""
    return next((t for t in SAMPLE_TENSORS if t.name == name), None)


class TensorRange(NamedTuple):
    """Where one tensor's bytes are inside its file, and their checksum (:mod:`rayflux.cache.integrity`)."""

    offset: int
    length: int
    crc32: int


class PlannedSample(NamedTuple):
    """One sample of a planned batch, as a read task needs it: where its row is, where each declared tensor's bytes
    are, and where its caption's text tensors are. Planned batches carry these as JSON lists
    (:func:`encode_planned`, :func:`decode_planned`); nothing else unpacks them."""

    file: str
    row: int
    sample_id: str
    file_bytes: int
    latent_shape: str
    """``"c,h,w"`` as the index records it."""
    source: str
    text: str
    """Where the sample's declared captions' text tensors are (:data:`SAMPLE_TEXTS`, :func:`encode_texts`)."""
    counts: dict
    """The row's count columns (:func:`count_columns`) by name."""
    ranges: list
    """One :class:`TensorRange` per declared sample tensor, in the layout's order."""

    def range(self, i: int) -> TensorRange:
        return TensorRange(*self.ranges[i])


def encode_planned(samples: list[PlannedSample]) -> str:
    return json.dumps([list(s) for s in samples])


def decode_planned(refs: str) -> list[PlannedSample]:
    return [PlannedSample(*s) for s in json.loads(refs)]


class TextPart(NamedTuple):
    """One named text tensor of a caption: its byte range, its shape, its checksum and how its stored bytes are
    encoded (:mod:`rayflux.cache.codec`; ``""``: raw)."""

    offset: int
    length: int
    shape: list
    crc32: int
    codec: str = ""


class TextLocator(NamedTuple):
    """Where one caption's text tensors are: its text file, the file's size, the caption id and one
    :class:`TextPart` per named text tensor, in the layout's order. Carried as a JSON list (:meth:`encode`)."""

    file: str
    file_bytes: int
    caption_id: str
    parts: list

    def encode(self) -> str:
        return json.dumps([self.file, self.file_bytes, self.caption_id, [list(p) for p in self.parts]])

    @classmethod
    def decode(cls, text: str) -> TextLocator:
        return cls.of(json.loads(text))

    @classmethod
    def of(cls, raw: list) -> TextLocator:
        """From its JSON list, parsed."""
        file, file_bytes, caption_id, parts = raw
        return cls(file, file_bytes, caption_id, [TextPart(*p) for p in parts])


class SampleText(NamedTuple):
    """One caption a sample's batch reads the text tensors of (issue 45): its own caption, or the prompt of its
    output-preservation forward (:mod:`rayflux.preservation`)."""

    name: str
    """Its key in a planned sample's ``text`` (:func:`encode_texts`)."""
    prefix: str
    """Prefix of its text tensors' names in a stacked batch row (``text_<prefix><tensor>``)."""
    batch: str
    """The step's :class:`~rayflux.train.step.Batch` attribute its named text tensors land on."""


SAMPLE_TEXTS: tuple[SampleText, ...] = (
    SampleText("caption", "", "text"),
    # train.flow.preservation=class: the caption with the dataset's trigger word replaced by its class word.
    SampleText("preservation", "preservation_", "preservation_text"),
)
"""The captions a sample may carry text locators for; every sample has the first."""


def encode_texts(locators: dict[str, str]) -> str:
    """A planned sample's ``text``: ``{name: TextLocator JSON}`` of :data:`SAMPLE_TEXTS`. A sample with its caption
    alone is that caption's locator as it always was (plans, tests and caches stay as they were)."""
    if list(locators) == ["caption"]:
        return locators["caption"]
    return json.dumps({name: json.loads(loc) for name, loc in locators.items()})


def decode_texts(text: str) -> dict[str, TextLocator]:
    """``{name: TextLocator}`` of a planned sample's ``text`` (:func:`encode_texts`), in :data:`SAMPLE_TEXTS`
    order."""
    raw = json.loads(text)
    if isinstance(raw, list):
        raw = {"caption": raw}
    return {t.name: TextLocator.of(raw[t.name]) for t in SAMPLE_TEXTS if t.name in raw}


# 2: layout metadata and non-nullable tensors; 3: the dataset column; 4: text only in text shards; 5: text tensors by
# the names and shape columns the model family gives them (the layout's ``text``); 6: edit pairs' reference latents;
# 7: a checksum per tensor in the generation index (rayflux.cache.integrity); 8: per-sample tensors declared in
# rayflux.cache.layout, their columns last (the layout's ``samples``); 9: the loss mask (``mask``, ``mask_sha256``)
SCHEMA_VERSION = 9
_META_KEY = b"rayflux"


def _tensor(name: str) -> pa.Field:
    # Non-nullable: a missing tensor is an error at write time, and no definition levels are stored per value.
    return pa.field(name, pa.binary(), nullable=False)


_SAMPLE_HEAD = [
    ("sample_id", pa.string()),
    ("source_uri", pa.string()),
    ("rel_path", pa.string()),
    ("dataset", pa.string()),
    ("source_sha256", pa.string()),
    ("caption", pa.string()),
    ("caption_id", pa.string()),
    ("bucket", pa.string()),
    ("orig_w", pa.int32()),
    ("orig_h", pa.int32()),
    ("crop_left", pa.int32()),
    ("crop_top", pa.int32()),
    ("crop_w", pa.int32()),
    ("crop_h", pa.int32()),
    ("target_w", pa.int32()),
    ("target_h", pa.int32()),
    ("latent_c", pa.int32()),
    ("latent_h", pa.int32()),
    ("latent_w", pa.int32()),
    ("latent_dtype", pa.string()),
]
"""A sample row's description, before its declared tensors' count and hash columns (:func:`sample_columns`)."""
_SAMPLE_TAIL = [("generation", pa.int32()), ("encode_id", pa.string())]


def sample_columns(samples: tuple[SampleTensor, ...] | None = None) -> list[tuple[str, pa.DataType]]:
    """A sample row's columns before its tensors: its description, the declarations' count and hash columns, and
    the build that wrote it."""
    counts = [(c, pa.int32()) for c in count_columns(samples)]
    return [*_SAMPLE_HEAD, *counts, *((h, pa.string()) for h in hash_columns(samples)), *_SAMPLE_TAIL]


def sample_schema(samples: tuple[SampleTensor, ...] | None = None) -> pa.Schema:
    """A sample shard's columns: the row's description, then one binary column per declared per-sample tensor,
    last and in order, so a row's tensors lie back to back (one ranged read)."""
    samples = SAMPLE_TENSORS if samples is None else samples
    return pa.schema([*sample_columns(samples), *(_tensor(t.name) for t in samples)])


SAMPLE_SCHEMA = sample_schema()
"""The sample shards' columns with the current declarations (:data:`rayflux.cache.layout.SAMPLE_TENSORS`)."""


def text_schema(text: tuple[TextTensor, ...]) -> pa.Schema:
    """A text shard's columns for the named tensors ``text``: their shape columns, then their bytes."""
    dims = [(d, pa.int32()) for t in text for d in t.dims]
    tensors_ = [_tensor(t.name) for t in text]
    return pa.schema(
        [
            ("caption_id", pa.string()),
            ("caption", pa.string()),
            *dims,
            ("text_dtype", pa.string()),
            *tensors_,
            ("encode_id", pa.string()),
        ]
    )


@dataclass(frozen=True)
class ShardLayout:
    """What every row of a shard must look like; written into the shard's own metadata and into the manifest."""

    kind: str
    """``samples`` or ``text``."""
    dtype: str
    """Stored dtype of every tensor column."""
    latent_channels: int
    """VAE latent channels; with ``vae_scale_factor`` and a bucket key it fixes the latent shape."""
    vae_scale_factor: int
    """Pixel-to-latent downscale of the VAE."""
    text: tuple[TextTensor, ...] = ()
    """The named text tensors of every caption, as the model family encodes them (see
    :class:`rayflux.families.base.TextTensor`)."""
    samples: tuple[SampleTensor, ...] = field(default_factory=lambda: SAMPLE_TENSORS)
    """The per-sample tensors of every sample row, in column order (:mod:`rayflux.cache.layout`)."""
    schema_version: int = SCHEMA_VERSION
    """Version of the column layout above."""

    def __post_init__(self):
        # A layout read back from JSON (a manifest, a shard's metadata) carries plain dicts and lists.
        text = tuple(t if isinstance(t, TextTensor) else TextTensor(**t) for t in self.text)
        object.__setattr__(self, "text", text)
        object.__setattr__(self, "samples", tuple(as_tensor(t) for t in self.samples))

    @property
    def tensor_columns(self) -> list[str]:
        """The binary tensor columns of this kind of shard."""
        return [t.name for t in self.samples] if self.kind == "samples" else [t.name for t in self.text]

    def latent_shape(self, bucket: str) -> tuple[int, int, int]:
        return buckets.latent_shape_of(bucket, self.latent_channels, self.vae_scale_factor)

    def dtype_of(self, t: SampleTensor) -> str:
        return t.dtype or self.dtype

    def to_json(self) -> dict:
        """The layout as plain JSON values (a manifest's ``layout``, a shard's metadata); no producers."""
        out = asdict(replace(self, samples=()))
        out["samples"] = [t.to_json() for t in self.samples]
        return out

    def schema(self) -> pa.Schema:
        base = sample_schema(self.samples) if self.kind == "samples" else text_schema(self.text)
        return base.with_metadata({_META_KEY: json.dumps(self.to_json(), sort_keys=True).encode()})


def layout_of(schema: pa.Schema) -> ShardLayout | None:
    """The layout a shard's schema carries, or None for a file rayflux did not write."""
    raw = (schema.metadata or {}).get(_META_KEY)
    return ShardLayout(**json.loads(raw)) if raw else None
