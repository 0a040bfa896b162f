"""Edit pairs on the data side: references found by name or metadata column, missing ones skipped with the path
they were looked for at, and each reference cut and resized with its target's own crop."""

from __future__ import annotations

import io
import json
from pathlib import Path

import cache_sets
import numpy as np
import pytest

from rayflux import buckets, config
from rayflux.cache.layout import decode_planned
from rayflux.cache.prepare import prepare_row
from rayflux.discovery.in_process import discover

LIMIT = 10_000_000


def _save(path, img):
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def _cfg(*sets: str) -> config.JobConfig:
    return config.load(None, list(sets))


def test_reference_dir_pairs_by_relative_name_and_skips_images_without_one(tmp_path):
    images, refs = tmp_path / "images", tmp_path / "refs"
    for i, rel in enumerate(["a.png", "b.png", "sub/c.png"]):
        _save(images / rel, cache_sets.picture(80, 64, i))
        (images / rel).with_suffix(".txt").write_text(f"make {rel} red")
    _save(refs / "a.png", cache_sets.picture(80, 64, 10))
    _save(refs / "b.jpg", cache_sets.picture(80, 64, 11))  # another format, same name
    found = discover(_cfg(f"data.images_dir={images}", f"data.reference_dir={refs}").data)
    by_rel = {s.rel_path: s for s in found.sources}
    assert set(by_rel) == {"a.png", "b.png"}
    assert by_rel["a.png"].references == (str(refs / "a.png"),)
    assert by_rel["b.png"].references == (str(refs / "b.jpg"),)
    assert by_rel["a.png"].caption == "make a.png red"
    [skip] = found.skipped
    assert skip["source_uri"] == str(images / "sub/c.png")
    assert skip["reason"] == f"no reference image: {refs / 'sub/c.png'} does not exist"
    assert found.discovered == 3


def test_metadata_column_names_one_or_several_references_which_are_not_targets(tmp_path):
    root = tmp_path / "edits"
    for i, name in enumerate(["out1.png", "out2.png", "out3.png", "in1.png", "in2a.png", "in2b.png"]):
        _save(root / name, cache_sets.picture(64, 64, i))
    rows = [
        {"file_name": "out1.png", "text": "make it red", "source": "in1.png"},
        {"file_name": "out2.png", "text": "put the cat on the sofa", "source": ["in2a.png", "in2b.png"]},
        {"file_name": "out3.png", "text": "make it blue", "source": "gone.png"},
    ]
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [f"data.images_dir={root}", "data.caption_strategy=metadata", "data.reference_column=source"]
    found = discover(_cfg(*sets).data)
    by_rel = {s.rel_path: s for s in found.sources}
    assert set(by_rel) == {"out1.png", "out2.png"}  # the named references are never training images
    assert by_rel["out1.png"].references == (str(root / "in1.png"),)
    assert by_rel["out2.png"].references == (str(root / "in2a.png"), str(root / "in2b.png"))
    assert by_rel["out2.png"].caption == "put the cat on the sofa"
    assert [s["reason"] for s in found.skipped] == [f"no reference image: {root / 'gone.png'} does not exist"]


def test_metadata_references_outside_the_dataset_and_bad_cells_are_reported(tmp_path):
    root = tmp_path / "edits"
    for i, name in enumerate(["out1.png", "out2.png"]):
        _save(root / name, cache_sets.picture(64, 64, i))
    rows = [
        {"file_name": "out1.png", "text": "x", "source": "../secret.png"},
        {"file_name": "out2.png", "text": "y", "source": 7},
    ]
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [f"data.images_dir={root}", "data.caption_strategy=metadata", "data.reference_column=source"]
    found = discover(_cfg(*sets).data)
    assert not found.sources
    assert any("points outside the dataset" in p for p in found.problems)
    assert any("'source' must be a file name or a list of file names, got 7" in p for p in found.problems)


