"""Loss masks in preparation: a mask file's or an alpha channel's pixels -> the stored-latent grid, or a skip reason.

A mask is cut exactly as its image: scaled to the image's upright size when it has another, cut with the image's own
crop box and resized to its bucket, then reduced to the family's stored-latent grid (one value per latent cell,
``vae_scale_factor`` pixels a side) by area average (:func:`area_average`). The family packs that grid into per-token
weights exactly as it packs the latent (:meth:`rayflux.families.base.Family.pack_mask`).

What a prepared row carries (:func:`prepare`): ``mask``, the grid as float16 bytes, row-major ``[latent_h,
latent_w]`` (b"" without masks), and ``mask_sha256``, what decides whether a cached row's mask is current: the mask
file's content hash, :data:`ONES` for a missing mask trained on its whole area, :data:`ALPHA` for the image's own
alpha (its content is the image's, which the sample id already hashes), "" without masks. It is not part of the
sample id: a mask must change neither a sample's place in the batch plan nor its noise, so that a mask of all ones
trains exactly the run without masks.

A bad or missing mask never becomes a silent all-ones mask: it is a recorded skip whose reason starts with ``mask``
(:data:`SKIP_PREFIX`), unless ``data.missing_mask=ones`` says a missing one trains on the whole image.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from rayflux import buckets, storage
from rayflux.cache.decode import BadImage, decode_mask

ONES = "ones"
"""``mask_sha256`` of a missing mask trained on the image's whole area (``data.missing_mask=ones``)."""
ALPHA = "alpha"
"""``mask_sha256`` of a mask taken from the image's alpha channel."""
SKIP_PREFIX = "mask "
"""Every skip reason of a mask starts so (``mask missing``, ``mask unreadable``, ``mask all zero``)."""
DTYPE = np.float16
"""The stored mask's dtype: 0..1 at 11 bits of precision, 1.0 exact."""


@dataclass(frozen=True)
class MaskPolicy:
    """One dataset's mask settings, as preparation needs them."""

    mode: str = "none"
    """``data.mask``: ``none``, ``dir``, ``column`` or ``alpha``."""
    missing: str = "skip"
    """``data.missing_mask``: ``skip`` or ``ones``."""

    @property
    def active(self) -> bool:
        return self.mode != "none"


NO_MASKS = MaskPolicy()


def policy_of(ds) -> MaskPolicy:
    """A :class:`~rayflux.config.DatasetConfig`'s :class:`MaskPolicy`."""
    return MaskPolicy(ds.mask, ds.missing_mask)


@dataclass(frozen=True)
class MaskInput:
    """A row's mask before its image is decoded: read and hashed, so a cached row's currency is known first."""

    sha256: str
    """What the row's ``mask_sha256`` will be (see the module's docstring)."""
    data: bytes = b""
    """The mask file's bytes (``mask=dir`` with a file), else b""."""


