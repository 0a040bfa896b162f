"""What the cache stage writes: one sample per row, tensors the encoders really produced, readable with plain pyarrow.

Everything here reads the shared mixed-dataset cache (built once, cache batch size 8) with pyarrow directly.
"""

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import cache_sets
import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from rayflux import buckets
from rayflux.cache import generations, shards
from rayflux.cache.prepare import prepare_row, sample_id

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(ray_session, tmp_path_factory, tiny_model):
    return cache_sets.shared_cache(tmp_path_factory, tiny_model)


@pytest.fixture(scope="module")
def rows(built):
    return pq.ParquetDataset(generations.sample_files(built.manifest)).read().to_pylist()


def _chunk_sizes(path: str, column: str) -> list[int]:
    """Bytes the Parquet file spends on ``column`` in each row group, from the file's own metadata."""
    md = pq.ParquetFile(path).metadata
    sizes = []
    for i in range(md.num_row_groups):
        rg = md.row_group(i)
        assert rg.num_rows == 1, "one sample per row group"
        (chunk,) = [rg.column(j) for j in range(rg.num_columns) if rg.column(j).path_in_schema == column]
        sizes.append(chunk.total_compressed_size)
    return sizes


def test_each_row_stores_only_its_own_latent(built):
    assert built.cfg.cache.batch_size == 8
    checked = 0
    for path in generations.sample_files(built.manifest):
        shapes = pq.read_table(path, columns=["latent_c", "latent_h", "latent_w", "latent_dtype"]).to_pylist()
        lengths = pc.binary_length(pq.read_table(path, columns=["latent"])["latent"]).to_pylist()
        for s, stored, length in zip(shapes, _chunk_sizes(path, "latent"), lengths):
            raw = s["latent_c"] * s["latent_h"] * s["latent_w"] * np.dtype(s["latent_dtype"]).itemsize
            assert length == raw
            assert raw <= stored <= 1.02 * raw, (path, s, stored)
            checked += 1
    # More rows than one encoder batch, so rows really were sliced out of shared batches.
    assert checked == built.manifest["cached"] > built.cfg.cache.batch_size


def test_text_embeddings_are_stored_once_per_caption_not_per_sample(built):
    for path in generations.sample_files(built.manifest):
        assert not {"t5", "clip_pooled"} & set(pq.read_schema(path).names)
    for path in generations.text_files(built.manifest):
        # Each row's chunks hold its own stored tensors (compressed or not, rayflux.cache.codec) and nothing more.
        table = pq.read_table(path, columns=["t5", "clip_pooled"])
        values = zip(*(pc.binary_length(table[c]).to_pylist() for c in ("t5", "clip_pooled")))
        for (t5_value, clip_value), t5, clip in zip(
            values, _chunk_sizes(path, "t5"), _chunk_sizes(path, "clip_pooled")
        ):
            stored = t5_value + clip_value
            assert stored <= t5 + clip <= 1.02 * stored + 64


def test_the_index_locates_every_tensor_byte_for_byte(built, rows):
    """Each index row's offset/length is exactly its tensor's bytes inside the shard, as training reads them."""
    from rayflux.cache import index

    samples = {r["sample_id"]: r for r in index.read(built.manifest, "samples").to_pylist()}
    assert sorted(samples) == sorted(r["sample_id"] for r in rows)
    for r in rows:
        e = samples[r["sample_id"]]
        path = index.resolve(built.manifest, e["file"])
        assert Path(path).stat().st_size == e["file_bytes"]
        with open(path, "rb") as f:
            f.seek(e["offset"])
            assert f.read(e["length"]) == r["latent"]
        assert (e["bucket"], e["caption_id"], e["rel_path"]) == (r["bucket"], r["caption_id"], r["rel_path"])
    text = {t["caption_id"]: t for t in pq.ParquetDataset(generations.text_files(built.manifest)).read().to_pylist()}
    captions = index.read(built.manifest, "captions").to_pylist()
    assert sorted(c["caption_id"] for c in captions) == sorted(text)
    for c in captions:
        with open(index.resolve(built.manifest, c["file"]), "rb") as f:
            f.seek(c["t5_offset"])
            assert f.read(c["t5_length"]) == text[c["caption_id"]]["t5"]
            f.seek(c["clip_offset"])
            assert f.read(c["clip_length"]) == text[c["caption_id"]]["clip_pooled"]
    assert built.manifest["empty_caption"]["caption"] == "" and text[built.manifest["empty_caption"]["caption_id"]]


