"""Shape validation per bucket: at write time the stage fails with a plain CacheShapeError, at train time a batch
read fails the same way; never a Ray or torch stacking traceback."""

import dataclasses
import json

import cache_sets
import numpy as np
import pyarrow.parquet as pq
import pytest

from rayflux.cache import generations, shards, writer
from rayflux.cache.shards import CacheShapeError
from rayflux.train.batching import load_batch


@pytest.fixture(scope="module")
def built(ray_session, tmp_path_factory, tiny_model):
    return cache_sets.shared_cache(tmp_path_factory, tiny_model)


def _batch_item(shard, rows, bucket) -> dict:
    refs = [[str(shard), i, r["sample_id"]] for i, r in rows]
    return {"refs": json.dumps(refs), "bucket": bucket, "epoch": 0, "index": 0, "seed": 1, "step": 0, "total_steps": 1}


def _pick(shard, bucket: str, n: int) -> list[tuple[int, dict]]:
    rows = [(i, r) for i, r in enumerate(pq.read_table(shard).to_pylist()) if r["bucket"] == bucket]
    assert len(rows) >= n
    return rows[:n]


def _expect_named(exc: pytest.ExceptionInfo, row: dict, *parts: str) -> None:
    msg = str(exc.value)
    for part in (f"bucket {row['bucket']}", row["sample_id"], row["source_uri"], *parts):
        assert part in msg, (part, msg)
    assert "Traceback" not in msg and "stack" not in msg


def test_a_good_batch_loads_with_the_stored_values(built):
    shard = generations.sample_files(built.manifest)[0]
    rows = _pick(shard, "128x128", 3)
    out = load_batch(_batch_item(shard, rows, "128x128"))
    assert json.loads(out["latent_shape"]) == [3, 4, 16, 16]
    stacked = np.frombuffer(out["latent"], np.float32).reshape(3, 4, 16, 16)
    for k, (_, r) in enumerate(rows):
        assert stacked[k].tobytes() == r["latent"]


def test_a_row_with_the_wrong_latent_shape_is_named_at_train_time(built, tmp_path):
    shard = cache_sets.first_shard(cache_sets.copy_generation(built, tmp_path))
    rows = _pick(shard, "128x128", 3)
    target = rows[1][0]

    def grow(all_rows):
        all_rows[target]["latent_h"] = 17
        all_rows[target]["latent"] += b"\0" * (4 * 16 * 4)  # bytes consistent with the wrong shape

    bad = cache_sets.rewrite_rows(shard, grow)[target]
    with pytest.raises(CacheShapeError) as exc:
        load_batch(_batch_item(shard, rows, "128x128"))
    _expect_named(exc, bad, "latent shape expected (4, 16, 16)", "got (4, 17, 16)")


def test_truncated_tensor_bytes_are_named_at_train_time(built, tmp_path):
    shard = cache_sets.first_shard(cache_sets.copy_generation(built, tmp_path))
    rows = _pick(shard, "128x128", 2)
    target = rows[0][0]

    def cut(all_rows):
        all_rows[target]["latent"] = all_rows[target]["latent"][:-4]

    bad = cache_sets.rewrite_rows(shard, cut)[target]
    with pytest.raises(CacheShapeError) as exc:
        load_batch(_batch_item(shard, rows, "128x128"))
    _expect_named(exc, bad, "latent bytes", "expected 4096", "got 4092")


def test_a_batch_mixing_buckets_is_refused(built):
    shard = generations.sample_files(built.manifest)[0]
    table = pq.read_table(shard).to_pylist()
    square = next((i, r) for i, r in enumerate(table) if r["bucket"] == "128x128")
    other = next((i, r) for i, r in enumerate(table) if r["bucket"] != "128x128")
    with pytest.raises(CacheShapeError) as exc:
        load_batch(_batch_item(shard, [square, other], "128x128"))
    _expect_named(exc, {**other[1], "bucket": "128x128"}, f"got {other[1]['bucket']}")


def test_write_time_rows_with_non_finite_values_are_refused(built, tmp_path):
    """The writer task itself (no Ray needed to call it) returns the error and writes no shard."""
    from rayflux.cache.stage import layout

    row = pq.read_table(generations.sample_files(built.manifest)[0]).to_pylist()[0]
    latent = np.frombuffer(row["latent"], np.float32).copy()
    latent[5] = np.inf
    batch = {k: np.array([v], dtype=object) for k, v in row.items()}
    batch.update(
        uri=np.array([row["source_uri"]], dtype=object),
        skip_reason=np.array([""], dtype=object),
        reuse=np.array([False]),
        latent=np.array([latent.tobytes()], dtype=object),
    )
    text_files = tuple(generations.text_files(built.manifest))
    meta = writer.write_samples(batch, str(tmp_path), layout(built.cfg, built.facts), text_files, {}, 0)
    assert meta["rows"] == [0] and meta["path"] == [""]
    for part in (f"bucket {row['bucket']}", row["sample_id"], row["source_uri"], "latent values"):
        assert part in meta["error"][0]
    assert not (tmp_path / "samples").exists()


def test_the_stage_fails_with_a_plain_shape_error_and_commits_nothing(ray_session, tiny_model, tmp_path):
    """A model whose VAE disagrees with the bucket prediction (one latent channel short) stops the build."""
    from rayflux import models

    images = tmp_path / "images"
    images.mkdir()
    for k in range(2):
        cache_sets.picture(64, 64, k).save(images / f"img{k}.png")
    cfg = cache_sets.job_config(tiny_model, images, tmp_path, "data.resolution=64")
    facts = models.model_facts(cfg.model)
    wrong = dataclasses.replace(facts, latent_channels=facts.latent_channels + 1)
    with pytest.raises(CacheShapeError) as exc:
        cache_sets.build(cfg, facts=wrong)
    msg = str(exc.value)
    assert "bucket 64x64: sample " in msg and str(images) in msg
    assert "latent shape expected (5, 8, 8), got (4, 8, 8)" in msg
    assert not list((tmp_path / "cache").rglob(generations.MANIFEST))


def test_shard_without_layout_metadata_is_refused(built, tmp_path):
    shard = cache_sets.first_shard(cache_sets.copy_generation(built, tmp_path))
    table = pq.read_table(shard)
    pq.write_table(table.replace_schema_metadata(None), shard, row_group_size=1)
    rows = _pick(shard, "128x128", 1)
    with pytest.raises(CacheShapeError, match="no rayflux layout metadata"):
        load_batch(_batch_item(shard, rows, "128x128"))
    assert shards.layout_of(pq.read_schema(shard)) is None