def test_reference_column_needs_metadata_captions(tmp_path):
    with pytest.raises(config.ConfigError, match="reference_column names a metadata column"):
        from rayflux import datasets

        datasets.datasets_of(_cfg(f"data.images_dir={tmp_path}", "data.reference_column=source").data)


def _spec(**kw) -> buckets.BucketSpec:
    return buckets.BucketSpec(resolution=64, latent_channels=4, crop="random", **kw)


def _row(target, refs, rel="t.png"):
    return {"uri": str(target), "rel_path": rel, "references": [str(r) for r in refs]}


def test_references_are_cut_with_their_target_crop(tmp_path):
    # A wide image with a random crop: a reference cut anywhere else would differ.
    target = cache_sets.picture(230, 100, 3)
    _save(tmp_path / "t.png", target)
    _save(tmp_path / "same.png", target)
    _save(tmp_path / "big.png", target.resize((460, 200)))  # the same picture at twice the size
    _save(tmp_path / "other.png", cache_sets.picture(230, 100, 4))
    row = prepare_row(_row(tmp_path / "t.png", [tmp_path / "same.png", tmp_path / "big.png"]), _spec(), 7, LIMIT)
    p = buckets.plan(230, 100, _spec(), seed=7, salt="t.png")
    assert p.crop_left > 0, "the test needs a crop that is not the whole image"
    assert (row["crop_left"], row["target_w"]) == (p.crop_left, p.target_width) and row["skip_reason"] == ""
    assert row["ref_count"] == 2
    n = p.target_width * p.target_height * 3
    same, big = row["ref_pixels"][:n], row["ref_pixels"][n:]
    assert len(row["ref_pixels"]) == 2 * n
    assert same == row["pixels"]  # the same picture: cut and resized exactly as its target
    diff = np.abs(np.frombuffer(big, np.uint8).astype(int) - np.frombuffer(row["pixels"], np.uint8).astype(int))
    assert diff.mean() < 8  # scaled to the target's size first, then the same crop
    other = prepare_row(_row(tmp_path / "t.png", [tmp_path / "other.png"]), _spec(), 7, LIMIT)
    plain = prepare_row(_row(tmp_path / "t.png", []), _spec(), 7, LIMIT)
    # The references' content is part of the sample's identity; a plain sample has no reference columns.
    assert len({row["sample_id"], other["sample_id"], plain["sample_id"]}) == 3
    assert plain["ref_count"] == 0 and plain["ref_pixels"] == b""


def test_a_missing_or_broken_reference_skips_its_target_with_the_reason(tmp_path):
    _save(tmp_path / "t.png", cache_sets.picture(96, 64, 1))
    (tmp_path / "broken.png").write_bytes(b"not an image")
    gone = prepare_row(_row(tmp_path / "t.png", [tmp_path / "gone.png"]), _spec(), 0, LIMIT)
    assert gone["skip_reason"].startswith(f"reference {tmp_path / 'gone.png'}: unreadable")
    broken = prepare_row(_row(tmp_path / "t.png", [tmp_path / "broken.png"]), _spec(), 0, LIMIT)
    assert broken["skip_reason"].startswith(f"reference {tmp_path / 'broken.png'}: not a decodable image")
    assert broken["pixels"] == b"" and broken["ref_pixels"] == b""


