"""Loss masks up to the prepared row, and the masked loss: config checks, discovery (local and S3), decode and
prepare with every bad or missing mask case on real files, the latent-grid reduction, the family's token packing,
and the loss against a hand computation. No Ray: discovery and preparation run in this process."""

from __future__ import annotations

import json

import cache_sets
import numpy as np
import pytest
import torch
from PIL import Image

from rayflux import buckets, config, datasets, doctor
from rayflux.cache import masks
from rayflux.cache.prepare import prepare_row
from rayflux.families import by_name
from rayflux.discovery.in_process import discover
from rayflux.train import flow

LIMIT = 10_000_000
SPEC = buckets.BucketSpec(resolution=64, latent_channels=4, crop="center", vae_scale_factor=8)


def _cfg(*sets: str) -> config.JobConfig:
    return config.load(None, list(sets))


def _save(path, img) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def _half(size, left=255, right=0, mode="L") -> Image.Image:
    """A mask whose left half is ``left`` and right half ``right``."""
    w, h = size
    arr = np.full((h, w), right, np.uint8)
    arr[:, : w // 2] = left
    return Image.fromarray(arr, "L").convert(mode) if mode != "L" else Image.fromarray(arr, "L")


def _grid(row) -> np.ndarray:
    p = buckets.plan(row["orig_w"], row["orig_h"], SPEC, seed=0, salt=row["rel_path"])
    return masks.from_bytes(row["mask"], p.latent_height, p.latent_width).astype(np.float32)


def _prep(tmp_path, mask_img=None, mask_bytes=None, image=None, policy=masks.MaskPolicy("dir"), prev=None):
    img_path = tmp_path / "img.png"
    _save(img_path, image or cache_sets.picture(64, 64, 1))
    uri = ""
    if mask_img is not None or mask_bytes is not None:
        uri = str(tmp_path / "mask.png")
        if mask_bytes is not None:
            (tmp_path / "mask.png").write_bytes(mask_bytes)
        else:
            mask_img.save(uri)
    row = {"uri": str(img_path), "rel_path": "img.png", "mask_uri": uri, "size": 0, "mtime_ns": 0}
    if prev is not None:
        row["prev"] = json.dumps(prev)
    return prepare_row(row, SPEC, 0, LIMIT, policy)


# -- config ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sets, message",
    [
        (["data.mask=dir"], "data.mask=dir needs data.mask_dir"),
        (["data.mask_dir=/tmp/m"], "data.mask_dir is set but data.mask=none"),
        (["data.mask=alpha", "data.mask_floor=1.5"], r"data.mask_floor must be in \[0, 1\]"),
        (["data.mask=blur"], "data.mask must be one of none, dir, column, alpha"),
        (["data.mask=alpha", "data.missing_mask=zeros"], "data.missing_mask must be one of skip, ones"),
    ],
)
def test_mask_settings_are_checked(tmp_path, sets, message):
    with pytest.raises(config.ConfigError, match=message):
        datasets.datasets_of(_cfg(f"data.images_dir={tmp_path}", *sets).data)


@pytest.mark.parametrize("where", ["images", "images/masks", "."])
def test_a_mask_dir_overlapping_the_images_is_refused(tmp_path, where):
    (tmp_path / "images").mkdir()
    with pytest.raises(config.ConfigError, match="keep masks in a folder of their own"):
        datasets.datasets_of(
            _cfg(
                f"data.images_dir={tmp_path / 'images'}",
                "data.mask=dir",
                f"data.mask_dir={(tmp_path / where).resolve()}",
            ).data
        )


def test_masks_change_the_cache_identity_only_when_they_are_on(tmp_path):
    plain = datasets.datasets_of(_cfg(f"data.images_dir={tmp_path}").data)[0]
    ident = datasets.cache_identity(plain, str(tmp_path))
    assert not {"mask", "mask_dir", "missing_mask", "mask_floor"} & set(ident)  # older caches keep their key
    on = datasets.datasets_of(_cfg(f"data.images_dir={tmp_path}", "data.mask=alpha", "data.mask_floor=0.2").data)[0]
    ident = datasets.cache_identity(on, str(tmp_path))
    assert ident["mask"] == "alpha" and "mask_floor" not in ident  # the floor only weighs the loss


