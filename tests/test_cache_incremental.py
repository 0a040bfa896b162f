"""Incremental caching through the job: a rerun encodes nothing, a touched file is known by its content, and only new
images and captions reach an encoder. A generation directory without a manifest is never read or reused."""

import io
import os
from pathlib import Path

import cache_sets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayflux import job, models
from rayflux.cache import generations, verify
from rayflux.cache.stage import inputs_signature
from rayflux.cache.keys import cache_key
from rayflux.discovery.in_process import discover

CAPTIONS = {"a": "a red circle", "b": "a blue square", "c": "a red circle", "d": "a green ring"}


def _write(images: Path, name: str, seed: int, caption: str) -> None:
    cache_sets.picture(96, 64, seed).save(images / f"{name}.png")
    (images / f"{name}.txt").write_text(caption)


def _rows(manifest: dict) -> dict[str, dict]:
    return {r["rel_path"]: r for r in cache_sets.generation_rows(manifest)}


def _text(manifest: dict) -> dict[str, dict]:
    return {r["caption"]: r for r in cache_sets.generation_text(manifest)}


def _mtimes(gen_dir: str) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in Path(gen_dir).rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def runs(ray_session, tiny_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("incremental")
    images = base / "images"
    images.mkdir()
    for k, (name, caption) in enumerate(CAPTIONS.items()):
        _write(images, name, k, caption)
    cfg = cache_sets.job_config(tiny_model, images, base, "data.resolution=64")
    key_dir = base / "cache" / cache_key(cfg, models.model_facts(cfg.model))
    first_dir = key_dir / f"g00000-{inputs_signature(discover(cfg.data, seed=cfg.cache.seed))}"
    # What crashed builds leave: shards without a manifest, in the very directory the job will build, and in a
    # directory numbered higher than any committed generation.
    junk = pa.table({"sample_id": ["junk"], "latent": [b"\0" * 8]})
    for gen in (first_dir, key_dir / "g00009-0123456789abcdef"):
        (gen / "samples").mkdir(parents=True)
        pq.write_table(junk, gen / "samples" / "samples-crashed.parquet")

    out = {"key_dir": key_dir, "first_dir": first_dir, "images": images, "cfg": cfg}
    out["first"] = job.run(cfg, only="cache")
    out["first_mtimes"] = _mtimes(out["first"].cache_dir)
    out["first_manifest"] = generations.load_manifest(out["first"].cache_dir)
    out["same"] = job.run(cfg, only="cache")
    out["dirs_after_same"] = sorted(p.name for p in key_dir.iterdir() if p.is_dir())  # not the lease's lock file
    for p in images.iterdir():
        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    out["touched"] = job.run(cfg, only="cache")
    _write(images, "e", 9, "a yellow cross")
    (images / "b.txt").write_text("a blue square, edited")
    out["grown"] = job.run(cfg, only="cache")
    # Output preservation turned on (issue 45): its class prompts are captions the generation must hold.
    words = ("train.flow.preservation=class", "data.trigger_word=red", "data.class_word=coloured")
    other_run = f"run.output_dir={base / 'preserved'}"  # another run (identity), the same cache.dir
    out["preserved_cfg"] = cache_sets.job_config(tiny_model, images, base, "data.resolution=64", other_run, *words)
    out["preserved"] = job.run(out["preserved_cfg"], only="cache")
    return out


def test_an_uncommitted_generation_is_never_read_or_reused(runs):
    first = runs["first"]
    assert first.cache_dir == str(runs["first_dir"])
    manifest = runs["first_manifest"]
    assert [f["path"] for f in manifest["files"]] and all("crashed" not in f["path"] for f in manifest["files"])
    assert set(_rows(manifest)) == {f"{n}.png" for n in CAPTIONS}
    assert not (runs["first_dir"] / "samples" / "samples-crashed.parquet").exists()  # discarded, not adopted
    # The higher-numbered crashed directory is never the source of a later build, nor "the latest" to a reader.
    crashed = str(runs["key_dir"] / "g00009-0123456789abcdef")
    sources = [generations.load_manifest(runs[r].cache_dir)["reused"]["from"] for r in ("touched", "grown")]
    assert crashed not in sources and (runs["key_dir"] / "g00009-0123456789abcdef").is_dir()
    assert generations.latest_committed(str(runs["key_dir"]))["dir"] == runs["preserved"].cache_dir
    text = io.StringIO()
    assert verify.main([str(runs["key_dir"])], out=text) == 0
    assert f"{crashed}: uncommitted" in text.getvalue()


def test_a_rerun_with_the_same_inputs_encodes_nothing(runs):
    first, same = runs["first"], runs["same"]
    assert same.cache_dir == first.cache_dir
    assert generations.load_manifest(same.cache_dir)["committed_at"] == runs["first_manifest"]["committed_at"]
    assert _mtimes(same.cache_dir) == runs["first_mtimes"]  # not one file rewritten
    assert runs["dirs_after_same"] == sorted([runs["first_dir"].name, "g00009-0123456789abcdef"])  # no new one


def test_touched_files_are_recognised_by_content_and_referenced_not_encoded(runs):
    old = runs["first_manifest"]
    new = generations.load_manifest(runs["touched"].cache_dir)
    assert runs["touched"].cache_dir not in (runs["first"].cache_dir, runs["grown"].cache_dir)
    assert new["encoded"] == {"samples": 0, "captions": 0}
    assert new["reused"]["samples"] == 4 and new["reused"]["from"] == runs["first"].cache_dir
    old_rows, new_rows = _rows(old), _rows(new)
    for rel, row in new_rows.items():
        assert row["encode_id"] == old["encode_id"]  # stamped by the first build's encoder, not this one's
        assert row["latent"] == old_rows[rel]["latent"]
    assert {r["encode_id"] for r in _text(new).values()} == {old["encode_id"]}
    # Referenced where the first build wrote them, not copied: the new generation wrote no shard at all.
    assert new["files"] == [] and new["text_files"] == []
    first = generations.generation_name(runs["first"].cache_dir)
    assert new["borrowed"] and all(f.startswith(first + "/") for f in new["borrowed"])


def test_only_new_images_and_changed_captions_are_encoded(runs):
    grown = runs["grown"]
    m = generations.load_manifest(grown.cache_dir)
    assert m["reused"]["from"] == runs["touched"].cache_dir
    rows = _rows(m)
    fresh = sorted(rel for rel, r in rows.items() if r["encode_id"] == m["encode_id"])
    assert fresh == ["e.png"] and m["encoded"]["samples"] == 1
    text = _text(m)
    assert sorted(c for c, r in text.items() if r["encode_id"] == m["encode_id"]) == [
        "a blue square, edited",
        "a yellow cross",
    ]
    assert m["encoded"]["captions"] == 2
    # The edited caption's image keeps its latent but carries the new caption's embedding.
    assert rows["b.png"]["caption"] == "a blue square, edited"
    assert rows["b.png"]["t5"] == text["a blue square, edited"]["t5"]
    assert verify.main([grown.cache_dir], out=io.StringIO()) == 0


def test_the_summary_accounts_for_every_discovered_image(runs):
    grown = runs["grown"]
    assert grown.discovered == grown.cached + grown.skipped == 5
    assert grown.lines()[0] == "images: 5 discovered, 5 cached, 0 skipped"


def test_the_cache_key_follows_what_shapes_tensors_not_caption_rules(tiny_model, tmp_path):
    def key(*extra: str) -> str:
        cfg = cache_sets.job_config(tiny_model, tmp_path, tmp_path / "out", *extra)
        return cache_key(cfg, models.model_facts(cfg.model))

    base = key()
    # Caption rules change which captions a generation holds; those are re-encoded incrementally, not the latents.
    assert key("data.missing_caption=empty", "data.caption_ext=.caption") == base
    for changed in ("data.resolution=256", "data.crop=random", "data.alignment=32", "cache.dtype=bfloat16"):
        assert key(changed) != base, changed


def test_unchanged_caption_files_are_taken_from_the_generation_not_read(runs, ray_session):
    from rayflux.cache import discover

    m = generations.load_manifest(runs["grown"].cache_dir)
    assert m["index"]["sidecars"]["rows"] == 5
    cfg = runs["cfg"]
    # Same size, same mtime, other words: only a read could see the change, and discovery must not read it.
    path = runs["images"] / "d.txt"
    st = path.stat()
    path.write_text("a green rung")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    try:
        facts = models.model_facts(cfg.model)
        kept = {s.rel_path: s.caption for s in discover.discover(cfg, facts, cfg.cache.seed, m).sources}
        read = {s.rel_path: s.caption for s in discover.discover(cfg, facts, cfg.cache.seed).sources}
    finally:
        path.write_text(CAPTIONS["d"])
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert kept["d.png"] == "a green ring" and read["d.png"] == "a green rung"
    assert kept["b.png"] == read["b.png"] == "a blue square, edited"


def test_output_preservation_encodes_its_class_prompts_and_reuses_no_generation_without_them(runs):
    """``train.preservation=class``: each caption's class prompt ("a red circle" -> "a coloured circle") is one more
    text row, encoded in the generation's text pass. The generation built without it is not reused (nor read by the
    planner, which names what is missing); the cache key is the same, so every latent is referenced, not encoded."""
    from rayflux import preservation
    from rayflux.cache.layout import decode_texts
    from rayflux.discovery.caption_hash import caption_id
    from rayflux.train.data import batching

    preserved, grown = runs["preserved"], generations.load_manifest(runs["grown"].cache_dir)
    assert Path(preserved.cache_dir).parent == runs["key_dir"] and preserved.cache_dir != runs["grown"].cache_dir
    m = generations.load_manifest(preserved.cache_dir)
    assert m["reused"]["from"] == runs["grown"].cache_dir
    assert m["encoded"] == {"samples": 0, "captions": 1}  # only "a coloured circle": the others hold no "red"
    text = _text(m)
    assert text["a coloured circle"]["encode_id"] == m["encode_id"] and text["a coloured circle"]["t5"]
    words = preservation.words(runs["preserved_cfg"])
    texts = {Path(r.source).name: decode_texts(r.text) for r in batching.index_samples(m, words)}
    assert texts["a.png"]["preservation"].caption_id == caption_id("a coloured circle")
    assert texts["b.png"]["preservation"] == texts["b.png"]["caption"]  # no trigger word: its own caption
    with pytest.raises(ValueError, match="holds no embedding of the preservation prompt 'a coloured circle'"):
        batching.index_samples(grown, words)
    assert verify.main([preserved.cache_dir], out=io.StringIO()) == 0