def test_decoded_rows_equal_the_encoders_own_output(built, rows):
    """The VAE returns channels-last latents; the stored bytes must still be each sample's CHW tensor."""
    import torch

    from rayflux import models
    from rayflux.cache.encoders import VaeEncoder
    from rayflux.cache.keys import bucket_spec

    same = [r for r in rows if r["bucket"] == "128x128"]
    assert len(same) >= 5
    spec = bucket_spec(built.cfg, built.facts)
    seed, limit = built.cfg.cache.seed, cache_sets.MAX_PIXELS
    prepared = [prepare_row({"uri": r["source_uri"], "rel_path": r["rel_path"]}, spec, seed, limit) for r in same]
    assert [p["sample_id"] for p in prepared] == [r["sample_id"] for r in same]
    pixels = np.stack([np.frombuffer(p["pixels"], np.uint8).reshape(128, 128, 3) for p in prepared])
    z = VaeEncoder(built.cfg.model, "float32", "check").encode(pixels, [p["sample_id"] for p in prepared])
    assert not z.is_contiguous()  # the trap is live: storage order is not CHW
    # Batch composition and the actor's thread count move convolution results by float rounding (up to a few 1e-4
    # in fp32, about 1e-2 where the VAE runs in bf16, as it does by default on CPUs that compute bf16 natively),
    # nothing more; a layout error moves them by the latents' own scale (tenths).
    tol = 2e-3 if models.vae_dtype(built.cfg.model, "cpu") == torch.float32 else 3e-2
    for j, r in enumerate(same):
        stored = np.frombuffer(r["latent"], r["latent_dtype"]).reshape(r["latent_c"], r["latent_h"], r["latent_w"])
        np.testing.assert_allclose(stored, z[j].numpy(), rtol=tol / 2, atol=tol)
        assert not np.allclose(stored, z[(j + 1) % len(same)].numpy(), rtol=tol / 2, atol=tol)  # not a neighbour's
        # Serialising the clone's storage (what a careless writer does) gives other numbers: this check can fail.
        naive = np.frombuffer(bytes(z[j].clone().untyped_storage()), np.float32)[: stored.size].reshape(stored.shape)
        assert not np.allclose(naive, stored, rtol=1e-3, atol=2e-4)


