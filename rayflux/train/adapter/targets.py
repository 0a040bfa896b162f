"""``train.adapter.targets`` against a model: the Linear modules a parsed spec (:mod:`rayflux.config.targets`, where the
grammar is described) selects, and the summary ``plan`` prints of them.

A name, glob or exclude that matches nothing, or a block index the model does not have, is an error: a typo must not
silently train something else.
"""

from __future__ import annotations

import fnmatch

from rayflux.config.targets import PRESETS, STACKS, TargetSpec, parse

__all__ = ["PRESETS", "TargetSpec", "parse", "matches", "block_of", "select", "summary"]


def matches(name: str, pattern: str) -> bool:
    """A full module name against a name (itself or a ``.``-suffix, peft's rule) or a glob over the full name."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name == pattern or name.endswith("." + pattern)


def block_of(name: str, prefixes: tuple[str, ...]) -> tuple[str, int] | None:
    """``(stack, index)`` of a module inside a transformer block, or None outside them."""
    for stack, prefix in zip(STACKS, prefixes):
        if name.startswith(prefix):
            return stack, int(name[len(prefix) :].split(".")[0])
    return None


def _check_blocks(spec: TargetSpec, linear: list[str], prefixes: tuple[str, ...]) -> None:
    depth = {}
    for n in linear:
        where = block_of(n, prefixes)
        if where:
            depth[where[0]] = max(depth.get(where[0], 0), where[1] + 1)
    for stack, chosen in spec.blocks.items():
        beyond = sorted(i for i in chosen or () if i >= depth.get(stack, 0))
        if beyond:
            raise ValueError(
                f"train.adapter.targets: {stack} blocks {_ranges(beyond)} do not exist; the model has "
                f"{depth.get(stack, 0)} {stack} blocks (0-{depth.get(stack, 0) - 1})"
            )


def select(spec: TargetSpec, linear: list[str], presets: dict[str, list[str]], prefixes: tuple[str, ...]) -> list:
    """The full names, in model order, of the Linear modules ``linear`` that ``spec`` selects, with the family's
    ``presets`` (suffixes within its blocks, ``prefixes``: double-stream then single-stream)."""
    _check_blocks(spec, linear, prefixes)
    suffixes = [s for p in spec.presets for s in presets[p]]
    missing = [p for p in spec.names + spec.excludes if not any(matches(n, p) for n in linear)]
    if missing:
        raise ValueError(f"train.adapter.targets: no Linear module matches {missing}; presets: {', '.join(PRESETS)}")

    def wanted(n: str) -> bool:
        where = block_of(n, prefixes)
        if any(matches(n, p) for p in spec.excludes):
            return False
        if where and spec.blocks:
            chosen = spec.blocks.get(where[0], set())
            if chosen is not None and where[1] not in chosen:
                return False
        in_preset = where is not None and any(matches(n, s) for s in suffixes)
        return in_preset or any(matches(n, p) for p in spec.names)

    return [n for n in linear if wanted(n)]


def pattern_values(
    pattern: dict, chosen: list[str], presets: dict[str, list[str]], prefixes: tuple[str, ...], what: str
) -> dict[str, object]:
    """``train.adapter.rank_pattern``/``alpha_pattern`` (target spec -> value) resolved to ``{full module name: value}``
    over the trained modules ``chosen``; a later key wins where keys overlap. A key of block terms alone
    (``single 20-37``) means every trained module of those blocks."""
    values: dict[str, object] = {}
    for key, value in pattern.items():
        spec = parse(str(key))
        if spec.implicit:
            spec = TargetSpec((), ("*",), spec.excludes, spec.blocks)
        hit = select(spec, chosen, presets, prefixes)
        if spec.names == ("*",):  # block terms alone: the modules inside those blocks only
            hit = [n for n in hit if block_of(n, prefixes)]
        if not hit:
            raise ValueError(
                f"train.adapter.{what}: {key!r} selects none of the trained modules (train.adapter.targets)"
            )
        values.update(dict.fromkeys(hit, value))
    return values


def _ranges(indices: list[int]) -> str:
    out, start = [], None
    for i, n in enumerate(indices):
        start = n if start is None else start
        if i + 1 == len(indices) or indices[i + 1] != n + 1:
            out.append(f"{start}" if start == n else f"{start}-{n}")
            start = None
    return " ".join(out)


def summary(names: list[str], prefixes: tuple[str, ...]) -> list[str]:
    """What ``plan`` prints of the selected modules: per stack, each set of blocks with the modules trained in them
    (``double 0-9: attn.to_q, attn.to_k``), then the modules outside the blocks."""
    per: dict[tuple[str, str], list[int]] = {}
    outside = []
    for n in names:
        where = block_of(n, prefixes)
        if where is None:
            outside.append(n)
            continue
        inner = n[len(prefixes[STACKS.index(where[0])]) + len(str(where[1])) + 1 :]
        per.setdefault((where[0], inner), []).append(where[1])
    grouped: dict[tuple[str, str], list[str]] = {}
    for (stack, inner), indices in per.items():
        grouped.setdefault((stack, _ranges(sorted(set(indices)))), []).append(inner)
    lines = [f"{stack} {blocks}: {', '.join(inner)}" for (stack, blocks), inner in grouped.items()]
    return lines + ([f"outside the blocks: {', '.join(outside)}"] if outside else [])
