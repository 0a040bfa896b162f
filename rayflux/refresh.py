"""Which cache generation each epoch reads, and how epochs group into trainer runs (segments).

``cache.refresh = never``: one generation (g0) for every epoch, one trainer run.
``every_epoch`` / ``N``: generation ``g = epoch // N``; each segment of N epochs is one ``TorchTrainer`` run that
resumes from the previous segment's final checkpoint.

Why a trainer run per segment rather than swapping datasets inside one run: a segment boundary is a natural,
already-tested barrier (``fit()`` returns only when every worker finished), so ``retire(g)`` can never race a reader,
and a crash anywhere resumes through the ordinary checkpoint path. The cost is one worker-group restart per refresh:
for FLUX.1-dev, reloading ~24 GB of transformer weights on each worker (seconds from local NVMe or page cache, longer
from network storage). Refreshing every N > 1 epochs amortises it; ``never`` pays nothing.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """Epochs ``[first_epoch, end_epoch)`` trained in one trainer run, all reading ``generation``."""

    index: int
    generation: int
    first_epoch: int
    end_epoch: int


def segments(epochs: int, interval: int) -> list[Segment]:
    """Split ``epochs`` into segments; ``interval`` 0 means never refresh."""
    if interval <= 0 or interval >= epochs:
        return [Segment(0, 0, 0, epochs)]
    out = []
    for i, start in enumerate(range(0, epochs, interval)):
        out.append(Segment(i, i, start, min(start + interval, epochs)))
    return out


def generation_seed(base_seed: int, generation: int) -> int:
    """Seed for a generation's random crops and caption choices; g0 uses the base seed itself."""
    if generation == 0:
        return base_seed
    digest = hashlib.sha256(f"{base_seed}:generation:{generation}".encode()).digest()
    return int.from_bytes(digest[:4], "little")