def test_plain_pyarrow_rebuilds_every_tensor_as_the_docs_show(built, rows):
    """The snippet of docs/cache-shards.md, run as-is in a fresh interpreter that never imports Ray or torch."""
    section = (ROOT / "docs" / "cache-shards.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    code = snippet.replace('"<cache.dir>/<cache key>/g00000-..."', repr(str(built.gen_dir))) + (
        "import sys, json\n"
        "print(json.dumps({'shapes': [latent.shape, t5.shape, clip.shape], 'sum': float(latent.sum()),"
        " 't5': float(t5.astype('float64').sum()), 'codec': c['t5_codec'],"
        " 'heavy': sorted(m for m in ('ray', 'torch') if m in sys.modules)}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    from rayflux.cache import index

    entry = index.read(built.manifest, "samples").to_pylist()[0]
    first = [r for r in rows if r["sample_id"] == entry["sample_id"]][0]
    latent = np.frombuffer(first["latent"], np.float32).reshape(first["latent_c"], first["latent_h"], first["latent_w"])
    text = pq.ParquetDataset(generations.text_files(built.manifest)).read().to_pylist()
    (caption,) = [t for t in text if t["caption_id"] == first["caption_id"]]
    assert got["heavy"] == []
    assert got["shapes"] == [list(latent.shape), [caption["t5_len"], caption["t5_dim"]], [caption["clip_dim"]]]
    assert got["sum"] == pytest.approx(float(latent.sum()), rel=1e-6)
    # The snippet undoes the text tensors' compression as rayflux does (rayflux.cache.codec).
    from rayflux.cache import codec

    shape = (caption["t5_len"], caption["t5_dim"])
    t5 = np.frombuffer(codec.decode(caption["t5"], got["codec"], "float32", shape), np.float32)
    assert got["codec"] == codec.SHUFFLE_ZSTD and got["t5"] == float(t5.astype(np.float64).sum())


def test_the_docs_document_every_column(built):
    documented = set(re.findall(r"`([a-z0-9_]+)`", (ROOT / "docs" / "cache-shards.md").read_text()))
    missing = [c for c in shards.SAMPLE_SCHEMA.names if c not in documented]
    assert not missing


def test_shards_describe_their_own_layout(built):
    for path in generations.sample_files(built.manifest) + generations.text_files(built.manifest):
        layout = shards.layout_of(pq.read_schema(path))
        assert layout is not None
        assert layout == shards.ShardLayout(**{**built.manifest["layout"], "kind": layout.kind})
        assert [t.name for t in layout.text] == ["t5", "clip_pooled"]  # the tiny FLUX.1's named text tensors


def test_text_embeddings_are_encoded_once_per_unique_caption(built, rows):
    m = built.manifest
    captions = {e.caption for e in built.expected.values() if e.caption is not None}
    assert len(rows) > len(captions)  # duplicates exist, so a per-sample encoder would have done more passes
    text = pq.ParquetDataset(generations.text_files(m)).read()
    ids = text["caption_id"].to_pylist()
    assert len(ids) == len(set(ids))
    # Every text row is one pass of the text encoder, stamped by the encoder itself; plus the dropout caption "".
    assert sorted(text["caption"].to_pylist()) == sorted(captions | {""})
    assert set(text["encode_id"].to_pylist()) == {m["encode_id"]}
    assert m["encoded"]["captions"] == len(captions) + 1 == m["unique_captions"]
    by_id = {r["caption_id"]: r for r in text.to_pylist()}
    for r in rows:
        assert r["caption"] == by_id[r["caption_id"]]["caption"]


def test_every_input_is_cached_or_skipped_with_its_reason(built, rows):
    m = built.manifest
    cached = {r["rel_path"]: r for r in rows}
    skipped = generations.load_skipped(built.gen_dir)
    assert m["cached"] + m["skipped"] == m["discovered"] == len(built.expected)
    assert len(cached) == m["cached"] and len(skipped) == m["skipped"] and skipped == m["skipped_inputs"]
    reasons = {str(Path(s["source_uri"]).relative_to(built.images)): s["reason"] for s in skipped}
    for rel, exp in built.expected.items():
        if exp.skip:
            assert exp.skip in reasons[rel], (rel, reasons.get(rel))
        else:
            assert cached[rel]["caption"] == exp.caption


def test_same_named_files_in_different_folders_never_collide(built, rows):
    by_rel = {r["rel_path"]: r for r in rows}
    photos = [by_rel[f"{d}/photo.png"] for d in "abc"]
    assert len({p["sample_id"] for p in photos}) == 3
    for p in photos:
        data = (built.images / p["rel_path"]).read_bytes()
        assert p["source_sha256"] == hashlib.sha256(data).hexdigest()
    assert photos[0]["latent"] != photos[1]["latent"]
    assert photos[0]["source_sha256"] == photos[2]["source_sha256"]  # same bytes, still two samples
    assert photos[0]["caption"] != photos[2]["caption"]


def test_every_row_has_the_geometry_and_id_the_bucket_function_gives(built, rows):
    from rayflux.cache.keys import bucket_spec

    spec = bucket_spec(built.cfg, built.facts)
    for r in rows:
        p = buckets.plan(r["orig_w"], r["orig_h"], spec, seed=built.cfg.cache.seed, salt=r["rel_path"])
        assert r["bucket"] == p.key
        assert (r["crop_left"], r["crop_top"], r["crop_w"], r["crop_h"]) == (
            p.crop_left,
            p.crop_top,
            p.crop_width,
            p.crop_height,
        )
        assert (r["latent_c"], r["latent_h"], r["latent_w"]) == p.latent_shape
        assert r["sample_id"] == sample_id(r["rel_path"], r["source_sha256"], p)
    assert len({r["bucket"] for r in rows}) >= 3


def test_exif_orientation_is_applied_before_bucketing(built, rows):
    (r,) = [r for r in rows if r["rel_path"] == "exif/rotated.jpg"]
    assert (r["orig_w"], r["orig_h"]) == (128, 192)  # stored 192x128, shown upright as portrait
    assert r["target_h"] > r["target_w"]


def test_a_declared_dummy_tensor_reaches_the_steps_batch(ray_session, tiny_model, tmp_path, monkeypatch):
    """Adding a per-sample tensor costs its declaration, a producer and a consumer, all in this test: a real build
    writes it in each row with its byte range in the index (the writer's check included), and a real read brings it
    to the step's batch beside the latent, from the same ranged read."""
    from rayflux.cache import layout
    from rayflux.train import step
    from rayflux.train.data import batching

    def produce(row: dict) -> bytes:  # the producer: a value the consumer can recompute from the row
        return np.full((2, row["latent_h"], row["latent_w"]), row["orig_w"] % 97, np.float32).tobytes()

    dummy = layout.SampleTensor("dummy", (2, "h", "w"), key="dummy_", dtype="float32", produce=produce)
    monkeypatch.setattr(layout, "SAMPLE_TENSORS", (*layout.SAMPLE_TENSORS, dummy))  # the declaration
    images = tmp_path / "images"
    images.mkdir()
    for k, (w, h) in enumerate([(96, 64), (64, 64), (100, 64)]):
        cache_sets.picture(w, h, k).save(images / f"{k}.png")
    cfg = cache_sets.job_config(tiny_model, images, tmp_path, "data.resolution=64", "data.missing_caption=filename")
    _, manifest = cache_sets.build(cfg)
    refs = {r.sample_id: r for r in batching.index_samples(manifest)}
    orig_w = {r["sample_id"]: r["orig_w"] for r in cache_sets.generation_rows(manifest)}
    plan, _ = batching.plan_epoch(list(refs.values()), 1, seed=0, epoch=0, world_size=1)
    assert len(plan) == 3
    for item in plan:
        row = batching.load_batch({**item, "step": 0, "total_steps": 1})
        batch = step.from_item(row)
        got = batch.tensors["dummy"]  # the consumer
        (sid,) = json.loads(row["sample_ids"])
        assert got.shape == (1, 2, *batch.latents.shape[2:]) and bool((got == orig_w[sid] % 97).all())
        latent, extra = refs[sid].range("latent"), refs[sid].range("dummy")
        assert extra.length == got.numel() * 4 and row["read_requests"] <= 2  # the latent's read, and its caption's
        assert 0 < extra.offset - latent.offset - latent.length < 1024  # the same row group, right after the latent
