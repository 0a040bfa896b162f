"""Shape validation per bucket: at write time the stage fails with a plain CacheShapeError, at train time a batch
read fails the same way; never a Ray or torch stacking traceback."""

import dataclasses
import json

import cache_sets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayflux.cache import generations, writer
from rayflux.cache.shards import CacheShapeError
from rayflux.train.data import batching
from rayflux.train.data.batching import load_batch


@pytest.fixture(scope="module")
def built(ray_session, tmp_path_factory, tiny_model):
    return cache_sets.shared_cache(tmp_path_factory, tiny_model)


def _refs(gen_dir, bucket: str, n: int) -> list[batching.SampleRef]:
    refs = [r for r in batching.index_samples(generations.load_manifest(str(gen_dir))) if r.bucket == bucket]
    assert len(refs) >= n
    return sorted(refs, key=lambda r: r.sample_id)[:n]


def _batch_item(refs: list[batching.SampleRef]) -> dict:
    """One planned batch of exactly ``refs`` (one bucket), as the feed hands it to a read task."""
    (item,), _ = batching.plan_epoch(refs, len(refs), seed=1, epoch=0, world_size=1)
    return {**item, "step": 0, "total_steps": 1}


def _rows(gen_dir) -> dict[str, dict]:
    m = generations.load_manifest(str(gen_dir))
    return {r["sample_id"]: r for r in pq.ParquetDataset(generations.sample_files(m)).read().to_pylist()}


def _edit_index(gen_dir, sample_id: str, **change) -> None:
    """Rewrite the generation's sample index with plain pyarrow, one sample's entry changed (to make a bad cache)."""
    path = gen_dir / generations.load_manifest(str(gen_dir))["index"]["samples"]["path"]  # named by its build
    table = pq.read_table(path)
    rows = table.to_pylist()
    for r in rows:
        if r["sample_id"] == sample_id:
            r.update(change)
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)


def _expect_named(exc: pytest.ExceptionInfo, row: dict, *parts: str) -> None:
    msg = str(exc.value)
    for part in (f"bucket {row['bucket']}", row["sample_id"], row["source_uri"], *parts):
        assert part in msg, (part, msg)
    assert "Traceback" not in msg and "stack" not in msg


def test_a_good_batch_loads_with_the_stored_values(built):
    refs = _refs(built.gen_dir, "128x128", 3)
    item = _batch_item(refs)
    out = load_batch(item)
    assert json.loads(out["latent_shape"]) == [3, 4, 16, 16]
    stacked = np.frombuffer(out["latent"], np.float32).reshape(3, 4, 16, 16)
    rows = _rows(built.gen_dir)
    for k, sid in enumerate(json.loads(out["sample_ids"])):
        assert stacked[k].tobytes() == rows[sid]["latent"]
    assert sorted(json.loads(out["sample_ids"])) == sorted(r.sample_id for r in refs)


def test_a_batch_says_what_reading_it_cost_and_a_run_of_neighbours_is_one_read(built):
    from rayflux.cache import ranges, reads, tensors

    refs = [r for r in batching.index_samples(generations.load_manifest(str(built.gen_dir))) if r.bucket == "128x128"]
    refs.sort(key=lambda r: (r.file, r.row))
    run = [r for r in refs if r.file == refs[0].file][:3]  # neighbouring rows of one shard: the writer keeps a
    assert [r.row for r in run] == list(range(run[0].row, run[0].row + 3))  # bucket's rows together
    scattered = [next(r for r in refs if r.file == f) for f in sorted({r.file for r in refs})][:3]
    layout = generations.load_manifest(str(built.gen_dir))["layout"]
    # A caption's stored bytes: its text tensors' lengths in the index (compressed ones smaller than their shapes).
    text_bytes = {json.loads(r.text)[2]: sum(p[1] for p in json.loads(r.text)[3]) for r in run}
    latent_bytes = tensors.nbytes((4, 16, 16), layout["dtype"])
    captions = len(text_bytes)
    reads._text_cache.clear()  # what this process read before (other tests) must not hide the text's reads
    reads._text_cache_bytes = 0
    out = load_batch(_batch_item(run))
    used = 3 * latent_bytes + sum(text_bytes[json.loads(r.text)[2]] for r in run)
    assert out["tensor_bytes"] == used
    asked = 3 * latent_bytes + sum(text_bytes.values())  # a caption shared by two samples is read once
    assert asked <= out["read_bytes"] <= asked * 1.05  # holes of a row's small columns, within ranges.WASTE
    # One read for the three latents, and one per caption at most (their text rows may be neighbours too).
    assert 2 <= out["read_requests"] <= 1 + captions
    # Again, the captions now come from the process's cache: only the latents are read. The holes between them
    # (the rows' other columns, about 1.3 KB here) are more than 5% of three 4 KiB latents, so each is its own GET;
    # with the captions' bytes in the same read they were not (and at 1024 px a latent is 512 KiB).
    at = [r.range("latent") for r in run]
    holes = sum(b.offset - a.offset - a.length for a, b in zip(at, at[1:]))
    assert holes > ranges.WASTE * 3 * latent_bytes
    again = load_batch(_batch_item(run))
    assert again["tensor_bytes"] == used and again["read_requests"] == 3 and again["read_bytes"] == 3 * latent_bytes
    if len(scattered) == 3:  # one row of each of three shards: three reads, whatever the merge rule
        assert load_batch(_batch_item(scattered))["read_requests"] >= 3


