"""The driver holds discovery as Arrow: its Python heap does not grow by a row object per image.

``tracemalloc`` counts the driver's own Python allocations and not Arrow buffers (pyarrow's memory pool), so a
discovery that turned listed or settled rows into Python dicts again (about 1-2 KB per image with its strings) shows
up as a heap peak growing with the number of images. The columnar one holds at most a bounded chunk of listed
entries as Python objects at a time (:mod:`rayflux.discovery.walk`), far below that. Both paths are measured: a first discovery, whose caption files are read in
real Ray tasks and come back as Arrow blocks, and a rerun whose caption files are all known from the previous
generation's sidecar table, which settles on the driver a bounded chunk at a time.
"""

import gc
import tracemalloc

import cache_sets
import pytest

from rayflux import config, models

from rayflux.cache import discover, sidecars
from rayflux.discovery import caption_hash, settling

FOLDERS = 4
SMALL, LARGE = 400, 2400
BOUND = 700  # bytes of Python heap per image, at the peak; a dict per image would be well over 1,000


@pytest.fixture
def bounded(monkeypatch):
    # The driver's Python chunks stay far below the image counts.
    monkeypatch.setattr(settling, "_CHUNK", 128)
    monkeypatch.setattr(caption_hash, "_CHUNK", 128)


def _dataset(root, n: int):
    png = cache_sets.encoded(cache_sets.picture(64, 64, 1), "PNG")
    for i in range(n):
        folder = root / f"part{i % FOLDERS}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"image_{i:06d}.png").write_bytes(png)
        (folder / f"image_{i:06d}.txt").write_text(f"a picture numbered {i}, with a caption of ordinary length\n")
    return root


def _peak(fn) -> tuple[int, object]:
    gc.collect()
    tracemalloc.start()
    try:
        out = fn()
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


def _run(tmp_path, tiny_model, n: int) -> tuple[int, int]:
    """Heap peaks of a first discovery (caption files read in tasks) and of a rerun (all known, settled here)."""
    root = _dataset(tmp_path / f"images{n}", n)
    cfg = config.load(None, [f"model.path={tiny_model}", f"data.images_dir={root}", "data.resolution=64"])
    facts = models.model_facts(cfg.model)
    first, found = _peak(lambda: discover.discover(cfg, facts, seed=3))
    assert found.table.num_rows == n and found.skips.num_rows == 0 and found.sidecars.rows == n
    gen = tmp_path / f"gen{n}"
    gen.mkdir()
    previous = {"dir": str(gen), "index": {"sidecars": sidecars.write(str(gen), found.sidecars)}}
    rerun, again = _peak(lambda: discover.discover(cfg, facts, seed=3, previous=previous))
    assert again.table.equals(found.table)  # the same sources and captions, with no caption file read
    return first, rerun


def per_image(tmp_path, tiny_model) -> dict[str, float]:
    """Heap peak growth per image from SMALL to LARGE images, after a first discovery whose one-time allocations
    (Ray Data's modules and executor) would otherwise count against the smaller run."""
    _run(tmp_path, tiny_model, 20)
    first_small, rerun_small = _run(tmp_path, tiny_model, SMALL)
    first_large, rerun_large = _run(tmp_path, tiny_model, LARGE)
    return {
        "first discovery": (first_large - first_small) / (LARGE - SMALL),
        "rerun": (rerun_large - rerun_small) / (LARGE - SMALL),
    }


def test_driver_heap_does_not_grow_by_a_python_row_per_image(tmp_path, tiny_model, ray_session, bounded):
    growth = per_image(tmp_path, tiny_model)
    print(f"Python heap peak growth per image: {growth}")
    assert all(v < BOUND for v in growth.values()), growth
