"""The one bucket function: original image size + config -> crop box, target size, latent shape and bucket key.

Every stage that needs a size calls :func:`plan`: preparation crops with it, ``cache verify`` recomputes it for
every row, and the dataset doctor reports it. Validation at write and train time reads a row's expected latent shape
from its bucket key with :func:`latent_shape_of`, the same arithmetic. SimpleTuner's latent shape mismatches came
from two rounding paths that disagreed; here there is only one.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BucketSpec:
    """The knobs that decide a bucket. Built from ``DataConfig`` plus the model's alignment and latent channels."""

    resolution: int = 512
    """Shorter-edge pixels, or the square root of the target area."""
    resolution_type: str = "area"
    """``area`` or ``shorter_edge``."""
    alignment: int = 16
    """Target sides are multiples of this: a latent cell's pixels times the transformer's patch packing (FLUX.1:
    8 x 2; FLUX.2, whose stored latents are already patchified: 16 x 1)."""
    crop: str = "center"
    """``center`` or ``random``."""
    max_aspect: float = 2.5
    """Aspect ratios beyond this are cropped to it."""
    min_image_size: int = 64
    """Shorter edges below this are rejected."""
    vae_scale_factor: int = 8
    """Pixel-to-latent downscale of a stored latent."""
    latent_channels: int = 16
    """Channels of a stored latent."""
    pack: int = 2
    """Side of the patches the transformer packs stored latent cells into (FLUX.1: 2; FLUX.2: 1)."""


@dataclass(frozen=True)
class BucketPlan:
    """Where to crop one image and what comes out of the VAE for it."""

    crop_left: int
    crop_top: int
    crop_width: int
    crop_height: int
    target_width: int
    target_height: int
    latent_channels: int
    latent_height: int
    latent_width: int

    @property
    def key(self) -> str:
        """Bucket key, ``"<width>x<height>"`` in pixels; equal keys mean equal latent shapes."""
        return f"{self.target_width}x{self.target_height}"

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        return (self.latent_channels, self.latent_height, self.latent_width)

    @property
    def crop_box(self) -> tuple[int, int, int, int]:
        """PIL-style (left, top, right, bottom)."""
        return (self.crop_left, self.crop_top, self.crop_left + self.crop_width, self.crop_top + self.crop_height)


class ImageTooSmall(ValueError):
    """The image's shorter edge is under ``min_image_size``."""


def check_spec(spec: BucketSpec) -> None:
    """Raise ValueError for knobs no image could satisfy, so that a bad config fails before any work starts."""
    if spec.resolution_type not in ("area", "shorter_edge"):
        raise ValueError(f"unknown resolution_type {spec.resolution_type!r}; expected area or shorter_edge")
    if spec.crop not in ("center", "random"):
        raise ValueError(f"unknown crop mode {spec.crop!r}; expected center or random")
    step = spec.pack * spec.vae_scale_factor
    if spec.alignment <= 0 or spec.alignment % step != 0:
        raise ValueError(
            f"alignment {spec.alignment} must be a positive multiple of {spec.pack} x vae_scale_factor ({step}): the "
            f"latent has a cell per {spec.vae_scale_factor} pixels and the transformer packs {spec.pack}x{spec.pack} cells"
        )
    if spec.max_aspect < 1:
        raise ValueError(f"max_aspect must be >= 1, got {spec.max_aspect}")


def _latent_side(pixels: int, vae_scale_factor: int) -> int:
    # Exact: target sides are multiples of the alignment, itself a multiple of the VAE's downscale.
    return pixels // vae_scale_factor


def _round_to(value: float, multiple: int) -> int:
    return max(multiple, int(round(value / multiple)) * multiple)


