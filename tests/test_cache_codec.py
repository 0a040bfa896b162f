"""Text tensors stored compressed (rayflux.cache.codec): written by the real cache stage, recorded in the caption
index, read back bit for bit by training; and a cache written before codecs (raw tensors, no codec columns) still
reads and verifies. Damage to compressed bytes: tests/test_cache_integrity.py."""

import io
import json

import cache_sets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from raw_text import rewrite_without_codecs

from rayflux.cache import codec, generations, index, tensors, verify
from rayflux.train.data import batching
from rayflux.train.data.captions import load_empty


@pytest.fixture(scope="module")
def built(ray_session, tmp_path_factory, tiny_model):
    return cache_sets.shared_cache(tmp_path_factory, tiny_model)


def _read(gen_dir, bucket: str = "128x128") -> dict:
    refs = [r for r in batching.index_samples(generations.load_manifest(str(gen_dir))) if r.bucket == bucket]
    refs.sort(key=lambda r: r.sample_id)
    (item,), _ = batching.plan_epoch(refs, len(refs), seed=1, epoch=0, world_size=1)
    return batching.load_batch({**item, "step": 0, "total_steps": 1})


def _text(out: dict, name: str) -> np.ndarray:
    return np.frombuffer(out[f"text_{name}"], np.float32).reshape(json.loads(out[f"text_{name}_shape"]))


def test_the_codec_round_trips_every_stored_dtype_and_refuses_wrong_sizes():
    rng = np.random.default_rng(0)
    # Rows alike but not equal, as T5's padded positions are: the exponent bytes repeat, the low bytes do not.
    values = (rng.normal(size=(1, 32)) + 1e-3 * rng.normal(size=(64, 32))).astype(np.float32)
    for dtype, raw in [
        ("float32", values.tobytes()),
        ("float16", values.astype(np.float16).tobytes()),
        ("bfloat16", (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()),
    ]:
        stored, used = codec.encode(raw, dtype)
        assert used == codec.SHUFFLE_ZSTD and len(stored) < 0.8 * len(raw), dtype
        assert codec.decode(stored, used, dtype, (64, 32)) == raw
        for bad, shape in [(stored[:-2], (64, 32)), (stored, (63, 32))]:
            with pytest.raises(codec.CodecError):
                codec.decode(bad, used, dtype, shape)
    noise = rng.bytes(128)  # 32 random floats (a tiny CLIP embedding) do not shrink: stored as they are
    assert codec.encode(noise, "float32") == (noise, codec.RAW)
    with pytest.raises(codec.CodecError, match="unknown codec"):
        codec.decode(noise, "lz4", "float32", (32,))


def test_compressed_text_tensors_read_back_bit_for_bit_as_the_encoder_made_them(built):
    """Through the real cache stage (its text pass compresses) and a training read (which checks, then decodes)."""
    from rayflux.cache.encoders import TextEncoder

    manifest = generations.load_manifest(built.gen_dir)
    captions = index.read(manifest, "captions").to_pylist()
    # The index records each tensor's codec: T5's embedding shrinks, the tiny CLIP's 32 floats do not.
    assert {c["t5_codec"] for c in captions} == {codec.SHUFFLE_ZSTD}
    assert {c["clip_codec"] for c in captions} == {codec.RAW}
    for c in captions:
        assert c["t5_length"] < 0.8 * tensors.nbytes((c["t5_len"], c["t5_dim"]), "float32")
        assert c["clip_length"] == tensors.nbytes((c["clip_dim"],), "float32")
    # The encoder's own bytes, for the same captions in the same batches as the text pass ran them.
    encoder = TextEncoder(built.cfg.model, "float32", built.facts, "check")
    made = {}
    for path in generations.text_files(manifest):
        rows = pq.read_table(path, columns=["caption_id", "caption"]).to_pydict()
        out = encoder(rows)
        made.update({cid: (out["t5"][i], out["clip_pooled"][i]) for i, cid in enumerate(rows["caption_id"])})
    out = _read(built.gen_dir)
    ids = json.loads(out["sample_ids"])
    by_sample = {r.sample_id: json.loads(r.text)[2] for r in batching.index_samples(manifest)}
    assert len({by_sample[s] for s in ids}) >= 2  # several captions in the batch
    for k, sid in enumerate(ids):
        t5, clip = made[by_sample[sid]]
        assert _text(out, "t5")[k].tobytes() == t5 and _text(out, "clip_pooled")[k].tobytes() == clip
    empty = load_empty(index.empty_caption(manifest))
    assert empty.text["t5"].numpy().tobytes() == made[manifest["empty_caption"]["caption_id"]][0]


def test_a_cache_written_before_codecs_still_reads_verifies_and_joins_a_new_index(built, tmp_path):
    gen = cache_sets.copy_generation(built, tmp_path)
    rewrite_without_codecs(gen)  # raw text, no codec columns, as written before codecs
    manifest = generations.load_manifest(str(gen))
    captions = index.read(manifest, "captions")
    assert not [n for n in captions.column_names if n.endswith("_codec")]
    assert all(c["t5_length"] == tensors.nbytes((c["t5_len"], c["t5_dim"]), "float32") for c in captions.to_pylist())
    out, want = _read(gen), _read(built.gen_dir)
    for name in ("latent", "text_t5", "text_clip_pooled"):
        assert out[name] == want[name], name
    raw_empty = load_empty(index.empty_caption(manifest)).text["t5"]
    assert raw_empty.equal(load_empty(index.empty_caption(built.manifest)).text["t5"])
    text = io.StringIO()
    assert verify.main([str(gen)], out=text) == 0, text.getvalue()
    # A new generation reusing these captions (text_input's known rows) records them as what they are: raw.
    sink = index.Sink("captions", built.facts.text)
    try:
        sink.add(captions)
        sink._close_spool()
        joined = pa.ipc.open_stream(pa.OSFile(sink.path)).read_all()
        assert set(joined["t5_codec"].to_pylist()) == {codec.RAW} and joined.num_rows == captions.num_rows
    finally:
        sink.discard()
