"""The ``data`` blob: scale, pad and stack the images of one minibatch (Detectron semantics: image
blob).

Two pixel formats share every geometric step (scale draw, ``MAX_SIZE`` cap, OpenCV
``INTER_LINEAR`` resize, bottom/right padding to ``FPN.COARSEST_STRIDE``):

* ``"detectron"``: Detectron's blob exactly: BGR float32, ``PIXEL_MEANS`` subtracted
  *before* the resize, NCHW, padding 0.
* ``"uint8"`` (the fast default of :class:`~lit_roidata.dataset.RoIBlockDataset`): BGR
  uint8 NCHW, padding 0. It is resized with OpenCV's uint8 kernel (within one grey level
  of the float kernel) and is 4x smaller through worker pipes and the host-to-device
  copy; :func:`~lit_roidata.minibatch.device.normalize_on_device` then produces the
  Detectron blob on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import cv2
import numpy as np

from lit_roidata import rng as rng_mod
from lit_roidata.minibatch.decode import load_image
from lit_roidata.minibatch.device import normalize_on_device  # noqa: F401  (re-export)

__all__ = ["PIXEL_FORMATS", "ImageBatch", "get_target_scale", "scale_image", "im_list_to_blob",
           "load_and_scale", "im_info_rows", "build_image_blob", "get_image_blob",
           "normalize_on_device"]

PIXEL_FORMATS = ("uint8", "detectron")

Allocator = Callable[[tuple[int, ...], np.dtype], np.ndarray]
ImageLoader = Callable[[Mapping[str, Any]], np.ndarray]


@dataclass
class ImageBatch:
    """The image side of one minibatch.

    Attributes:
        data: ``(n, 3, Hpad, Wpad)`` blob (uint8 or float32, see module doc).
        im_scales: per-image scale factors (Detectron's ``im_scales``).
        image_sizes: ``(n, 2)`` int32 ``(h, w)`` of each resized image inside the padding.
        im_info: ``(n, 3)`` float32 rows ``[round(H*s), round(W*s), s]`` with the roidb's
            ``H``/``W`` (Detectron semantics: image blob, Detectron quirk Q9
            (docs/detectron_quirks.md)).
        entries: the entries the targets must be built from (the input entries, or
            their augmented copies when an augmentation pipeline ran).
    """

    data: np.ndarray
    im_scales: list[float]
    image_sizes: np.ndarray
    im_info: np.ndarray
    entries: list[Mapping[str, Any]] = field(default_factory=list)


def get_target_scale(im_size_min: float, im_size_max: float, target_size: float,
                     max_size: float) -> float:
    """Detectron's scale: shorter side to ``target_size`` unless the longer side would
    round to more than ``max_size`` (then longer side to ``max_size``)."""
    im_scale = float(target_size) / float(im_size_min)
    if np.round(im_scale * im_size_max) > max_size:
        im_scale = float(max_size) / float(im_size_max)
    return im_scale


def scale_image(im: np.ndarray, target_size: int, max_size: int, *, pixel_format: str,
                pixel_means: Sequence[float]) -> tuple[np.ndarray, float]:
    """Detectron's ``prep_im_for_blob`` for one BGR uint8 image (HWC).

    Returns:
        The resized HWC image (uint8, or float32 minus means for ``"detectron"``)
        and its scale.
    """
    scale = get_target_scale(min(im.shape[:2]), max(im.shape[:2]), target_size, max_size)
    if pixel_format == "detectron":
        im = im.astype(np.float32)
        # Detectron keeps PIXEL_MEANS as a float64 (1, 1, 3) array; subtracting it in place
        # from float32 pixels rounds once from float64, which normalize_on_device mirrors
        im -= np.asarray(pixel_means, dtype=np.float64).reshape(1, 1, 3)
    elif pixel_format != "uint8":
        raise ValueError(f"pixel_format must be one of {PIXEL_FORMATS}, got {pixel_format!r}")
    return cv2.resize(im, None, None, fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR), scale


def _new_blob(sizes: Sequence[tuple[int, int]], dtype: Any, fpn_on: bool, coarsest_stride: int,
              alloc: Allocator | None) -> np.ndarray:
    """The zeroed ``(n, 3, Hmax, Wmax)`` blob for images of ``sizes``, the canvas rounded up
    to the stride when FPN is on; from ``alloc`` when given."""
    stride = float(coarsest_stride)
    hmax, wmax = (max(s[k] for s in sizes) for k in (0, 1))
    if fpn_on:
        hmax, wmax = (int(math.ceil(v / stride) * stride) for v in (hmax, wmax))
    shape = (len(sizes), 3, hmax, wmax)
    return alloc(shape, np.dtype(dtype)) if alloc is not None else np.zeros(shape, dtype)


def im_list_to_blob(ims: Sequence[np.ndarray], *, fpn_on: bool = False,
                    coarsest_stride: int = 32, alloc: Allocator | None = None) -> np.ndarray:
    """Stack HWC images into a zero-padded NCHW blob (top-left aligned).

    Args:
        ims: HWC images of one dtype (uint8 or float32).
        fpn_on, coarsest_stride: pad the canvas to a multiple of the stride (Detectron semantics:
        image blob step 4).
        alloc: optional ``(shape, dtype) -> array`` to place the blob, e.g. in shared
            memory; must return zeros.
    """
    if not ims:
        raise ValueError("im_list_to_blob needs at least one image")
    blob = _new_blob([im.shape[:2] for im in ims], ims[0].dtype, fpn_on, coarsest_stride, alloc)
    for i, im in enumerate(ims):
        split_into(im, [blob[i, c, :im.shape[0], :im.shape[1]] for c in range(3)])
    return blob


def split_into(im: np.ndarray, planes: Sequence[np.ndarray]) -> None:
    """De-interleave HWC ``im`` into ``planes`` with ``cv2.split`` (SIMD, ~3x faster than
    a strided transpose copy; no per-plane temporaries where OpenCV writes in place)."""
    for plane, got in zip(planes, cv2.split(im, list(planes))):
        if not np.shares_memory(plane, got):  # OpenCV could not write in place
            plane[...] = got


def draw_scales(entries: Sequence[Any], cfg: Any, rng: rng_mod.RNG) -> list[int]:
    """One target size of ``cfg.TRAIN.SCALES`` per image, drawn first for the whole
    minibatch (Detectron order)."""
    if not entries:
        raise ValueError("a minibatch needs at least one roidb entry")
    if not (scales := tuple(cfg.TRAIN.SCALES)):
        raise ValueError("TRAIN.SCALES is empty; set at least one target size")
    return [scales[int(i)] for i in rng_mod.randint(rng, 0, len(scales), size=len(entries))]


def _is_rgb(load: ImageLoader) -> bool:
    return getattr(load, "channel_order", "bgr") == "rgb"  # an RGB loader says so


def load_and_scale(entries: Sequence[Mapping[str, Any]], cfg: Any, rng: rng_mod.RNG, *,
                   pixel_format: str = "detectron", loader: ImageLoader | None = None,
                   augment: Any = None) -> tuple[list[np.ndarray], list[float], list[Any]]:
    """Decode, (augment,) and scale each image, the scale draws first (Detectron semantics:
    image blob, step 1).

    Returns:
        ``(images, im_scales, entries)``: resized HWC BGR images, their scales, and the
        entries the targets must use (augmented copies when ``augment`` changed them).

    Raises:
        BadImageError: from the loader, naming the file, image id and dataset.
    """
    targets = draw_scales(entries, cfg, rng)
    load = loader or load_image
    aug_seeds = augment.draw_seeds(len(entries), rng) if augment is not None else None
    out = []  # (image, scale, entry) per entry
    for i, entry in enumerate(entries):
        im = load(entry)
        if _is_rgb(load):
            im = cv2.cvtColor(im, cv2.COLOR_RGB2BGR)
        if augment is not None:
            im, entry = augment.apply(im, entry, seed=aug_seeds[i])
        im, scale = scale_image(im, targets[i], cfg.TRAIN.MAX_SIZE,
                                pixel_format=pixel_format, pixel_means=cfg.PIXEL_MEANS)
        out.append((im, scale, entry))
    ims, im_scales, out_entries = (list(col) for col in zip(*out))
    return ims, im_scales, out_entries


def im_info_rows(entries: Sequence[Mapping[str, Any]], im_scales: Sequence[float]) -> np.ndarray:
    """``(n, 3)`` float32 ``[round(H*s), round(W*s), s]`` from the roidb size (Detectron semantics:
    image blob, Detectron quirk Q9 (docs/detectron_quirks.md))."""
    return np.array([[np.round(e["height"] * s), np.round(e["width"] * s), s]
                     for e, s in zip(entries, im_scales)], dtype=np.float32).reshape(-1, 3)


def build_image_blob(entries: Sequence[Mapping[str, Any]], cfg: Any, rng: rng_mod.RNG, *,
                     pixel_format: str = "detectron", loader: ImageLoader | None = None,
                     augment: Any = None, alloc: Allocator | None = None) -> ImageBatch:
    """Build the image side of a minibatch (Detectron semantics: image blob), keeping Detectron's
    draw order.

    Args:
        entries: roidb entries of one minibatch.
        cfg: the Detectron config (``TRAIN.SCALES``, ``TRAIN.MAX_SIZE``, ``FPN``,
            ``PIXEL_MEANS``).
        rng: ``numpy.random.Generator`` or ``RandomState`` (see :mod:`lit_roidata.rng`).
        pixel_format: ``"detectron"`` or ``"uint8"``.
        loader: ``entry -> BGR uint8 HWC`` (default :func:`~.decode.load_image`).
        augment: optional :class:`~lit_roidata.minibatch.augment.Augmentation`, applied
            per image before scaling; it may change the entries' geometry.
        alloc: optional blob allocator (see :func:`im_list_to_blob`).

    Raises:
        BadImageError: from the loader, naming the file, image id and dataset.
    """
    if pixel_format == "uint8" and augment is None:
        return _build_uint8_planes(entries, cfg, rng, loader or load_image, alloc)
    ims, im_scales, out_entries = load_and_scale(entries, cfg, rng, pixel_format=pixel_format,
                                                 loader=loader, augment=augment)
    data = im_list_to_blob(ims, fpn_on=cfg.FPN.FPN_ON, coarsest_stride=cfg.FPN.COARSEST_STRIDE,
                           alloc=alloc)
    sizes = np.array([im.shape[:2] for im in ims], dtype=np.int32).reshape(-1, 2)
    return ImageBatch(data=data, im_scales=im_scales, image_sizes=sizes,
                      im_info=im_info_rows(out_entries, im_scales), entries=out_entries)


def _build_uint8_planes(entries: Sequence[Mapping[str, Any]], cfg: Any, rng: rng_mod.RNG,
                        load: ImageLoader, alloc: Allocator | None) -> ImageBatch:
    """The ``"uint8"`` blob: each channel of the decoded image resized straight into its
    BGR plane of the blob (no resized HWC image, no de-interleaving pass; an RGB loader's
    channels go to planes 2, 1, 0, with no conversion pass).

    The same draws and pixels as :func:`load_and_scale` + :func:`im_list_to_blob`:
    ``INTER_LINEAR`` treats every channel alike, and the destination size is OpenCV's
    own for ``fx = fy = scale`` (``round(w * scale)``, half to even), so passing the
    plane as ``dst`` makes OpenCV write into it (checked).
    """
    targets = draw_scales(entries, cfg, rng)
    srcs = [load(entry) for entry in entries]
    im_scales = [get_target_scale(min(im.shape[:2]), max(im.shape[:2]), t, cfg.TRAIN.MAX_SIZE)
                 for im, t in zip(srcs, targets)]
    sizes = [(round(im.shape[0] * s), round(im.shape[1] * s)) for im, s in zip(srcs, im_scales)]
    blob = _new_blob(sizes, np.uint8, cfg.FPN.FPN_ON, cfg.FPN.COARSEST_STRIDE, alloc)
    for i, (im, scale, (h, w)) in enumerate(zip(srcs, im_scales, sizes)):
        for c, plane in enumerate(cv2.split(im)):  # B, G, R (or R, G, B -> 2, 1, 0)
            dst = blob[i, 2 - c if _is_rgb(load) else c, :h, :w]
            out = cv2.resize(plane, None, dst, fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR)
            if not np.shares_memory(out, dst):  # OpenCV allocated: copy (same size only)
                dst[...] = out
    return ImageBatch(data=blob, im_scales=im_scales,
                      image_sizes=np.array(sizes, dtype=np.int32).reshape(-1, 2),
                      im_info=im_info_rows(entries, im_scales), entries=list(entries))


def get_image_blob(entries: Sequence[Mapping[str, Any]], cfg: Any,
                   rng: rng_mod.RNG) -> tuple[np.ndarray, list[float]]:
    """Detectron's ``_get_image_blob``: the float32 ``data`` blob and ``im_scales``.

    Args:
        entries: roidb entries of one minibatch.
        cfg: the Detectron config.
        rng: generator for the per-image scale draw (one ``randint`` for all images).

    Returns:
        ``(data, im_scales)``: BGR float32 NCHW minus ``PIXEL_MEANS``, and the scales.
    """
    batch = build_image_blob(entries, cfg, rng, pixel_format="detectron")
    return batch.data, batch.im_scales