def area_average(grid: np.ndarray, cell: int) -> np.ndarray:
    """``[H, W] -> [H / cell, W / cell]``: the mean of each ``cell`` x ``cell`` block (float32). ``H`` and ``W``
    must be multiples of ``cell`` (a bucket's sides are multiples of the latent cell)."""
    h, w = grid.shape
    if h % cell or w % cell:
        raise ValueError(f"a {h}x{w} mask does not split into {cell}x{cell} latent cells")
    return grid.astype(np.float32).reshape(h // cell, cell, w // cell, cell).mean(axis=(1, 3))


def read(row: dict, policy: MaskPolicy) -> MaskInput | str | None:
    """The row's mask read and hashed, or a skip reason; None without masks. ``row["mask_uri"]`` is the mask file
    discovery matched (``mask=dir`` or ``column``; "" when it found none, which discovery already skipped unless
    ``missing_mask=ones``)."""
    if policy.mode == "none":
        return None
    if policy.mode == "alpha":
        return MaskInput(ALPHA)
    uri = row.get("mask_uri") or ""
    if not uri:
        return MaskInput(ONES) if policy.missing == "ones" else "mask missing: no mask file (missing_mask=skip)"
    try:
        data = storage.read_bytes(uri)
    except Exception as exc:  # noqa: BLE001 - any read failure is a recorded skip, not a crash
        return f"mask unreadable: {uri}: {type(exc).__name__}: {exc}"
    return MaskInput(hashlib.sha256(data).hexdigest(), data)


def current(prev_sha256: str, got: MaskInput | None) -> bool:
    """Whether a cached row whose mask hash is ``prev_sha256`` ("" for rows cached without masks) holds the mask
    ``got`` describes. An alpha mask (or its all-ones stand-in) is the image's own: the sample id decides."""
    if got is None:
        return prev_sha256 == ""
    if got.sha256 == ALPHA:
        return prev_sha256 in (ALPHA, ONES)
    return prev_sha256 == got.sha256


def prepare(
    got: MaskInput,
    alpha,
    size: tuple[int, int],
    plan: buckets.BucketPlan,
    cell: int,
    uri: str,
    *,
    max_pixels: int,
    policy: MaskPolicy,
) -> tuple[bytes, str] | str:
    """``(mask bytes, mask_sha256)`` for an image of upright ``size`` cut by ``plan``, or a skip reason. ``alpha``:
    the image's alpha channel (an ``L`` image, None when it has none) for ``mask=alpha``; ``uri``: the image's, for
    messages."""
    if got.sha256 == ALPHA and alpha is None:
        if policy.missing != "ones":
            return "mask missing: the image has no alpha channel (mask=alpha, missing_mask=skip)"
        got = MaskInput(ONES)
    if got.sha256 == ONES:
        return np.ones((plan.latent_height, plan.latent_width), DTYPE).tobytes(), ONES
    img = alpha
    if got.sha256 != ALPHA:
        try:
            img = decode_mask(got.data, max_pixels)
        except BadImage as exc:
            return f"mask unreadable: {exc}"
    try:
        grid = to_grid(img, size, plan, cell)
    except BadImage as exc:
        return f"{exc} ({uri})"
    return grid.tobytes(), got.sha256


def to_grid(img, size: tuple[int, int], plan: buckets.BucketPlan, cell: int) -> np.ndarray:
    """An ``L`` mask image -> its image's stored-latent grid (float16 ``[latent_h, latent_w]`` in 0..1), or
    :class:`BadImage` when nothing of it is left to train on (all zero, or all zero inside the crop)."""
    from PIL import Image

    if img.getextrema()[1] == 0:
        raise BadImage("mask all zero: the mask is black everywhere, nothing of the image would train")
    # Bilinear, not the image's Lanczos: a mask has no detail to keep sharp, and Lanczos rings past black and white.
    # The 8-bit steps keep a white mask exactly 255, so an all-white mask stores exactly 1.0.
    if img.size != size:
        img = img.resize(size, Image.Resampling.BILINEAR)
    cut = img.resize((plan.target_width, plan.target_height), Image.Resampling.BILINEAR, box=plan.crop_box)
    grid = area_average(np.asarray(cut, dtype=np.float32) / np.float32(255.0), cell).astype(DTYPE)
    if not grid.any():
        raise BadImage("mask all zero inside the image's crop: nothing of the cut image would train")
    if grid.shape != (plan.latent_height, plan.latent_width):  # the bucket plan and the cell disagree: a bug
        raise ValueError(f"mask grid {grid.shape} is not the latent's {(plan.latent_height, plan.latent_width)}")
    return grid


def from_bytes(data: bytes, latent_h: int, latent_w: int) -> np.ndarray:
    """A stored mask's grid ``[latent_h, latent_w]`` (float16) from its bytes, its size checked."""
    want = latent_h * latent_w * np.dtype(DTYPE).itemsize
    if len(data) != want:
        raise ValueError(f"a {latent_h}x{latent_w} mask holds {want} bytes, got {len(data)}")
    return np.frombuffer(data, DTYPE).reshape(latent_h, latent_w)