def test_an_edit_pair_is_reused_only_while_its_reference_is_unchanged(tmp_path):
    target, ref = tmp_path / "t.png", tmp_path / "r.png"
    _save(target, cache_sets.picture(96, 64, 1))
    _save(ref, cache_sets.picture(96, 64, 2))
    st = target.stat()
    src = {**_row(target, [ref]), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    fresh = prepare_row(src, _spec(), 0, LIMIT)
    prev = {
        "sample_id": fresh["sample_id"],
        "source_sha256": fresh["source_sha256"],
        "orig_w": 96,
        "orig_h": 64,
        "source_size": st.st_size,
        "source_mtime_ns": st.st_mtime_ns,
    }
    again = prepare_row({**src, "prev": json.dumps(prev)}, _spec(), 0, LIMIT)
    assert again["reuse"] and again["ref_count"] == 1 and again["ref_pixels"] == b""
    _save(ref, cache_sets.picture(96, 64, 3))
    changed = prepare_row({**src, "prev": json.dumps(prev)}, _spec(), 0, LIMIT)
    assert not changed["reuse"] and changed["sample_id"] != fresh["sample_id"] and changed["ref_pixels"]


def _edit_dataset(root):
    images, refs = root / "images", root / "refs"
    for i, name in enumerate(["a", "b", "c"]):
        _save(images / f"{name}.png", cache_sets.picture(144, 112, i))
        (images / f"{name}.txt").write_text(f"make the {name} boxes red")
    _save(refs / "a.png", cache_sets.picture(144, 112, 10))
    _save(refs / "b.png", cache_sets.picture(288, 224, 11))  # twice its target's size
    return images, refs  # c has no reference


def test_the_cache_stores_reference_latents_beside_the_target(ray_session, tiny_model, tmp_path):
    import torch

    from rayflux import models
    from rayflux.cache import index, shards, tensors, verify
    from rayflux.cache.encoders import VaeEncoder

    images, refs = _edit_dataset(tmp_path)
    # fp32: the check below re-encodes in this process, on its own thread count, and needs results equal up to
    # summation order (bf16, the default on CPUs that compute it natively, rounds each layer differently per count).
    cfg = cache_sets.job_config(
        tiny_model, images, tmp_path, f"data.reference_dir={refs}", "data.resolution=64", "model.vae_dtype=float32"
    )
    gen_dir, manifest = cache_sets.build(cfg)
    assert (manifest["cached"], manifest["skipped"]) == (2, 1)
    assert manifest["skipped_inputs"][0]["reason"] == f"no reference image: {refs / 'c.png'} does not exist"
    rows = {r["rel_path"]: r for r in cache_sets.generation_rows(manifest)}
    assert set(rows) == {"a.png", "b.png"}
    layout = shards.ShardLayout(**manifest["layout"])
    # What the references must encode to: each prepared with its target's crop, then the VAE's mode.
    encoder = VaeEncoder(cfg.model, layout.dtype, "check")
    spec = buckets.BucketSpec(**manifest["bucket_spec"])
    for rel, row in rows.items():
        shape = (int(row["latent_c"]), int(row["latent_h"]), int(row["latent_w"]))
        assert row["ref_count"] == 1 and row["ref_sha256"]
        stored = tensors.from_bytes(row["ref_latent"], layout.dtype, (1, *shape))
        src = {"uri": str(images / rel), "rel_path": rel, "references": [str(refs / rel)]}
        prepared = prepare_row(src, spec, manifest["seed"], cfg.data.max_image_pixels)
        pixels = np.frombuffer(prepared["ref_pixels"], np.uint8).reshape(1, row["target_h"], row["target_w"], 3).copy()
        assert prepared["sample_id"] == row["sample_id"]
        # The actor ran with its own thread count: equal up to summation order.
        assert torch.allclose(stored, encoder.encode_references(pixels).float(), atol=1e-4)
        assert not torch.allclose(stored, tensors.from_bytes(row["latent"], layout.dtype, shape)[None], atol=1e-2)
        # The index points at the reference bytes, for ranged reads in training.
        with open(index.resolve(manifest, row["file"]), "rb") as f:
            f.seek(row["ref_offset"])
            assert f.read(row["ref_length"]) == row["ref_latent"]
    assert models.family(cfg.model).name == "flux1"
    assert verify.main([gen_dir], out=io.StringIO()) == 0

    # A changed reference re-encodes its own sample only; the other is reused where it is.
    _save(refs / "b.png", cache_sets.picture(288, 224, 12))
    _, again = cache_sets.build(cfg, previous=manifest, generation=1)
    assert (again["encoded"]["samples"], again["reused"]["samples"]) == (1, 1)

    # One value of one reference latent changed on disk (finite, in place): a training read and cache verify name it.
    from rayflux.cache.integrity import CacheIntegrityError
    from rayflux.train.data import batching

    ref = batching.index_samples(manifest)[0]
    at = ref.range("ref_latent")
    cache_sets.scale_one_value(ref.file, at.offset, at.length)
    (item,), _ = batching.plan_epoch([ref], 1, seed=0, epoch=0, world_size=1)
    with pytest.raises(CacheIntegrityError) as exc:
        batching.load_batch({**item, "step": 0, "total_steps": 1})
    span = f"bytes {at.offset}..{at.offset + at.length} (ref_latent of sample {ref.sample_id}"
    assert ref.file in str(exc.value) and span in str(exc.value)
    out = io.StringIO()
    assert verify.main([gen_dir], out=out) == 1
    assert span in out.getvalue()

    # A reference latent cut short is a shape error that cache verify names.
    shard = cache_sets.first_shard(Path(gen_dir))
    cache_sets.rewrite_rows(shard, lambda rs: rs[0].update(ref_latent=rs[0]["ref_latent"][:-4]))
    out = io.StringIO()
    assert verify.main([gen_dir], out=out) == 1
    assert "ref_latent bytes for shape (1, " in out.getvalue()


def test_flux2_reference_latents_are_the_pipelines_reference_encoding(ray_session, tiny_flux2_klein, tmp_path):
    """A metadata edit set with one and with two references per image, cached for FLUX.2 [klein]: each stored
    reference latent is what the pipeline's own reference encoding makes of the same pixels."""
    import pyarrow.parquet as pq
    import torch
    from diffusers import Flux2KleinPipeline

    from rayflux.cache import index, shards, tensors

    root = tmp_path / "edits"
    for i, name in enumerate(["out1.png", "out2.png", "in1.png", "in2a.png"]):
        _save(root / name, cache_sets.picture(144, 112, i))
    _save(root / "in2b.png", cache_sets.picture(72, 56, 9))  # half its target's size
    rows = [
        {"file_name": "out1.png", "text": "make it red", "source": "in1.png"},
        {"file_name": "out2.png", "text": "put them together", "source": ["in2a.png", "in2b.png"]},
    ]
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # data.alignment=32: the bucket check still asks FLUX.1's 2 x vae_scale_factor of FLUX.2's patchified latents.
    # model.vae_dtype=float32: compared below with the pipeline's own encoding, which runs in fp32.
    sets = [
        "data.caption_strategy=metadata",
        "data.reference_column=source",
        "data.resolution=64",
        "data.alignment=32",
        "model.vae_dtype=float32",
    ]
    cfg = cache_sets.job_config(tiny_flux2_klein, root, tmp_path, *sets)
    gen_dir, manifest = cache_sets.build(cfg)
    assert (manifest["cached"], manifest["skipped"]) == (2, 0)
    layout = shards.ShardLayout(**manifest["layout"])
    pipe = Flux2KleinPipeline.from_pretrained(tiny_flux2_klein, text_encoder=None, tokenizer=None, transformer=None)
    spec = buckets.BucketSpec(**manifest["bucket_spec"])
    found = {s.rel_path: s for s in discover(cfg.data).sources}
    counts = {}
    for e in index.read(manifest, "samples").to_pylist():
        row = pq.ParquetFile(index.resolve(manifest, e["file"])).read_row_group(e["row"]).to_pylist()[0]
        shape = (int(row["latent_c"]), int(row["latent_h"]), int(row["latent_w"]))
        k = counts[row["rel_path"]] = row["ref_count"]
        assert shape[0] == 4 * pipe.vae.config.latent_channels and e["ref_length"] == len(row["ref_latent"])
        src = {"uri": row["source_uri"], "rel_path": row["rel_path"], "references": found[row["rel_path"]].references}
        prepared = prepare_row(src, spec, manifest["seed"], cfg.data.max_image_pixels)
        pixels = np.frombuffer(prepared["ref_pixels"], np.uint8).reshape(k, row["target_h"], row["target_w"], 3)
        x = torch.from_numpy(pixels.copy()).permute(0, 3, 1, 2).float() / 127.5 - 1.0
        with torch.no_grad():
            expected = torch.cat([pipe._encode_vae_image(x[i : i + 1], generator=None) for i in range(k)])
        stored = tensors.from_bytes(row["ref_latent"], layout.dtype, (k, *shape))
        # The actor encodes both references in one batch on its own threads: equal up to summation order, far
        # inside what a wrong crop, or a sampled instead of the mode latent, would change.
        assert torch.allclose(stored, expected, atol=1e-3)
    assert counts == {"out1.png": 1, "out2.png": 2}


def test_a_model_without_references_refuses_edit_pairs_and_reference_dirs_may_not_overlap(tmp_path):
    from rayflux import job, paths

    images, refs = _edit_dataset(tmp_path)
    cfg = _cfg(f"data.images_dir={images}", f"data.reference_dir={refs}", f"run.output_dir={tmp_path / 'run'}")
    with pytest.raises(
        config.ConfigError,
        match="has edit pairs .* takes no reference images: edit pairs train FLUX.1 Kontext or FLUX.2",
    ):
        job.run(cfg)  # the default model is the tiny FLUX.1
    renders = _cfg(
        f"data.images_dir={images}",
        'train.validation.prompts=["x"]',
        f'train.validation.references=["{refs / "a.png"}"]',
        f"run.output_dir={tmp_path / 'run'}",
    )
    with pytest.raises(config.ConfigError, match="validation.references is set, but"):
        job.run(renders)
    with pytest.raises(config.ConfigError, match="one reference image .* per validation prompt"):
        _cfg('train.validation.prompts=["x", "y"]', f'train.validation.references=["{refs / "a.png"}"]')
    inside = _cfg(
        f"data.images_dir={images}",
        f"data.reference_dir={tmp_path / 'run' / 'refs'}",
        f"run.output_dir={tmp_path / 'run'}",
    )
    with pytest.raises(paths.PathOverlapError, match="data.reference_dir"):
        job.run(inside, only="cache")


def test_plan_groups_edits_by_reference_count_and_a_batch_row_carries_its_references():
    import torch

    from rayflux.train import step
    from rayflux.train.data import batching

    refs = [batching.SampleRef(f"s{i}", "64x64", "f", i, counts={"ref_count": i % 3}) for i in range(12)]
    plan, dropped = batching.plan_epoch(refs, 4, seed=1, epoch=0, world_size=1)
    assert dropped == 0 and len(plan) == 3
    for b in plan:
        assert (
            len({r.counts.get("ref_count", 0) for r in decode_planned(b["refs"])}) == 1
        )  # one reference count per batch
    counts = batching.epoch_counts({"64x64": 4, "64x64+1ref": 4, "64x64+2ref": 4}, 4, 1, 0, 1)
    assert counts == {"samples": 12, "dropped": 0, "batches": 3}
    lat = [np.full((4, 2, 2), i, np.float32) for i in range(2)]
    text = {"t5": [np.zeros((3, 2), np.float32)] * 2, "clip_pooled": [np.zeros(2, np.float32)] * 2}
    item = {"epoch": 0, "index": 0, "seed": 5, "step": 0, "total_steps": 1, "bucket": "32x32"}
    refs = [x[None] + 10 for x in lat]
    edit = step.from_item(batching.stack_batch(item, 0, ["a", "b"], {"latent": lat, "ref_latent": refs}, text))
    assert edit.references.shape == (2, 1, 4, 2, 2) and torch.equal(edit.references[:, 0], edit.latents + 10)
    plain = batching.stack_batch(item, 0, ["a", "b"], {"latent": lat, "ref_latent": None}, text)
    assert step.from_item(plain).references is None


def test_an_edit_with_more_references_than_the_family_takes_is_refused():
    from rayflux import families
    from rayflux.train.data import batching

    two = [
        batching.SampleRef("a", "64x64", "f", 0, counts={"ref_count": 1}),
        batching.SampleRef("b", "64x64", "f", 1, counts={"ref_count": 2}, source="/data/b.png"),
    ]
    with pytest.raises(ValueError, match="/data/b.png has 2 reference images, but FLUX.1 Kontext .* at most 1"):
        batching.check_references(two, families.for_class("FluxKontextPipeline"))
    batching.check_references(two, families.for_class("Flux2KleinPipeline"))
    batching.check_references(two[:1], families.for_class("FluxKontextPipeline"))


def test_kontext_trains_edit_pairs_end_to_end(ray_session, tiny_kontext, tmp_path):
    """Cache, train, validation (an edit of a given reference) and export for FLUX.1 Kontext on an edit set; the
    feed reads each reference with its latent, the step's loss depends on it, and the LoRA loads with
    FluxKontextPipeline and changes its edit."""
    import torch
    from diffusers import FluxKontextPipeline
    from PIL import Image

    from rayflux import job, models
    from rayflux.cache import generations, ranges, tensors
    from rayflux.train import step
    from rayflux.train.data import batching

    images, refs = _edit_dataset(tmp_path)
    out = tmp_path / "run"
    cfg = _cfg(
        f"model.path={tiny_kontext}",
        f"data.images_dir={images}",
        f"data.reference_dir={refs}",
        f"run.output_dir={out}",
        "data.resolution=64",
        "train.max_steps=2",
        "cache.batch_size=8",
        'train.validation.prompts=["make the boxes red"]',
        f'train.validation.references=["{refs / "a.png"}"]',
        "train.validation.inference_steps=2",
        "train.optim.learning_rate=0.01",
    )
    summary = job.run(cfg)
    assert (summary.cached, summary.steps) == (2, 2)
    assert list((out / "validation").glob("step-*.png"))

    # The feed: each sample's reference latents come back with its latent, from one range of its shard.
    manifest = generations.load_manifest(summary.cache_dir)
    samples = batching.index_samples(manifest)
    assert all(
        r.count("ref_count") == 1 and 0 <= r.range("ref_latent").offset - sum(r.range("latent")[:2]) <= ranges.HOLE
        for r in samples
    )
    plan, _ = batching.plan_epoch(samples, 1, seed=0, epoch=0, world_size=1)
    rows = {r["sample_id"]: r for r in cache_sets.generation_rows(manifest)}
    layout_dtype = manifest["layout"]["dtype"]
    transformer = models.load_transformer(cfg.model, "cpu", torch.float32)
    family = models.family(cfg.model)
    for item in plan:
        batch = step.from_item(batching.load_batch({**item, "step": 0, "total_steps": 1}))
        row = rows[decode_planned(item["refs"])[0].sample_id]
        want = tensors.from_bytes_numpy(row["ref_latent"], layout_dtype, batch.references.shape[1:])
        assert np.array_equal(batch.references.numpy()[0], want.astype(np.float32))
        # The step feeds them: the same noise and sigma give another loss without them.
        with torch.no_grad():
            guidance = bool(transformer.config.guidance_embeds)
            losses = [
                float(
                    step.flow_loss(
                        transformer, b, cfg.train, guidance, None, step.Runtime("cpu", torch.float32, family)
                    )
                )
                for b in (batch, step.Batch(batch.latents, batch.text, batch.seed))
            ]
        assert losses[0] != losses[1]

    pipe = FluxKontextPipeline.from_pretrained(tiny_kontext)
    ref = Image.open(refs / "a.png").convert("RGB").resize((64, 64))

    def edit():
        return pipe(
            prompt="make the boxes red",
            **family.reference_kwargs([ref], 64, 64),
            height=64,
            width=64,
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
        ).images[0]

    base = edit()
    pipe.load_lora_weights(str(out / "lora"), weight_name=summary.lora_path.rsplit("/", 1)[-1])
    assert np.abs(edit() - base).max() > 1e-4
