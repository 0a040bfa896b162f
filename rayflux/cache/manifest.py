"""A committed generation's manifest, as its readers use it.

The manifest is the JSON object the cache stage writes last (:func:`rayflux.cache.generations.commit`); a
:class:`Manifest` is that object (a ``dict``, so it is written, compared and logged as before) with typed accessors
for what the job, training, reuse and ``cache verify`` read of it. Readers go through these instead of its keys, so
the manifest's field names live here, beside :func:`compose`, which the cache stage builds it with.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from rayflux import storage
from rayflux.buckets import BucketSpec
from rayflux.cache.layout import SCHEMA_VERSION, ShardLayout


@dataclass(frozen=True)
class SkipCounts:
    """What became of a generation's discovered inputs."""

    discovered: int
    cached: int
    skipped: int


class Manifest(dict):
    """A committed manifest (see the module)."""

    @classmethod
    def of(cls, data: dict | None) -> Manifest | None:
        """``data`` as a Manifest (itself when it is one already); None stays None."""
        return data if data is None or isinstance(data, Manifest) else cls(data)

    @property
    def dir(self) -> str:
        """The generation's directory (a path or URI)."""
        return self["dir"]

    @property
    def generation(self) -> int:
        return self["generation"]

    @property
    def layout(self) -> ShardLayout:
        """What every sample row must look like: dtype, latent geometry, text and per-sample tensors."""
        return ShardLayout(**self["layout"])

    @property
    def cached(self) -> int:
        """Samples the generation holds."""
        return self["cached"]

    def skip_counts(self) -> SkipCounts:
        return SkipCounts(self["discovered"], self["cached"], self["skipped"])

    def index_path(self, kind: str) -> str | None:
        """The full path of one of its index files (``samples``, ``captions``, ``sidecars``); None when it has none."""
        entry = self.get("index", {}).get(kind)
        return storage.join(self.dir, entry["path"]) if entry else None

    def resolve(self, file: str) -> str:
        """An index ``file`` (relative to the cache key's directory) as a full path or URI."""
        return storage.join(self.dir.rstrip("/").rsplit("/", 1)[0], file)

    def empty_caption(self) -> dict:
        """Where the empty caption's embeddings are (its caption index row), with the file resolved to a full path,
        the stored ``text_dtype`` and the named text tensors (``text``): what
        :func:`rayflux.train.data.captions.load_empty` reads."""
        empty = self["empty_caption"]
        return {
            **empty,
            "file": self.resolve(empty["file"]),
            "text_dtype": self["layout"]["dtype"],
            "text": self["layout"]["text"],
        }

    def shard_files(self, kind: str = "samples") -> list[dict]:
        """The generation's own shards of ``kind`` (``samples`` or ``text``): path (relative to its directory),
        rows, bytes."""
        return self.get("files" if kind == "samples" else "text_files", [])

    def listed(self) -> set[str]:
        """Every file its directory holds besides the manifest and the skip list, relative to it."""
        files = {f["path"] for f in self.shard_files("samples") + self.shard_files("text")}
        return files | {e["path"] for e in self.get("index", {}).values()}

    @property
    def borrowed(self) -> list[str]:
        """Earlier generations' files its index points into, relative to the cache key's directory."""
        return self.get("borrowed", [])

    @property
    def encode_id(self) -> str:
        return self.get("encode_id", "")

    @property
    def schema_version(self) -> int | None:
        return self.get("schema_version")

    @property
    def seed(self) -> int:
        """The seed its crops and caption choices were drawn with."""
        return self["seed"]

    @property
    def committed_at(self) -> float:
        return self["committed_at"]

    @property
    def buckets(self) -> dict:
        """Rows, latent shape, dtype and latent bytes per bucket."""
        return self["buckets"]

    @property
    def skipped_inputs(self) -> list[dict]:
        """Every input that was not cached, with its reason."""
        return self.get("skipped_inputs", [])

    def empty_caption_row(self) -> dict:
        """The empty caption's caption index row as recorded ({} when it has none)."""
        return self.get("empty_caption") or {}

    def bucket_specs(self) -> tuple[BucketSpec, dict[str, BucketSpec]]:
        """The bucket knobs it was built with: ``data.*``'s, and each dataset's by its ``dataset`` column value."""
        specs = {k: BucketSpec(**v) for k, v in self.get("bucket_specs", {}).items()}
        return BucketSpec(**self["bucket_spec"]), specs

    def counts(self) -> dict:
        """Encoded and reused samples and captions: ``{"encoded": {...}, "reused": {...}}``."""
        return {"encoded": self["encoded"], "reused": self["reused"]}

    def finish(self, index: dict, passes: dict, unique_captions: int, staged_bytes: int) -> None:
        """Record, before the commit, what the build learnt after composing it: its index files, how its passes
        ran, the unique captions (those not encoded were reused) and the bytes its staged inputs held."""
        self.update(index=index, passes=passes, unique_captions=unique_captions, staged_bytes=staged_bytes)
        self["reused"]["captions"] = unique_captions - self["encoded"]["captions"]