def test_a_row_with_the_wrong_latent_shape_is_named_at_train_time(built, tmp_path):
    gen = cache_sets.copy_generation(built, tmp_path)
    refs = _refs(gen, "128x128", 3)
    bad = _rows(gen)[refs[1].sample_id]
    _edit_index(gen, bad["sample_id"], latent_h=17)
    with pytest.raises(CacheShapeError) as exc:
        load_batch(_batch_item(_refs(gen, "128x128", 3)))
    _expect_named(exc, bad, "latent shape expected (4, 16, 16)", "got (4, 17, 16)")


def test_truncated_tensor_bytes_are_named_at_train_time(built, tmp_path):
    gen = cache_sets.copy_generation(built, tmp_path)
    refs = _refs(gen, "128x128", 2)
    bad = _rows(gen)[refs[0].sample_id]
    _edit_index(gen, bad["sample_id"], length=refs[0].range("latent").length - 4)
    with pytest.raises(CacheShapeError) as exc:
        load_batch(_batch_item(_refs(gen, "128x128", 2)))
    _expect_named(exc, bad, "latent bytes", "expected 4096", "got 4092")


def test_non_finite_bytes_in_a_shard_are_named_at_train_time(built, tmp_path):
    """NaN bytes whose checksum the index agrees with (a build that wrote them; the writer refuses them, but a cache
    made by hand may not): the read's value check names them. Damage that the index does not agree with is a
    checksum error first (tests/test_cache_integrity.py)."""
    import zlib

    gen = cache_sets.copy_generation(built, tmp_path)
    (ref,) = _refs(gen, "128x128", 1)
    bad = _rows(gen)[ref.sample_id]
    with open(ref.file, "r+b") as f:
        f.seek(ref.range("latent").offset)
        f.write(np.full(4, np.nan, np.float32).tobytes())
        f.seek(ref.range("latent").offset)
        crc = zlib.crc32(f.read(ref.range("latent").length))
    _edit_index(gen, bad["sample_id"], crc32=crc)
    with pytest.raises(CacheShapeError) as exc:
        load_batch(_batch_item(_refs(gen, "128x128", 1)))
    _expect_named(exc, bad, "latent values expected all finite")


def test_a_batch_mixing_buckets_is_refused(built):
    square = _refs(built.gen_dir, "128x128", 1)
    other = next(r for r in batching.index_samples(built.manifest) if r.bucket != "128x128")
    item = _batch_item(square + [dataclasses.replace(other, bucket="128x128")])
    shape = other.latent_shape.replace(",", ", ")
    with pytest.raises(CacheShapeError) as exc:
        load_batch(item)
    _expect_named(exc, {**_rows(built.gen_dir)[other.sample_id], "bucket": "128x128"}, f"got ({shape})")


def test_write_time_rows_with_non_finite_values_are_refused(built, tmp_path):
    """The writer task itself (no Ray needed to call it) returns the error and writes no shard."""
    from rayflux.cache.keys import layout

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
    meta = writer.write_samples(batch, str(tmp_path), layout(built.cfg, built.facts), 0)
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
