"""Per-tensor checksums: a tensor changed on disk after the commit (finite, of the right length, so no shape or value
check sees it) is caught by ``cache verify`` and by every training read, stops a training run with one line naming
the file, the tensor and what to do, and the next run re-encodes exactly the damaged samples, reusing the rest.
(A changed reference latent: tests/test_edit_pairs.py, on its edit-pair cache.)"""

import io
import json
import shutil
from pathlib import Path

import cache_sets
import pytest

from rayflux import cli, job
from rayflux.cache import codec, generations, integrity, verify
from rayflux.cache.integrity import CacheIntegrityError
from rayflux.train.data import batching


@pytest.fixture(scope="module")
def built(ray_session, tmp_path_factory, tiny_model):
    return cache_sets.shared_cache(tmp_path_factory, tiny_model)


def _verify(path, *flags) -> tuple[int, str]:
    out = io.StringIO()
    return verify.main([str(path), *flags], out=out), out.getvalue()


def _samples(gen: Path, n: int) -> list[batching.SampleRef]:
    refs = [r for r in batching.index_samples(generations.load_manifest(str(gen))) if r.bucket == "128x128"]
    return sorted(refs, key=lambda r: r.sample_id)[:n]


def _read(refs: list[batching.SampleRef]) -> dict:
    (item,), _ = batching.plan_epoch(refs, len(refs), seed=1, epoch=0, world_size=1)
    return batching.load_batch({**item, "step": 0, "total_steps": 1})


def test_a_changed_latent_is_caught_by_a_read_and_by_verify_but_not_by_quick(built, tmp_path):
    gen = cache_sets.copy_generation(built, tmp_path)
    refs = _samples(gen, 3)
    _read(refs)  # intact: reads
    bad = refs[1]
    at = bad.range("latent")
    cache_sets.scale_one_value(bad.file, at.offset, at.length)
    span = f"bytes {at.offset}..{at.offset + at.length}"
    with pytest.raises(CacheIntegrityError) as exc:
        _read(refs)
    for part in (bad.file, span, f"latent of sample {bad.sample_id} ({bad.source})", f"cache verify {gen}`"):
        assert part in str(exc.value), (part, str(exc.value))
    assert _verify(gen, "--quick")[0] == 0  # the value is finite and in place: only its checksum tells
    assert integrity.load(str(gen)) is None
    code, text = _verify(gen)
    assert code == 1
    (line,) = [p for p in text.splitlines() if "checksum" in p]
    assert bad.file.split(f"{gen.parent}/")[1] in line and span in line and f"sample {bad.sample_id}" in line
    assert integrity.load(str(gen)).samples == [bad.sample_id]
    assert "re-encodes exactly those" in text


def test_a_changed_text_tensor_is_caught_by_a_read_and_by_verify(built, tmp_path):
    """The stored bytes are checked, before they are decoded: a changed byte of a compressed tensor is a checksum
    error, not a codec failure (nor, for a byte zstd does not notice, a quietly different embedding)."""
    gen = cache_sets.copy_generation(built, tmp_path)
    refs = _samples(gen, 2)
    file, _, caption_id, parts = json.loads(refs[0].text)
    offset, length, _, _, stored = parts[0]  # the first named text tensor (FLUX.1: t5)
    assert stored == codec.SHUFFLE_ZSTD
    cache_sets.flip_one_byte(file, offset, length)
    with pytest.raises(CacheIntegrityError) as exc:
        _read(refs[:1])
    name = built.manifest["layout"]["text"][0]["name"]
    for part in (file, f"bytes {offset}..{offset + length}", f"{name} of caption {caption_id}", refs[0].sample_id):
        assert part in str(exc.value), (part, str(exc.value))
    code, text = _verify(gen)
    assert code == 1 and f"{name} of caption {caption_id}" in text
    assert integrity.load(str(gen)).captions == [caption_id]