def test_mask_keys_are_in_help():
    from rayflux.config import loader

    text = loader.help_text()
    assert "data.mask_floor" in text and "ai-toolkit's minimum mask value" in text and "data.missing_mask" in text


# -- discovery ---------------------------------------------------------------------------------------------------


def _mask_dataset(root):
    images, mask_dir = root / "images", root / "masks"
    for i, rel in enumerate(["a.png", "B.png", "sub/c.png", "d.png"]):
        _save(images / rel, cache_sets.picture(64, 64, i))
        (images / rel).with_suffix(".txt").write_text(f"picture {i}")
    _save(mask_dir / "a.png", _half((64, 64)))
    _save(mask_dir / "b.jpg", _half((64, 64)))  # another extension and case: still B.png's mask
    _save(mask_dir / "sub/c.webp", _half((64, 64)))
    return images, mask_dir  # d.png has no mask


def test_masks_are_matched_by_relative_path_without_extension(tmp_path):
    images, mask_dir = _mask_dataset(tmp_path)
    found = discover(_cfg(f"data.images_dir={images}", "data.mask=dir", f"data.mask_dir={mask_dir}").data)
    by_rel = {s.rel_path: s for s in found.sources}
    assert by_rel["a.png"].mask_uri == str(mask_dir / "a.png")
    assert by_rel["B.png"].mask_uri == str(mask_dir / "b.jpg")
    assert by_rel["sub/c.png"].mask_uri == str(mask_dir / "sub/c.webp")
    assert all(s.mask_stamp for s in by_rel.values())
    [skip] = found.skipped  # missing_mask=skip: a recorded skip with its reason, never an all-ones mask
    assert skip["source_uri"] == str(images / "d.png")
    assert skip["reason"].startswith("mask missing:") and "d.png" in skip["reason"]


def test_a_missing_mask_with_missing_mask_ones_trains_on_ones_and_is_reported(tmp_path):
    images, mask_dir = _mask_dataset(tmp_path)
    sets = [f"data.images_dir={images}", "data.mask=dir", f"data.mask_dir={mask_dir}", "data.missing_mask=ones"]
    found = discover(_cfg(*sets).data)
    by_rel = {s.rel_path: s for s in found.sources}
    assert set(by_rel) == {"a.png", "B.png", "sub/c.png", "d.png"} and not found.skipped
    assert by_rel["d.png"].mask_uri == ""
    assert any("1 images have no mask" in p and "d.png" in p for p in found.problems)
    row = prepare_row({**_row_of(by_rel["d.png"])}, SPEC, 0, LIMIT, masks.MaskPolicy("dir", "ones"))
    assert row["skip_reason"] == "" and row["mask_sha256"] == masks.ONES
    assert (_grid(row) == 1.0).all()


def _row_of(source) -> dict:
    from dataclasses import asdict

    return asdict(source)


def test_a_dataset_without_masks_lists_no_mask_columns_values(tmp_path):
    images, _ = _mask_dataset(tmp_path)
    found = discover(_cfg(f"data.images_dir={images}").data)
    assert {s.mask_uri for s in found.sources} == {""} and len(found.sources) == 4


def test_masks_on_the_s3_server_are_matched_and_read(s3_server, s3_bucket, tmp_path):
    import pyarrow.fs as pafs

    from rayflux import storage

    images, mask_dir = _mask_dataset(tmp_path)
    fs, inner = storage.resolve(f"{s3_bucket}/set")
    for name, local in (("images", images), ("masks", mask_dir)):
        pafs.copy_files(
            str(local), f"{inner}/{name}", source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs
        )
    since = len(s3_server.requests())
    sets = [f"data.images_dir={s3_bucket}/set/images", "data.mask=dir", f"data.mask_dir={s3_bucket}/set/masks"]
    found = discover(_cfg(*sets).data)
    by_rel = {s.rel_path: s for s in found.sources}
    assert by_rel["B.png"].mask_uri == f"{s3_bucket}/set/masks/b.jpg"
    assert [s["reason"][:13] for s in found.skipped] == ["mask missing:"]
    # Matching costs no request per image: the mask folder is listed like the images, no mask is read. The only
    # reads are the caption files of the three images with a mask (d.png is skipped before its caption is read).
    got = s3_server.requests()[since:]
    assert sorted(p.rsplit("/set/", 1)[1] for m, p in got if m == "GET") == [
        "images/B.txt",
        "images/a.txt",
        "images/sub/c.txt",
    ]
    row = prepare_row(_row_of(by_rel["a.png"]), SPEC, 0, LIMIT, masks.MaskPolicy("dir"))
    assert row["skip_reason"] == "" and row["mask_sha256"] == _sha(mask_dir / "a.png")
    assert _grid(row)[:, :4].min() == 1.0 and _grid(row)[:, 4:].max() == 0.0