@dataclass(frozen=True)
class Found:
    """What a build's manifest needs of its discovery, taken before the discovery's rows are released."""

    discovered: int
    skipped: list[dict]
    """The inputs discovery itself skipped, as :attr:`rayflux.discovery.discoveries.Discovery.skipped` lists them."""
    inputs: str
    """:func:`rayflux.cache.stage.inputs_signature` of the discovery."""
    sidecars: int
    """Rows of the discovery's sidecar table."""


@dataclass(frozen=True)
class Build:
    """What a build's manifest records of the build itself."""

    generation: int
    gen_dir: str
    seed: int
    encode_id: str
    config_hash: str
    """:meth:`rayflux.config.JobConfig.fingerprint` of the data, model and cache sections."""
    facts: object
    """The model's :class:`~rayflux.families.base.ModelFacts`."""
    layout: ShardLayout
    reused_from: str
    """The previous generation's directory whose rows the build may reference ("" when none)."""


def compose(b: Build, found: Found, spec, specs, text_meta, sample_meta, *, samples, captions) -> Manifest:
    """The manifest of a finished build (without its index entries), after checking its accounting. ``samples`` and
    ``captions``: the build's :class:`rayflux.cache.index.Sink` of each kind."""
    skipped = sorted(
        [*found.skipped, *(x for m in sample_meta for x in json.loads(m["skipped"]))], key=lambda x: x["source_uri"]
    )
    cached = samples.rows
    if cached + len(skipped) != found.discovered:
        raise RuntimeError(
            f"cache accounting broke: cached {cached} + skipped {len(skipped)} != discovered {found.discovered}"
        )
    if captions.empty is None:
        raise RuntimeError("the cache's text pass produced no empty-caption row")
    own = b.gen_dir.rstrip("/").rsplit("/", 1)[-1] + "/"
    dtype = b.layout.dtype
    return Manifest(
        {
            "schema_version": SCHEMA_VERSION,
            "generation": b.generation,
            "dir": b.gen_dir,
            "seed": b.seed,
            "encode_id": b.encode_id,
            "config_hash": b.config_hash,
            "model_identity": b.facts.identity,
            "layout": b.layout.to_json(),
            "bucket_spec": dataclasses.asdict(spec),
            "bucket_specs": {k: dataclasses.asdict(v) for k, v in specs.items()},
            "latent_channels": b.facts.latent_channels,
            "vae_scale_factor": b.facts.vae_scale_factor,
            "dtype": dtype,
            "files": sorted((_file_entry(m) for m in sample_meta if m["rows"]), key=lambda f: f["path"]),
            "text_files": sorted((_file_entry(m, with_buckets=False) for m in text_meta), key=lambda f: f["path"]),
            "borrowed": sorted(f for f in samples.files | captions.files if not f.startswith(own)),
            "empty_caption": captions.empty,
            "buckets": {k: {**v, "dtype": dtype} for k, v in sorted(samples.buckets.items())},
            "discovered": found.discovered,
            "cached": cached,
            "skipped": len(skipped),
            "skipped_inputs": skipped,
            "encoded": {
                "samples": sum(int(m["encoded"]) for m in sample_meta),
                "captions": sum(int(m["encoded"]) for m in text_meta),
            },
            "reused": {"samples": sum(int(m["reused"]) for m in sample_meta), "from": b.reused_from},
            "inputs": found.inputs,
        }
    )


def _file_entry(meta: dict, with_buckets: bool = True) -> dict:
    entry = {"path": meta["path"], "rows": int(meta["rows"]), "bytes": int(meta["bytes"])}
    if with_buckets:
        entry["buckets"] = json.loads(meta["buckets"])
    return entry