def test_the_empty_caption_that_caption_dropout_reads_is_checked_too(built, tmp_path):
    from rayflux.cache import index
    from rayflux.train.data.captions import load_empty

    gen = cache_sets.copy_generation(built, tmp_path)
    where = index.empty_caption(generations.load_manifest(str(gen)))
    load_empty(where)  # intact: loads
    key = built.manifest["layout"]["text"][0]["key"]
    assert where[f"{key}_codec"] == codec.SHUFFLE_ZSTD
    cache_sets.flip_one_byte(where["file"], where[f"{key}_offset"], where[f"{key}_length"])
    with pytest.raises(CacheIntegrityError) as exc:
        load_empty(where)
    assert where["file"] in str(exc.value) and "of the empty caption" in str(exc.value)


def test_a_run_stops_at_a_damaged_tensor_and_the_next_run_reencodes_exactly_it(built, tmp_path, tiny_model, capsys):
    """The job as a user runs it: training stops with the read's one line (no skip, no retry here); `cache verify`
    records the damage; the next run builds a repair generation that encodes that one sample and reuses the rest."""
    shutil.copytree(built.cache_root, tmp_path / "cache")
    gen = tmp_path / "cache" / Path(built.gen_dir).parent.name / Path(built.gen_dir).name
    refs = batching.index_samples(generations.load_manifest(str(gen)))
    bad = refs[len(refs) // 2]
    cache_sets.scale_one_value(bad.file, bad.range("latent").offset, bad.range("latent").length)
    sets = [
        f"model.path={tiny_model}",
        f"data.images_dir={built.images}",
        f"cache.dir={tmp_path / 'cache'}",
        f"run.output_dir={tmp_path / 'run'}",
        "data.resolution=128",
        f"data.max_image_pixels={cache_sets.MAX_PIXELS}",
        "cache.batch_size=8",
        "data.missing_caption=filename",
        "train.epochs=1",
        "train.batch_size=1",
        "train.workers.num_workers=1",
        "train.workers.max_failures=0",
    ]
    assert cli.main_train([a for s in sets for a in ("--set", s)]) == 1
    err = capsys.readouterr().err
    assert "rayflux: failed: CacheIntegrityError: " in err, err
    assert f"latent of sample {bad.sample_id}" in err and f"cache verify {gen}`" in err

    assert _verify(gen)[0] == 1
    summary = job.run(cache_sets.job_config(tiny_model, built.images, tmp_path, *sets[4:8]), only="cache")
    repair = generations.load_manifest(summary.cache_dir)
    assert summary.cache_dir == str(gen) + integrity.load(str(gen)).digest()
    assert repair["encoded"] == {"samples": 1, "captions": 0}
    assert repair["reused"]["samples"] == len(refs) - 1
    fresh = [r for r in batching.index_samples(repair) if r.sample_id == bad.sample_id]
    assert len(fresh) == 1 and fresh[0].file.startswith(summary.cache_dir + "/")
    assert _verify(summary.cache_dir)[0] == 0


def test_a_cache_written_before_checksums_is_named_by_verify_and_not_reused(built, tmp_path, monkeypatch):
    """Schema version 7 added the checksum columns: a version-6 generation is reported with the reason, and a
    version-6 build had another cache key, so a run builds a new cache rather than read one without checksums."""
    from rayflux.cache import keys, shards

    gen = cache_sets.copy_generation(built, tmp_path)
    manifest = json.loads((gen / generations.MANIFEST).read_text())
    assert {"t5_crc32", "clip_crc32"} <= set(manifest["empty_caption"])
    (gen / generations.MANIFEST).write_text(json.dumps({**manifest, "schema_version": 6}))
    code, text = _verify(gen)
    reads = f"schema version 6; this rayflux reads {shards.SCHEMA_VERSION} (a run of the job builds a new cache"
    assert code == 1 and reads in text
    today = keys.cache_key(built.cfg, built.facts)
    monkeypatch.setattr(shards, "SCHEMA_VERSION", 6)
    assert keys.cache_key(built.cfg, built.facts) != today