def _sha(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- decode and prepare ------------------------------------------------------------------------------------------


def test_a_mask_is_cut_and_reduced_to_the_latent_grid(tmp_path):
    row = _prep(tmp_path, _half((64, 64)))
    assert row["skip_reason"] == ""
    grid = _grid(row)
    assert grid.shape == (8, 8) and row["mask"] == grid.astype(np.float16).tobytes()
    assert (grid[:, :4] == 1.0).all() and (grid[:, 4:] == 0.0).all()  # white stores exactly 1.0


def test_a_mask_of_another_size_is_scaled_to_the_image_first(tmp_path):
    same = _grid(_prep(tmp_path, _half((64, 64))))
    bigger = _prep(tmp_path, _half((256, 256)))
    assert bigger["skip_reason"] == ""
    assert np.abs(_grid(bigger) - same).max() < 0.05


def test_an_rgb_mask_counts_by_its_luminance(tmp_path):
    red = Image.new("RGB", (64, 64), (255, 0, 0))
    row = _prep(tmp_path, red)
    assert row["skip_reason"] == ""
    assert np.allclose(_grid(row), 76 / 255, atol=1e-3)  # ITU-R 601: 0.299 x 255, not the red channel's 1.0


@pytest.mark.parametrize(
    "data, reason",
    [(b"<html>not a mask</html>", "mask unreadable: not a decodable image"), (b"", "mask unreadable: zero-byte")],
)
def test_an_unreadable_mask_skips_its_image(tmp_path, data, reason):
    row = _prep(tmp_path, mask_bytes=data)
    assert row["skip_reason"].startswith(reason) and row["pixels"] == b"" and row["mask"] == b""


def test_a_vanished_mask_file_skips_its_image(tmp_path):
    img = tmp_path / "img.png"
    _save(img, cache_sets.picture(64, 64, 1))
    row = prepare_row(
        {"uri": str(img), "rel_path": "img.png", "mask_uri": str(tmp_path / "gone.png")},
        SPEC,
        0,
        LIMIT,
        masks.MaskPolicy("dir"),
    )
    assert row["skip_reason"].startswith("mask unreadable:") and "gone.png" in row["skip_reason"]


def test_an_all_zero_mask_skips_its_image(tmp_path):
    row = _prep(tmp_path, Image.new("L", (64, 64), 0))
    assert row["skip_reason"].startswith("mask all zero:")


def test_a_mask_black_inside_the_crop_skips_its_image(tmp_path):
    # A wide image cut to a square in its centre; the mask is white only on the left edge that the crop drops.
    arr = np.zeros((64, 160), np.uint8)
    arr[:, :10] = 255
    row = _prep(tmp_path, Image.fromarray(arr, "L"), image=cache_sets.picture(160, 64, 2))
    assert row["crop_left"] > 10 or row["skip_reason"]  # the crop really drops the white edge
    assert row["skip_reason"].startswith("mask all zero inside the image's crop")


def test_the_mask_is_cut_with_the_images_own_crop_box(tmp_path):
    spec = buckets.BucketSpec(resolution=64, latent_channels=4, crop="random", vae_scale_factor=8)
    arr = np.tile(np.linspace(0, 255, 230).astype(np.uint8), (100, 1))  # brighter to the right
    img_path, mask_path = tmp_path / "t.png", tmp_path / "m.png"
    _save(img_path, cache_sets.picture(230, 100, 3))
    Image.fromarray(arr, "L").save(mask_path)
    row = prepare_row(
        {"uri": str(img_path), "rel_path": "t.png", "mask_uri": str(mask_path)}, spec, 7, LIMIT, masks.MaskPolicy("dir")
    )
    p = buckets.plan(230, 100, spec, seed=7, salt="t.png")
    assert p.crop_left > 0 and row["crop_left"] == p.crop_left
    cut = Image.fromarray(arr, "L").resize((p.target_width, p.target_height), Image.Resampling.BILINEAR, box=p.crop_box)
    want = masks.area_average(np.asarray(cut, np.float32) / 255, 8).astype(np.float16)
    assert row["mask"] == want.tobytes()


def test_alpha_masks_come_from_the_image_and_the_vae_sees_the_composited_rgb(tmp_path):
    rgba = cache_sets.picture(64, 64, 5, mode="RGBA")
    alpha = np.zeros((64, 64), np.uint8)
    alpha[:32] = 255  # opaque top half
    rgba.putalpha(Image.fromarray(alpha, "L"))
    masked = _prep(tmp_path, image=rgba, policy=masks.MaskPolicy("alpha"))
    plain = _prep(tmp_path, image=rgba, policy=masks.NO_MASKS)
    assert masked["skip_reason"] == "" and masked["mask_sha256"] == masks.ALPHA
    grid = _grid(masked)
    assert (grid[:4] == 1.0).all() and (grid[4:] == 0.0).all()
    assert masked["pixels"] == plain["pixels"]  # the same composited-on-white RGB either way
    assert masked["sample_id"] == plain["sample_id"]  # the mask never moves a sample in the plan or its noise
    assert plain["mask"] == b"" and plain["mask_sha256"] == ""


@pytest.mark.parametrize("missing", ["skip", "ones"])
def test_an_image_without_alpha_follows_missing_mask(tmp_path, missing):
    row = _prep(tmp_path, policy=masks.MaskPolicy("alpha", missing))
    if missing == "skip":
        assert row["skip_reason"].startswith("mask missing: the image has no alpha channel")
    else:
        assert row["skip_reason"] == "" and row["mask_sha256"] == masks.ONES and (_grid(row) == 1.0).all()


def test_a_changed_mask_makes_the_row_stale_but_keeps_its_sample_id(tmp_path):
    fresh = _prep(tmp_path, _half((64, 64)))
    st = (tmp_path / "img.png").stat()
    prev = {
        "sample_id": fresh["sample_id"],
        "source_sha256": fresh["source_sha256"],
        "orig_w": 64,
        "orig_h": 64,
        "source_size": st.st_size,
        "source_mtime_ns": st.st_mtime_ns,
        "mask_sha256": fresh["mask_sha256"],
    }
    again = _prep(tmp_path, _half((64, 64)), prev=prev)
    assert again["reuse"] and again["mask_sha256"] == fresh["mask_sha256"]
    changed = _prep(tmp_path, _half((64, 64), left=0, right=255), prev=prev)
    assert not changed["reuse"] and changed["mask_sha256"] != fresh["mask_sha256"]
    assert changed["sample_id"] == fresh["sample_id"] and changed["mask"] != fresh["mask"]
    older = _prep(tmp_path, _half((64, 64)), prev={**prev, "mask_sha256": ""})  # a row cached without masks
    assert not older["reuse"]


# -- the latent grid and the family's tokens --------------------------------------------------------------------


def test_area_average_is_the_mean_of_each_cell():
    grid = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.float32)
    assert np.array_equal(masks.area_average(grid, 2), np.array([[2.5, 4.5]], np.float32))
    with pytest.raises(ValueError, match="does not split"):
        masks.area_average(np.zeros((3, 4)), 2)


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_pack_mask_packs_like_the_latent(family):
    fam = by_name(family)
    mask = torch.rand(2, 4, 6)
    tokens = fam.pack_mask(mask)
    # Every channel of a latent equal to the mask: each token holds, per channel, the cells it packs.
    latent = mask.unsqueeze(1).expand(2, 8, 4, 6).contiguous()
    packed = fam.pack(latent)
    per_channel = packed.view(*packed.shape[:2], 8, -1)
    assert (per_channel == per_channel[:, :, :1]).all()
    assert torch.allclose(tokens, per_channel[:, :, 0].mean(dim=-1), rtol=1e-6, atol=0)
    assert tokens.shape == (2, fam.seq_len(4, 6))


