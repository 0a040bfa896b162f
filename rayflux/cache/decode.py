"""Bytes in, an upright RGB image out, or a :class:`BadImage` that says why not.

Real datasets hold truncated downloads, empty files, HTML saved as ``.jpg``, decompression bombs, 16-bit and
palette PNGs, CMYK JPEGs and phone photos that are only upright through their EXIF orientation. Every one of these
either decodes to the RGB image a viewer would show, or raises :class:`BadImage` with a reason for the skipped report.
"""

from __future__ import annotations

import io
import warnings

import numpy as np

# Modes whose samples are wider than 8 bits; each maps to the full-scale value of its usual source.
_WIDE_MODES = {"I;16": 65535.0, "I;16B": 65535.0, "I;16L": 65535.0, "I;16N": 65535.0, "I": 65535.0, "F": 1.0}


class BadImage(ValueError):
    """An input that cannot become a training image; the message is the recorded skip reason."""


def _to_8bit(img):
    """Scale a wide-sample image to ``L`` by its mode's full scale, never by its own maximum.

    Scaling by the image's maximum would brighten dark images; ``I`` is taken as 16-bit (how 16-bit PNG and TIFF
    grey images often open) and ``F`` as 0..1.
    """
    from PIL import Image

    arr = np.asarray(img, dtype=np.float64)
    scaled = np.clip(np.round(arr / _WIDE_MODES[img.mode] * 255.0), 0, 255).astype(np.uint8)
    return Image.fromarray(scaled, "L")


def _has_alpha(img) -> bool:
    return img.mode in ("RGBA", "RGBa", "LA", "La", "PA") or (
        img.mode in ("P", "L", "RGB") and "transparency" in img.info
    )


def to_rgb(img):
    """Convert any Pillow mode to RGB; transparency is composited onto white rather than dropped to black."""
    from PIL import Image

    if img.mode in _WIDE_MODES:
        img = _to_8bit(img)
    if _has_alpha(img):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _orient(img):
    from PIL import ImageOps

    try:
        return ImageOps.exif_transpose(img)
    except Exception:  # noqa: BLE001 - a broken EXIF block must not cost the image; keep it as stored
        return img


def _open(data: bytes, max_pixels: int):
    """Decode ``data`` fully into an upright ``PIL.Image`` in its own mode, or raise :class:`BadImage`.

    The pixel count is checked from the header, before any pixel is decoded, so a bomb costs no memory.
    """
    from PIL import Image

    if not data:
        raise BadImage("zero-byte file")
    try:
        with warnings.catch_warnings():
            # Pillow warns above its own limit; ours (data.max_image_pixels) is the one that decides.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise BadImage(f"decompression bomb: {exc}") from None
    except Image.UnidentifiedImageError:
        raise BadImage("not a decodable image: no image format recognises these bytes") from None
    except Exception as exc:  # noqa: BLE001 - a known format whose header is broken
        raise BadImage(f"not a decodable image: {type(exc).__name__}: {exc}") from None
    w, h = img.size
    if w * h > max_pixels:
        raise BadImage(f"decompression bomb: {w}x{h} exceeds data.max_image_pixels={max_pixels}")
    try:
        img.load()
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt pixel data
        raise BadImage(f"corrupt or truncated image data: {type(exc).__name__}: {exc}") from None
    return _orient(img)


def decode(data: bytes, max_pixels: int):
    """Decode ``data`` fully into an upright RGB ``PIL.Image``, or raise :class:`BadImage`."""
    return decode_with_alpha(data, max_pixels, alpha=False)[0]


def decode_with_alpha(data: bytes, max_pixels: int, alpha: bool = True):
    """``(upright RGB image, its alpha channel as an ``L`` image or None when it has none)``, or :class:`BadImage`.

    The RGB image is the one :func:`decode` gives, transparency composited on white, whether or not the alpha is
    wanted: with ``data.mask=alpha`` the VAE still encodes what a viewer shows, so a mask changes only the loss."""
    img = _open(data, max_pixels)
    try:
        rgb = to_rgb(img)
        mask = img.convert("RGBA").getchannel("A") if alpha and _has_alpha(img) else None
    except Exception as exc:  # noqa: BLE001 - a mode Pillow cannot convert (e.g. LAB without a profile)
        raise BadImage(f"unsupported image mode {img.mode}: {type(exc).__name__}: {exc}") from None
    return rgb, mask


def decode_mask(data: bytes, max_pixels: int):
    """A mask file's bytes as an upright 8-bit grayscale (``L``) image, or :class:`BadImage`.

    A colour mask counts by its luminance (Pillow's ITU-R 601 ``L`` conversion); a mask file's own alpha channel is
    ignored (its colour is the mask); 16-bit masks are scaled by their full scale, as images are."""
    img = _open(data, max_pixels)
    try:
        if img.mode in _WIDE_MODES:
            return _to_8bit(img)
        return img if img.mode == "L" else img.convert("RGB").convert("L")
    except Exception as exc:  # noqa: BLE001 - a mode Pillow cannot convert
        raise BadImage(f"unsupported mask mode {img.mode}: {type(exc).__name__}: {exc}") from None
