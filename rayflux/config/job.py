"""The whole job's config: one field per section, in the order ``--help`` lists them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field

from rayflux.config.identity import flat
from rayflux.config.cache import CacheConfig
from rayflux.config.caption import CaptionConfig
from rayflux.config.data import DataConfig
from rayflux.config.model import ModelConfig
from rayflux.config.run import RunConfig
from rayflux.config.train import TrainConfig


@dataclass
class JobConfig:
    """The whole job."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    caption: CaptionConfig = field(default_factory=CaptionConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def fingerprint(self, *sections: str) -> str:
        """A short stable hash of the named sections (all when none are named). Each section is hashed flat, its
        fields under their keys from before sub-sections (:func:`rayflux.config.identity.flat`), so the hash of a
        config is what it was before the split."""
        names = sections or [f.name for f in dataclasses.fields(self)]
        chosen = {k: flat(getattr(self, k)) for k in names}
        if not sections and not chosen["caption"]:
            del chosen["caption"]  # a section added later: at its defaults it changes no fingerprint
        return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:16]


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}
"""Each section's name and its dataclass, in the order of ``JobConfig``'s fields."""