def test_pack_mask_by_hand():
    m = torch.tensor([[[1.0, 0.0, 0.5, 0.5], [1.0, 0.0, 0.5, 0.5]]])  # [1, 2, 4]
    assert torch.equal(by_name("flux1").pack_mask(m), torch.tensor([[0.5, 0.5]]))  # two 2x2 tokens
    assert torch.equal(by_name("flux2").pack_mask(m), m.reshape(1, 8))  # a token per cell, row-major


# -- the loss -----------------------------------------------------------------------------------------------------


def test_masked_loss_matches_a_hand_computation():
    pred = torch.tensor([[[1.0, 1.0], [3.0, 1.0], [0.0, 0.0]]])  # [B=1, N=3, D=2]
    target = torch.zeros(1, 3, 2)
    e = [1.0, 5.0, 0.0]  # per-token mean squared error over channels
    m = torch.tensor([[1.0, 0.5, 0.0]])
    floor = 0.2
    w = [floor + (1 - floor) * v for v in (1.0, 0.5, 0.0)]  # 1.0, 0.6, 0.2
    want = sum(wi * ei for wi, ei in zip(w, e)) / sum(w)  # (1 + 3) / 1.8
    got = flow.flow_loss(pred, target, torch.tensor([2.0]), flow.mask_weights(m, floor))
    assert torch.isclose(got, torch.tensor(2.0 * want), rtol=1e-6)


