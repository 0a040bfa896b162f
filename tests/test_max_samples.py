"""``max_samples`` draws among usable images, inside Ray tasks, and caption files are read there, not on the driver.

Real images, some of them bad (too small, truncated, empty, not an image), on local disk, settled by real Ray Data
tasks of a few images each, so that the tasks' local draws and the driver's merge are both exercised.
"""

import cache_sets
import pytest

from rayflux import config, models
from rayflux.discovery import in_process, subset
from rayflux.cache import discover

GOOD = 7
BAD = {
    "tiny.png": cache_sets.encoded(cache_sets.picture(32, 32, 90), "PNG"),  # under min_image_size
    "half.png": cache_sets.encoded(cache_sets.picture(96, 96, 91), "PNG")[:300],  # truncated download
    "empty.png": b"",
    "page.jpg": b"<html>not found</html>",
}


def _dataset(root):
    root.mkdir(parents=True)
    for i in range(GOOD):
        (root / f"good{i}.png").write_bytes(cache_sets.encoded(cache_sets.picture(64 + 16 * (i % 2), 64, i), "PNG"))
        (root / f"good{i}.txt").write_text(f"good picture {i}\nanother caption of {i}\n")
    for name, data in BAD.items():
        (root / name).write_bytes(data)
        (root / f"{name.rsplit('.', 1)[0]}.txt").write_text("a bad picture")
    return root


def _cfg(tiny_model, root, *extra):
    return config.load(None, [f"model.path={tiny_model}", f"data.images_dir={root}", "data.resolution=64", *extra])


@pytest.fixture
def small_tasks(monkeypatch):
    monkeypatch.setattr(discover, "_IMAGES_PER_TASK", 3)  # several tasks, each drawing its own part


def _usable_order(root) -> list[str]:
    """The usable images in draw order, computed here from the names alone."""
    return sorted((f"good{i}.png" for i in range(GOOD)), key=subset.rank)


def test_the_cap_is_exact_among_usable_images_and_stable(tmp_path, tiny_model, ray_session, small_tasks):
    root = _dataset(tmp_path / "images")
    cfg = _cfg(tiny_model, root, "data.max_samples=4")
    facts = models.model_facts(cfg.model)
    first = discover.discover(cfg, facts, seed=1)
    picked = [s.rel_path for s in first.sources]
    assert picked == sorted(_usable_order(root)[:4])
    assert first.unsampled == {"images": GOOD - 4}
    # Every bad image is a recorded skip with its reason, whether or not the draw would have picked it.
    reasons = {s["source_uri"].rsplit("/", 1)[-1]: s["reason"] for s in first.skipped}
    assert set(reasons) == set(BAD)
    assert "min_image_size" in reasons["tiny.png"] and "zero-byte" in reasons["empty.png"]
    assert "truncated" in reasons["half.png"] or "decodable" in reasons["half.png"]
    assert first.discovered == 4 + len(BAD)
    # Another seed (a refresh generation) draws the same images; the captions were read from the sidecars.
    again = discover.discover(cfg, facts, seed=2)
    assert [s.rel_path for s in again.sources] == picked
    assert all(
        s.caption in (f"good picture {n}", f"another caption of {n}") for s in first.sources for n in [s.rel_path[4:-4]]
    )


def test_fewer_usable_than_asked_uses_all_and_says_so(tmp_path, tiny_model, ray_session, small_tasks):
    root = _dataset(tmp_path / "images")
    cfg = _cfg(tiny_model, root, "data.max_samples=20")
    found = discover.discover(cfg, models.model_facts(cfg.model), seed=0)
    assert sorted(s.rel_path for s in found.sources) == sorted(_usable_order(root))
    assert not found.unsampled
    assert any("max_samples=20, but only 7" in p and f"({len(BAD)} skipped)" in p for p in found.problems)


def test_tasks_settle_captions_as_the_driver_would(tmp_path, tiny_model, ray_session, small_tasks):
    """Without a cap, the tasks read the sidecars: the same sources, captions and skips as settling in-process."""
    root = _dataset(tmp_path / "images")
    (root / "latin.png").write_bytes(cache_sets.encoded(cache_sets.picture(64, 64, 40), "PNG"))
    (root / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    cfg = _cfg(tiny_model, root)
    remote = discover.discover(cfg, models.model_facts(cfg.model), seed=5)
    local = in_process.discover(cfg.data, seed=5)
    assert remote.sources == local.sources and len(remote.sources) == GOOD + len(BAD)
    assert remote.skipped == local.skipped
    assert [s["source_uri"].rsplit("/", 1)[-1] for s in remote.skipped] == ["latin.png"]
    assert remote.skipped[0]["reason"].startswith("caption file is not UTF-8")
