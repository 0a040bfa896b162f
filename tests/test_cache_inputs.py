"""Messy inputs: every Pillow mode becomes the RGB a viewer shows, EXIF orientation is applied, broken files and
captions become recorded skips, and ``cache.strict`` turns the first one into a clear error."""

import json

import cache_sets
import numpy as np
import pytest
from PIL import Image

from rayflux import buckets, config
from rayflux.cache import generations
from rayflux.cache.decode import BadImage, decode
from rayflux.cache.prepare import prepare_row
from rayflux.discovery.in_process import discover

LIMIT = 10_000_000


def _png(img: Image.Image, **kw) -> bytes:
    return cache_sets.encoded(img, "PNG", **kw)


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _px(img: Image.Image, x: int, y: int) -> tuple[int, int, int]:
    return img.getpixel((x, y))


def test_alpha_is_composited_on_white():
    rgba = Image.new("RGBA", (4, 1))
    rgba.putdata([(255, 0, 0, 0), (0, 0, 255, 255), (0, 0, 0, 128), (0, 255, 0, 64)])
    out = decode(_png(rgba), LIMIT)
    assert out.mode == "RGB"
    assert _px(out, 0, 0) == (255, 255, 255)  # fully transparent: white, not the hidden red
    assert _px(out, 1, 0) == (0, 0, 255)
    assert all(abs(c - 127) <= 1 for c in _px(out, 2, 0))  # half-transparent black over white
    assert _px(out, 3, 0)[0] > 180 and _px(out, 3, 0)[1] == 255


def test_la_and_palette_transparency_are_composited_on_white():
    la = Image.new("LA", (3, 1))
    la.putdata([(0, 0), (0, 255), (0, 128)])
    out = decode(_png(la), LIMIT)
    assert [_px(out, x, 0) for x in range(2)] == [(255, 255, 255), (0, 0, 0)]
    assert all(abs(c - 127) <= 1 for c in _px(out, 2, 0))

    p = Image.new("P", (3, 1))
    p.putpalette([10, 20, 30, 200, 0, 0, 0, 0, 200] + [0] * 759)
    p.putdata([0, 1, 2])
    out = decode(_png(p, transparency=0), LIMIT)
    assert [_px(out, x, 0) for x in range(3)] == [(255, 255, 255), (200, 0, 0), (0, 0, 200)]


def test_sixteen_bit_grey_is_scaled_by_full_scale_not_by_its_maximum():
    grey = Image.fromarray(np.array([[0, 32768, 65535, 16384]], dtype=np.uint16))
    assert grey.mode == "I;16"
    out = decode(_png(grey), LIMIT)
    assert [_px(out, x, 0)[0] for x in range(4)] == [0, 128, 255, 64]
    dark = Image.fromarray(np.array([[0, 1000]], dtype=np.uint16))
    assert _px(decode(_png(dark), LIMIT), 1, 0) == (4, 4, 4)  # stays dark: 1000/65535*255


def test_cmyk_jpeg_converts_to_its_rgb_colours():
    cmyk = Image.new("CMYK", (32, 8))
    for x, ink in enumerate([(0, 0, 0, 0), (255, 0, 0, 0), (0, 0, 0, 255), (0, 255, 255, 0)]):
        cmyk.paste(ink, (x * 8, 0, x * 8 + 8, 8))
    out = decode(cache_sets.encoded(cmyk, "JPEG", quality=100), LIMIT)
    expected = [(255, 255, 255), (0, 255, 255), (0, 0, 0), (255, 0, 0)]
    for x, want in enumerate(expected):
        assert all(abs(a - b) <= 8 for a, b in zip(_px(out, x * 8 + 4, 4), want)), (x, _px(out, x * 8 + 4, 4))


@pytest.mark.parametrize(
    "orientation, corner",
    [(1, "top-left"), (3, "bottom-right"), (6, "top-right"), (8, "bottom-left")],
)
def test_exif_orientation_is_applied(orientation, corner):
    stored = Image.new("RGB", (96, 64), (255, 255, 255))
    stored.paste((255, 0, 0), (0, 0, 24, 16))  # a red mark in the stored top-left corner
    exif = Image.Exif()
    exif[0x0112] = orientation
    out = decode(cache_sets.encoded(stored, "JPEG", exif=exif.tobytes(), quality=95), LIMIT)
    w, h = out.size
    assert (w, h) == ((64, 96) if orientation in (6, 8) else (96, 64))
    x = 3 if "left" in corner else w - 4
    y = 3 if "top" in corner else h - 4
    r, g, b = _px(out, x, y)
    assert r > 200 and g < 60 and b < 60, (corner, out.size)
    assert min(_px(out, w - 1 - x, h - 1 - y)) > 230  # the opposite corner stays white


@pytest.mark.parametrize(
    "data, reason",
    [
        (b"", "zero-byte file"),
        (b"<html>not an image</html>", "not a decodable image"),
        (cache_sets.png_header_only(40_000, 40_000), "decompression bomb"),
        (cache_sets.png_header_only(4_000, 4_000), "exceeds data.max_image_pixels=10000000"),
        (_half(_png(cache_sets.picture(64, 64, 1))), "truncated"),
        (_half(cache_sets.encoded(cache_sets.picture(64, 64, 1), "JPEG")), "truncated"),
    ],
    ids=["zero-byte", "html", "pillow-bomb", "our-limit", "truncated-png", "truncated-jpeg"],
)
def test_bad_bytes_raise_bad_image_with_a_reason(data, reason):
    with pytest.raises(BadImage, match=f"(?i){reason}"):
        decode(data, LIMIT)