def test_masked_out_tokens_have_no_gradient_effect_at_floor_zero():
    torch.manual_seed(0)
    pred = torch.randn(2, 5, 4, requires_grad=True)
    target = torch.randn(2, 5, 4)
    m = torch.tensor([[1, 1, 0, 0, 0.5], [0, 1, 1, 0, 1]], dtype=torch.float32)
    flow.flow_loss(pred, target, torch.ones(2), flow.mask_weights(m, 0.0)).backward()
    assert (pred.grad[m == 0] == 0).all() and (pred.grad[m > 0] != 0).all()
    # Whatever the masked-out tokens predict, the loss is the same.
    other = pred.detach().clone()
    other[m == 0] += 100.0
    a = flow.flow_loss(pred.detach(), target, torch.ones(2), flow.mask_weights(m, 0.0))
    b = flow.flow_loss(other, target, torch.ones(2), flow.mask_weights(m, 0.0))
    assert torch.equal(a, b)


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (division by a scalar differs there)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)])
@pytest.mark.parametrize("floor", [0.0, 0.1, 0.37])
@pytest.mark.parametrize("n", [6, 768, 1000])  # token counts whose reciprocal is not exact
def test_an_all_ones_mask_is_bitwise_no_mask(floor, n, device):
    torch.manual_seed(n)
    target = torch.randn(3, n, 16).to(device)
    weights = (torch.rand(3) + 0.5).to(device)
    ones = by_name("flux1").pack_mask(torch.ones(3, 2, 2 * n))[:, :n].to(device)  # packed all-ones grid
    assert torch.equal(flow.mask_weights(ones, floor), torch.ones(3, n, device=device))
    grads, losses = [], []
    for token_weights in (None, flow.mask_weights(ones, floor)):
        pred = torch.randn(3, n, 16, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_(True)
        loss = flow.flow_loss(pred, target, weights, token_weights)
        loss.backward()
        losses.append(loss.detach())
        grads.append(pred.grad)
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])
    # ...and no mask is the expression the step has always used.
    pred = torch.randn(3, n, 16, generator=torch.Generator().manual_seed(1)).to(device)
    old = (weights.float() * ((pred.float() - target.float()) ** 2).flatten(1).mean(dim=1)).mean()
    assert torch.equal(old, losses[0])


def test_token_weights_must_match_the_tokens():
    with pytest.raises(ValueError, match="do not match"):
        flow.flow_loss(torch.zeros(1, 4, 2), torch.zeros(1, 4, 2), torch.ones(1), torch.ones(1, 3))


# -- the doctor ---------------------------------------------------------------------------------------------------


def test_the_doctor_reports_mask_coverage(tmp_path):
    images, mask_dir = _mask_dataset(tmp_path)
    (mask_dir / "sub/c.webp").write_bytes(b"garbage")  # unreadable
    _save(images / "e.png", cache_sets.picture(64, 64, 9))
    _save(mask_dir / "e.png", Image.new("L", (64, 64), 0))  # all zero
    cfg = _cfg(
        f"data.images_dir={images}",
        "data.mask=dir",
        f"data.mask_dir={mask_dir}",
        "data.resolution=64",
        f"model.path={tmp_path / 'no-model'}",
    )
    report = doctor.examine(cfg, workers=1)
    [d] = report.datasets
    assert d["masks"] == {
        "mode": "dir",
        "mask_dir": str(mask_dir),
        "missing_mask": "skip",
        "found": 2,
        "missing": 1,
        "unreadable": 1,
        "all_zero": 1,
    }
    text = "\n".join(doctor.render(report))
    assert f"masks (mask_dir {mask_dir}): 2 found, 1 missing (skipped), 1 unreadable, 1 all zero" in text


