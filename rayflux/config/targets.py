"""``train.adapter.targets``: which Linear modules of the transformer get an adapter, from a small text spec.

The spec is a comma-separated list of terms:

- a preset (``attention``, ``attention+ffs``, ``context``, ``all``): the family's module suffixes for it
  (:attr:`rayflux.families.base.Family.lora_presets`), inside the transformer blocks only;
- a module name (``proj_mlp``, ``norm1.linear``: matches itself or any module ending in ``.name``, anywhere in the
  model) or a glob over full names (``transformer_blocks.*.attn.to_q``);
- ``-`` before a name or glob: exclude what it matches (``-to_out.0``);
- ``double RANGES`` / ``single RANGES``: train only these blocks of the double- and single-stream stacks
  (``double 0-9``, ``single all``, ``single 0-3 20 30-37``); once any block term is given, a stack without one is
  not trained. Modules outside the blocks are not affected.

With block terms or excludes but no preset or name, the ``attention`` preset is meant: ``double 0-9, single all``
trains the attention of double blocks 0-9 and of every single block. Parsed here, when the job's config loads (a malformed spec
stops the job before any work); :mod:`rayflux.train.adapter.targets` selects the modules once the model is known.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from rayflux.config.values import ConfigError

PRESETS = ("attention", "attention+ffs", "context", "all")
"""Preset names, after the peers' (attention only, attention + feed-forward, the text stream, every Linear of the
blocks); each family says which of its modules they hold."""
STACKS = ("double", "single")
"""Block-term names, in the order of :attr:`Family.lora_blocks` (double-stream blocks, then single-stream)."""
DEFAULT_PRESET = "attention"


@dataclass(frozen=True)
class TargetSpec:
    """A parsed ``train.adapter.targets``."""

    presets: tuple[str, ...] = ()
    """Presets named."""
    names: tuple[str, ...] = ()
    """Module names or globs to include."""
    excludes: tuple[str, ...] = ()
    """Module names or globs to leave out."""
    blocks: dict = field(default_factory=dict)
    """``double``/``single`` -> the set of block indices to train, or None for all; empty: every block."""
    implicit: bool = False
    """No preset or name was given, so the ``attention`` preset stands in (a rank pattern key means every trained
    module of its blocks instead)."""


def _indices(stack: str, words: list[str]) -> set[int] | None:
    if words == ["all"]:
        return None
    if not words:
        raise ConfigError(f"train.adapter.targets: '{stack}' needs block numbers, e.g. '{stack} 0-9' or '{stack} all'")
    chosen: set[int] = set()
    for word in words:
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", word)
        if not m or (m.group(2) and int(m.group(2)) < int(m.group(1))):
            raise ConfigError(
                f"train.adapter.targets: '{stack} {' '.join(words)}': {word!r} is no block number or range"
            )
        chosen.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    return chosen


def parse(spec: str) -> TargetSpec:
    """The terms of a ``train.adapter.targets`` string (see the module docstring)."""
    presets, names, excludes, blocks = [], [], [], {}
    for term in (t.strip() for t in spec.split(",")):
        if not term:
            continue
        words = term.split()
        if words[0] in STACKS:
            blocks[words[0]] = _indices(words[0], words[1:])
        elif len(words) > 1:
            raise ConfigError(
                f"train.adapter.targets: {term!r} is not one term (start block terms with double or single)"
            )
        elif term in PRESETS:
            presets.append(term)
        elif term.startswith("-"):
            excludes.append(term[1:])
        else:
            names.append(term)
    implicit = not presets and not names
    if implicit:
        presets.append(DEFAULT_PRESET)
    return TargetSpec(tuple(presets), tuple(names), tuple(excludes), blocks, implicit)
