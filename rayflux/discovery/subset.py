"""The ``max_samples`` draw: the same subset of a dataset on every run and node, whatever part of it is drawn
from first."""

from __future__ import annotations

import hashlib

import pyarrow as pa


def rank(rel_path: str) -> bytes:
    """Where an image stands in the ``max_samples`` draw: a hash of its path, the same on every run and node."""
    return hashlib.sha256(rel_path.encode()).digest()


def draw(table: pa.Table, k: int) -> tuple[pa.Table, int]:
    """The ``k`` usable rows of lowest :func:`rank` (in their order) and how many usable rows were left out.

    Applied to any part of a dataset it keeps a superset of that part's share of the whole draw, so preparation
    tasks draw locally and the driver draws again among what they kept: the same result as one draw over all.
    """
    if table.num_rows <= k:
        return table, 0
    ranks = [rank(p) for p in table["rel_path"].to_pylist()]
    kept = sorted(sorted(range(len(ranks)), key=ranks.__getitem__)[:k])
    return table.take(pa.array(kept, pa.int64())), table.num_rows - k
