"""The driver's per-epoch accounting (from bucket sizes alone) is the plan the data feed trains."""

import collections

import pytest

from rayflux.train.data import batching


def _refs(per_bucket: dict[str, int], repeats: int = 1) -> list[batching.SampleRef]:
    refs = []
    for bucket, n in per_bucket.items():
        for i in range(n):
            ref = batching.SampleRef(f"{bucket}-{i}", bucket, f"{bucket}.parquet", i, "")
            refs.extend([ref] * repeats)
    return refs


@pytest.mark.parametrize(
    "per_bucket, batch_size, world, accumulation, repeats",
    [
        ({"64x64": 37, "80x48": 11, "48x80": 5}, 4, 1, 1, 1),
        ({"64x64": 37, "80x48": 11, "48x80": 5}, 4, 3, 2, 1),
        ({"64x64": 9, "96x64": 23}, 8, 2, 1, 3),
        ({"64x64": 1000, "96x64": 333, "64x96": 7}, 16, 8, 1, 1),
    ],
)
def test_counts_match_the_planned_epoch(per_bucket, batch_size, world, accumulation, repeats):
    refs = _refs(per_bucket, repeats)
    sizes = collections.Counter(r.bucket for r in refs)
    dropped_somewhere = False
    for epoch in range(4):
        planned, dropped = batching.plan_epoch(refs, batch_size, 7, epoch, world, accumulation)
        counts = batching.epoch_counts(sizes, batch_size, 7, epoch, world, accumulation)
        assert counts == {"samples": sum(b["size"] for b in planned), "dropped": dropped, "batches": len(planned)}
        assert counts["samples"] + counts["dropped"] == len(refs)
        dropped_somewhere |= dropped > 0
    # The cases with a remainder exercise the shuffled tail, which is where the two could disagree.
    assert dropped_somewhere or world * accumulation == 1