def _spec(**kw) -> buckets.BucketSpec:
    return buckets.BucketSpec(resolution=64, latent_channels=4, **kw)


def test_prepare_crops_and_resizes_per_the_plan_and_skips_small_images(tmp_path):
    (tmp_path / "wide.png").write_bytes(_png(cache_sets.picture(200, 100, 3)))
    (tmp_path / "small.png").write_bytes(_png(cache_sets.picture(50, 90, 3)))
    row = prepare_row({"uri": str(tmp_path / "wide.png"), "rel_path": "wide.png"}, _spec(), 0, LIMIT)
    p = buckets.plan(200, 100, _spec())
    assert row["skip_reason"] == "" and row["bucket"] == p.key
    assert len(row["pixels"]) == p.target_width * p.target_height * 3
    small = prepare_row({"uri": str(tmp_path / "small.png"), "rel_path": "small.png"}, _spec(), 0, LIMIT)
    assert small["skip_reason"] == "image is 50x90; shorter edge is under min_image_size=64" and small["pixels"] == b""


def test_prepare_reuses_a_known_sample_without_decoding(tmp_path):
    path = tmp_path / "img.png"
    path.write_bytes(_png(cache_sets.picture(120, 80, 4)))
    st = path.stat()
    src = {"uri": str(path), "rel_path": "d/img.png", "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    fresh = prepare_row(src, _spec(), 0, LIMIT)
    # The previous generation's index row for the same relative path, as the driver attaches it.
    prev = {
        "sample_id": fresh["sample_id"],
        "source_sha256": fresh["source_sha256"],
        "orig_w": 120,
        "orig_h": 80,
        "source_size": st.st_size,
        "source_mtime_ns": st.st_mtime_ns - 1,
    }
    again = prepare_row({**src, "prev": json.dumps(prev)}, _spec(), 0, LIMIT)
    assert again["reuse"] and again["pixels"] == b""  # known by its content hash: read, not decoded
    assert {k: again[k] for k in ("sample_id", "bucket", "crop_left", "target_w")} == {
        k: fresh[k] for k in ("sample_id", "bucket", "crop_left", "target_w")
    }
    # Same size and mtime: not even read (the file is gone, and the row is still reused, hash and all).
    path.unlink()
    unread = prepare_row({**src, "prev": json.dumps({**prev, "source_mtime_ns": st.st_mtime_ns})}, _spec(), 0, LIMIT)
    assert unread["reuse"] and unread["source_sha256"] == fresh["source_sha256"]
    other = tmp_path / "other.png"
    other.write_bytes(_png(cache_sets.picture(120, 80, 4)))
    elsewhere = prepare_row({**src, "uri": str(other), "rel_path": "e/img.png"}, _spec(), 0, LIMIT)
    assert not elsewhere["reuse"] and elsewhere["sample_id"] != fresh["sample_id"]  # same bytes, other folder


@pytest.mark.parametrize(
    "policy, expected",
    [("skip", None), ("empty", ""), ("instance", "a photo of sks dog"), ("filename", "my dog photo")],
)
def test_missing_caption_policies(tmp_path, policy, expected):
    (tmp_path / "my_dog-photo.png").write_bytes(_png(cache_sets.picture(64, 64, 5)))
    cfg = config.load(
        None,
        [f"data.images_dir={tmp_path}", f"data.missing_caption={policy}", "data.instance_prompt=a photo of sks dog"],
    )
    found = discover(cfg.data)
    assert found.discovered == 1
    if expected is None:
        assert not found.sources and "no caption" in found.skipped[0]["reason"]
    else:
        assert [s.caption for s in found.sources] == [expected]


def test_non_utf8_caption_files_are_skipped_with_a_reason(tmp_path):
    (tmp_path / "a.png").write_bytes(_png(cache_sets.picture(64, 64, 6)))
    (tmp_path / "a.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "b.png").write_bytes(_png(cache_sets.picture(64, 64, 7)))
    (tmp_path / "b.txt").write_bytes("\ufeffcaf\xe9 cr\xe8me\n".encode("utf-8"))  # UTF-8 with a BOM is fine
    found = discover(config.load(None, [f"data.images_dir={tmp_path}"]).data)
    assert [s.caption for s in found.sources] == ["caf\xe9 cr\xe8me"]
    assert found.skipped[0]["source_uri"].endswith("a.png") and "not UTF-8" in found.skipped[0]["reason"]


def test_strict_mode_fails_on_the_first_bad_input_and_commits_nothing(ray_session, tiny_model, tmp_path):
    from rayflux.cache.stage import BadInputError

    images = tmp_path / "images"
    images.mkdir()
    (images / "good.png").write_bytes(_png(cache_sets.picture(64, 64, 8)))
    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    cfg = cache_sets.job_config(tiny_model, images, tmp_path, "data.resolution=64", "cache.strict=true")
    with pytest.raises(BadInputError, match=r"cache.strict: .*broken.png: not a decodable image"):
        cache_sets.build(cfg)
    assert not list((tmp_path / "cache").rglob(generations.MANIFEST))

    (images / "bad.txt").write_bytes(b"\xff\xfe")
    (images / "bad.png").write_bytes(_png(cache_sets.picture(64, 64, 9)))
    with pytest.raises(BadInputError, match=r"bad.png: caption file is not UTF-8"):
        cache_sets.build(cfg)  # found during discovery, before any Ray work
