"""A committed generation's manifest, as its readers use it.

The manifest is the JSON object the cache stage writes last (:func:`rayflux.cache.generations.commit`); a
:class:`Manifest` is that object (a ``dict``, so it is written, compared and logged as before) with typed accessors
for what the job, training, reuse and ``cache verify`` read of it. Readers go through these instead of its keys, so
the manifest's field names live here and in the stage that writes them (:mod:`rayflux.cache.stage`).
"""

from __future__ import annotations

from dataclasses import dataclass

from rayflux import storage
from rayflux.cache.layout import ShardLayout


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
        :func:`rayflux.train.captions.load_empty` reads."""
        empty = self["empty_caption"]
        return {**empty, "file": self.resolve(empty["file"]), "text_dtype": self["layout"]["dtype"],
                "text": self["layout"]["text"]}  # fmt: skip

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