@pytest.mark.parametrize("in_mask_dir", [False, True])
def test_a_metadata_column_names_each_images_mask(tmp_path, in_mask_dir):
    root, mask_dir = tmp_path / "set", tmp_path / "masks"
    for i, name in enumerate(["a.png", "b.png", "c.png", "d.png"]):
        _save(root / name, cache_sets.picture(64, 64, i))
    where = mask_dir if in_mask_dir else root / "m"
    _save(where / "a_mask.png", _half((64, 64)))
    _save(where / "b_mask.png", _half((64, 64), left=0, right=255))
    prefix = "" if in_mask_dir else "m/"
    rows = [
        {"file_name": "a.png", "text": "a", "mask": f"{prefix}a_mask.png"},
        {"file_name": "b.png", "text": "b", "mask": f"{prefix}B_MASK.png"},  # any case
        {"file_name": "c.png", "text": "c", "mask": f"{prefix}gone.png"},
        {"file_name": "d.png", "text": "d", "mask": 7},
    ]
    (root / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [f"data.images_dir={root}", "data.caption_strategy=metadata", "data.mask=column"]
    found = discover(_cfg(*sets, *([f"data.mask_dir={mask_dir}"] if in_mask_dir else [])).data)
    by_rel = {s.rel_path: s for s in found.sources}
    assert set(by_rel) == {"a.png", "b.png"}  # the masks named inside the dataset are never training images
    assert by_rel["a.png"].mask_uri == str(where / "a_mask.png")
    assert by_rel["b.png"].mask_uri == str(where / "b_mask.png")
    assert sorted(s["source_uri"].rsplit("/", 1)[1] for s in found.skipped) == ["c.png", "d.png"]
    assert all(s["reason"].startswith("mask missing: metadata column 'mask'") for s in found.skipped)
    assert any("'mask' must be a file name, got 7" in p for p in found.problems)
    row = prepare_row(_row_of(by_rel["b.png"]), SPEC, 0, LIMIT, masks.MaskPolicy("column"))
    assert row["skip_reason"] == "" and (_grid(row)[:, 4:] == 1.0).all() and (_grid(row)[:, :4] == 0.0).all()


def test_mask_column_needs_metadata_captions(tmp_path):
    with pytest.raises(config.ConfigError, match="mask=column reads data.mask_column"):
        datasets.datasets_of(_cfg(f"data.images_dir={tmp_path}", "data.mask=column").data)


def test_mask_keys_enter_the_run_identity_only_with_masks(tmp_path):
    from rayflux.job import run_identity

    base = run_identity(_cfg(f"data.images_dir={tmp_path}"))
    assert run_identity(_cfg(f"data.images_dir={tmp_path}", "data.mask_floor=0.5")) == base
    alpha = run_identity(_cfg(f"data.images_dir={tmp_path}", "data.mask=alpha"))
    assert alpha != base
    assert run_identity(_cfg(f"data.images_dir={tmp_path}", "data.mask=alpha", "data.mask_floor=0.5")) != alpha


def test_the_eval_loss_scores_a_masked_sample_on_its_mask_as_training_weighs_it():
    """flow.per_sample_loss is what the eval loss averages (rayflux.train.observe.evaluation) and what the training loss
    weights: a mask's weighted mean over tokens, the plain mean without one."""
    pred, target = torch.zeros(2, 4, 3), torch.arange(24, dtype=torch.float32).reshape(2, 4, 3)
    plain = flow.per_sample_loss(pred, target)
    assert torch.equal(plain, (target**2).flatten(1).mean(dim=1))
    weights = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    masked = flow.per_sample_loss(pred, target, weights)
    assert masked[0].item() == pytest.approx(float((target[0, :2] ** 2).mean()))
    assert torch.equal(masked[1], plain[1])
    assert flow.flow_loss(pred, target, torch.ones(2), weights) == masked.mean()
