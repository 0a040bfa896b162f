"""Loss masks end to end: cached beside the latent (one ranged read), fed to the step's loss, exported; a mask of all
ones trains bitwise the run without masks; a changed mask re-writes only its sample; ``cache verify`` checks masks.
Real Ray, real tiny models, real local disk and the loopback S3 server."""

from __future__ import annotations

import io
import json

import cache_sets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from rayflux import config, job, models
from rayflux.cache import generations, index, masks, ranges, verify
from rayflux.cache.manifest import Manifest
from rayflux.train import step
from rayflux.train.data import batching

# One train worker: masks weigh each batch's loss locally (no collective sees them), so a second rank's process and
# model load (about a fifth of a tiny job's CPU, which CI spends on 2 cores) would check nothing more here.
TRAIN = [
    "data.resolution=64",
    "train.workers.num_workers=1",
    "train.max_steps=2",
    "train.batch_size=1",
    "train.optim.learning_rate=0.01",
    "cache.batch_size=8",
]


def _half(size=(64, 64)) -> Image.Image:
    """White on the left half (trains), black on the right (masked out)."""
    img = Image.new("L", size, 0)
    img.paste(255, (0, 0, size[0] // 2, size[1]))
    return img


def _dataset(root, mask=None, alpha=False):
    """Three 64x64 captioned pictures; ``mask(i)``: each one's mask image in ``root/masks``; ``alpha``: the half
    mask as each picture's alpha channel."""
    images, mask_dir = root / "images", root / "masks"
    images.mkdir(parents=True)
    for i in range(3):
        pic = cache_sets.picture(64, 64, i)
        if alpha:
            pic = pic.convert("RGBA")
            pic.putalpha(_half())
        pic.save(images / f"{i}.png")
        (images / f"{i}.txt").write_text(f"picture {i}")
        if mask is not None:
            mask_dir.mkdir(exist_ok=True)
            mask(i).save(mask_dir / f"{i}.png")
    return images, mask_dir


def _run(model, images, out, *sets):
    cfg = config.load(
        None,
        [
            f"model.path={model}",
            f"data.images_dir={images}",
            f"run.output_dir={out / 'run'}",
            f"cache.dir={out / 'cache'}",
            *TRAIN,
            *sets,
        ],
    )
    return cfg, job.run(cfg)


def _masked_batches(cfg, summary):
    """Every planned batch of the run's generation through the real feed, as the step's batches."""
    manifest = generations.load_manifest(summary.cache_dir)
    samples = batching.index_samples(manifest)
    for r in samples:  # the mask lies right after its latent, in the latent's ranged read
        mask, latent = r.range("mask"), r.range("latent")
        assert mask.length and 0 <= mask.offset - latent.offset - latent.length <= ranges.HOLE
    plan, _ = batching.plan_epoch(samples, 1, seed=0, epoch=0, world_size=1)
    for item in plan:
        row = batching.load_batch({**item, "step": 0, "total_steps": 1})
        assert row["read_requests"] <= 2  # the latent's range (mask included) and its caption's
        yield step.from_item(row)


def _half_grid(h: int, w: int) -> np.ndarray:
    """The half mask on an ``h`` x ``w`` latent grid."""
    return np.concatenate([np.ones((h, w // 2)), np.zeros((h, w - w // 2))], axis=1)


def _mask_changes_the_loss(cfg, summary):
    """The step's loss uses the cached mask: the same batch without it gives another loss."""
    transformer = models.load_transformer(cfg.model, "cpu", torch.float32)
    family = models.family(cfg.model)
    guidance = bool(getattr(transformer.config, "guidance_embeds", False))
    for batch in _masked_batches(cfg, summary):
        want = _half_grid(*batch.latents.shape[2:]).astype(np.float32)
        assert torch.equal(batch.masks[0], torch.from_numpy(want))
        with torch.no_grad():
            losses = [
                float(
                    step.flow_loss(
                        transformer, b, cfg.train, guidance, None, step.Runtime("cpu", torch.float32, family)
                    )
                )
                for b in (batch, step.Batch(batch.latents, batch.text, batch.seed))
            ]
        assert losses[0] != losses[1]


def _lora(summary) -> dict:
    return load_file(summary.lora_path)


def test_an_all_ones_mask_trains_bitwise_the_run_without_masks(ray_session, tiny_model, tmp_path):
    """FLUX.1, masks from a local ``mask_dir``: all white, so every token weighs exactly 1; the exported LoRA is
    bitwise the one of the same run without masks (the mask changes no sample id, batch order or noise)."""
    images, mask_dir = _dataset(tmp_path / "set", mask=lambda i: Image.new("L", (64, 64), 255))
    _, plain = _run(tiny_model, images, tmp_path / "plain")
    cfg, masked = _run(tiny_model, images, tmp_path / "masked", "data.mask=dir", f"data.mask_dir={mask_dir}")
    assert (masked.cached, masked.steps) == (3, 2)
    for batch in _masked_batches(cfg, masked):
        assert batch.masks is not None and bool((batch.masks == 1.0).all())
    a, b = _lora(plain), _lora(masked)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert plain.losses == masked.losses


def test_flux2_klein_trains_with_alpha_masks(ray_session, tiny_flux2_klein, tmp_path):
    """FLUX.2 [klein], masks from the images' alpha channel: cached on the latent grid, packed as FLUX.2 packs its
    latent, and the loss depends on them; the job exports a LoRA."""
    images, _ = _dataset(tmp_path / "set", alpha=True)
    cfg, summary = _run(tiny_flux2_klein, images, tmp_path / "out", "data.mask=alpha")
    assert (summary.cached, summary.steps) == (3, 2) and _lora(summary)
    rows = index.read(generations.load_manifest(summary.cache_dir), "samples").to_pylist()
    assert {r["mask_sha256"] for r in rows} == {masks.ALPHA}
    _mask_changes_the_loss(cfg, summary)


def _upload(local, uri) -> None:
    import pyarrow.fs as pafs

    from rayflux import storage

    fs, inner = storage.resolve(uri)
    pafs.copy_files(str(local), inner, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)


def test_masks_on_s3_train_and_a_changed_mask_rewrites_only_its_sample(
    ray_session, tiny_model, s3_server, s3_bucket, tmp_path
):
    """FLUX.1, images and masks on the S3 server: cache, train and export with the masks in the loss; then one
    mask changes and the next build writes that one sample again (same sample id) and reuses the others; finally
    ``cache verify`` catches a damaged mask and a mask of the wrong shape."""
    images, mask_dir = _dataset(tmp_path / "set", mask=lambda i: _half())
    _upload(images, f"{s3_bucket}/images")
    _upload(mask_dir, f"{s3_bucket}/masks")
    sets = ["data.mask=dir", f"data.mask_dir={s3_bucket}/masks"]
    cfg, first = _run(tiny_model, f"{s3_bucket}/images", tmp_path / "out", *sets)
    assert (first.cached, first.steps) == (3, 2) and _lora(first)
    _mask_changes_the_loss(cfg, first)

    # A changed mask: only its sample is written again, under the same sample id.
    before = {r["rel_path"]: r for r in cache_sets.generation_rows(generations.load_manifest(first.cache_dir))}
    quarter = Image.new("L", (64, 64), 0)
    quarter.paste(255, (0, 0, 32, 32))
    buf = io.BytesIO()
    quarter.save(buf, format="PNG")
    from rayflux import storage

    storage.write_bytes_atomic(f"{s3_bucket}/masks/1.png", buf.getvalue())
    again = job.run(cfg, only="cache")
    manifest = generations.load_manifest(again.cache_dir)
    assert again.cache_dir != first.cache_dir
    assert manifest["encoded"]["samples"] == 1 and manifest["reused"]["samples"] == 2
    after = {r["rel_path"]: r for r in cache_sets.generation_rows(manifest)}
    assert {k: r["sample_id"] for k, r in after.items()} == {k: r["sample_id"] for k, r in before.items()}
    assert after["1.png"]["mask_sha256"] != before["1.png"]["mask_sha256"]
    assert masks.from_bytes(after["1.png"]["mask"], 8, 8)[4:].max() == 0.0
    assert [k for k in after if after[k]["encode_id"] != before[k]["encode_id"]] == ["1.png"]

    # cache verify checks each mask's shape against the declaration, and its checksum.
    gen = again.cache_dir
    assert _verify(gen)[0] == 0
    index_path = Manifest.of(manifest).index_path("samples")
    table = pq.read_table(index_path)
    rows = table.to_pylist()
    [entry] = [e for e in rows if e["rel_path"] == "1.png"]
    entry["mask_length"] -= 2
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), index_path)
    code, text = _verify(gen)
    assert code != 0 and "mask of latent shape" in text, text
    pq.write_table(table, index_path)
    entry["mask_length"] += 2
    with open(f"{gen.rsplit('/', 1)[0]}/{entry['file']}", "r+b") as f:  # one stored mask value changes
        f.seek(entry["mask_offset"])
        f.write(np.float16(0.5).tobytes())
    code, text = _verify(gen)
    assert code != 0 and "mask" in text, text


def _verify(path) -> tuple[int, str]:
    out = io.StringIO()
    return verify.main([str(path)], out=out), out.getvalue()


@pytest.mark.parametrize("floor", [0.0, 0.25])
def test_mask_floors_travel_per_dataset_to_the_step(floor):
    """``data.mask_floor`` reaches each sample's planned batch and the step's batch (as loss weights do)."""
    from rayflux import datasets

    cfg = config.load(None, ["data.images_dir=/nowhere", "data.mask=alpha", f"data.mask_floor={floor}"])
    ref = batching.SampleRef("s", "64x64", "f", 0, dataset=datasets.key(cfg.data, datasets.datasets_of(cfg.data)[0]))
    [mixed] = datasets.mix([ref], datasets.sample_weights(cfg.data), datasets.mask_floors(cfg.data))
    assert mixed.mask_floor == floor
    item = batching._planned([mixed], 0, 0, 1)
    latent = {"latent": [np.zeros((4, 8, 8), np.float32)]}
    row = batching.stack_batch({**item, "step": 0, "total_steps": 1}, 1, ["s"], latent, {})
    assert step.from_item(row).mask_floors.tolist() == [floor]