def effective_step(bucket_step: int, resolution: int, alignment: int) -> int:
    """Bucket sides' granularity: ``data.bucket_step`` (kohya's ``bucket_reso_steps``), rounded down to the model's
    ``alignment`` and at most ``resolution / 8``, so a small resolution still gets buckets of several shapes."""
    cap = max(alignment, (resolution // 8) // alignment * alignment)
    return max(alignment, min(bucket_step, cap) // alignment * alignment)


def _within_aspect(w: int, h: int, step: int, max_aspect: float) -> tuple[int, int]:
    """Shorten the longer side by whole steps until the rounded bucket keeps ``max_aspect``: rounding both sides
    can overshoot it (1200x200 at 2.5 once gave 208x80, 2.6)."""
    while max(w, h) > max_aspect * min(w, h) and max(w, h) > step:
        if w >= h:
            w -= step
        else:
            h -= step
    return w, h


def target_size(width: int, height: int, spec: BucketSpec) -> tuple[int, int]:
    """Aligned (width, height) for an image of this aspect ratio, with the aspect (after rounding) kept within
    ``max_aspect``."""
    aspect = min(max(width / height, 1.0 / spec.max_aspect), spec.max_aspect)
    if spec.resolution_type == "area":
        area = float(spec.resolution) ** 2
        w, h = math.sqrt(area * aspect), math.sqrt(area / aspect)
    elif spec.resolution_type == "shorter_edge":
        if aspect >= 1:
            w, h = spec.resolution * aspect, float(spec.resolution)
        else:
            w, h = float(spec.resolution), spec.resolution / aspect
    else:
        raise ValueError(f"unknown resolution_type {spec.resolution_type!r}")
    return _within_aspect(_round_to(w, spec.alignment), _round_to(h, spec.alignment), spec.alignment, spec.max_aspect)


def _offset(slack: int, crop: str, seed: int, salt: str) -> int:
    if slack <= 0:
        return 0
    if crop == "center":
        return slack // 2
    if crop == "random":
        # A hash rather than a global RNG: the same (seed, image) gives the same crop on any worker, in any order.
        digest = hashlib.sha256(f"{seed}:{salt}".encode()).digest()
        return int.from_bytes(digest[:8], "little") % (slack + 1)
    raise ValueError(f"unknown crop mode {crop!r}")


def plan(width: int, height: int, spec: BucketSpec, seed: int = 0, salt: str = "") -> BucketPlan:
    """Plan the crop and resize of one ``width`` x ``height`` image.

    The crop box has the target's aspect ratio and is as large as the image allows; it is then resized to the
    target. ``seed`` and ``salt`` (usually the sample's path) only matter for ``crop="random"``.
    """
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    check_spec(spec)
    if min(width, height) < spec.min_image_size:
        raise ImageTooSmall(f"image is {width}x{height}; shorter edge is under min_image_size={spec.min_image_size}")
    tw, th = target_size(width, height, spec)
    # Largest box of aspect tw/th inside the image; compare in integers to avoid float ties.
    if width * th >= height * tw:
        crop_h = height
        crop_w = min(width, max(1, round(height * tw / th)))
    else:
        crop_w = width
        crop_h = min(height, max(1, round(width * th / tw)))
    left = _offset(width - crop_w, spec.crop, seed, f"{salt}:x")
    top = _offset(height - crop_h, spec.crop, seed, f"{salt}:y")
    return BucketPlan(
        crop_left=left,
        crop_top=top,
        crop_width=crop_w,
        crop_height=crop_h,
        target_width=tw,
        target_height=th,
        latent_channels=spec.latent_channels,
        latent_height=_latent_side(th, spec.vae_scale_factor),
        latent_width=_latent_side(tw, spec.vae_scale_factor),
    )


def parse_key(key: str) -> tuple[int, int]:
    """``"512x384"`` -> (512, 384) as (width, height)."""
    w, sep, h = key.partition("x")
    if not sep or not w.isdigit() or not h.isdigit():
        raise ValueError(f"not a bucket key: {key!r}; expected '<width>x<height>'")
    return int(w), int(h)


def latent_shape_of(key: str, latent_channels: int, vae_scale_factor: int) -> tuple[int, int, int]:
    """The latent shape every sample of bucket ``key`` has: the same arithmetic :func:`plan` used to make the key."""
    w, h = parse_key(key)
    return (latent_channels, _latent_side(h, vae_scale_factor), _latent_side(w, vae_scale_factor))
