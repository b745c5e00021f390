"""Minibatches for torchvision detection models: image tensors and target dicts.

Same images as the Detectron blob (decode, flip, one scale per image from
``TRAIN.SCALES`` with the ``MAX_SIZE`` cap, same draws), but unpadded and with
torchvision's conventions:

* **images**: ``tv_tensors.Image`` ``(3, h, w)``; ``pixel_format="uint8"`` gives RGB
  uint8 (what torchvision models expect after ``/ 255``), ``"detectron"`` gives
  Detectron's BGR float32 minus ``PIXEL_MEANS``.
* **coordinates**: continuous pixel edges in the *scaled* image. A Detectron box
  ``[x1, y1, x2, y2]`` (inclusive pixel indices) becomes
  ``[x1*s, y1*s, (x2+1)*s, (y2+1)*s]``; a keypoint at pixel index ``x`` becomes
  ``(x + 0.5) * s`` (pixel centre); polygons (already continuous in COCO) are scaled.
* **targets**: ``boxes`` (``BoundingBoxes``, XYXY, ``canvas_size=(h, w)``), ``labels``
  int64 (contiguous ids), ``image_id``, non-crowd gt only; ``masks`` (``Mask`` uint8
  ``(N, h, w)``) with ``MODEL.MASK_ON`` (``compact_masks``: ``mask_crops`` and
  ``mask_boxes`` instead, pasted by :func:`~lit_roidata.minibatch.device.paste_mask_crops`);
  ``keypoints`` float32 ``(N, K, 3)`` rows ``x, y, v`` with ``MODEL.KEYPOINTS_ON``;
  ``proposals`` (``BoundingBoxes``) when the entry has proposal rows; ``crowd_boxes``;
  and ``scale``, ``orig_size``, ``flipped``;
  for LVIS roidbs also ``neg_category_ids`` and ``not_exhaustive_category_ids`` (int64,
  contiguous class ids like ``labels``; :mod:`lit_roidata.roidb.lvis`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import cv2
import numpy as np
import pycocotools.mask as mask_util
import torch
from torchvision import tv_tensors

from lit_roidata import rng as rng_mod
from lit_roidata.minibatch.image import ImageLoader, load_and_scale, split_into
from lit_roidata.minibatch.mask import decode_rle_into, segm_as_rle, segm_polygons
from lit_roidata.minibatch.roidb_blob import LVIS_KEYS
from lit_roidata.minibatch.shm_pool import pooled_reduce
from lit_roidata.minibatch.transport import shared_empty

__all__ = ["TorchvisionBatch", "to_continuous_boxes", "build_torchvision_batch"]


class TorchvisionBatch(tuple):
    """``(images, targets)``; ``.meta`` holds the block metadata (read it before a
    device transfer: Lightning rebuilds tuples and drops the attribute)."""

    meta: dict[str, Any] | None = None
    shm_arena: Any = None  # a worker's shared-memory pool slot

    def __new__(cls, items: Any = (), meta: dict[str, Any] | None = None) -> "TorchvisionBatch":
        obj = super().__new__(cls, items)
        obj.meta = meta
        return obj

    def __reduce__(self) -> tuple:
        if self.shm_arena is not None:
            return pooled_reduce(TorchvisionBatch, (tuple(self), self.meta), self.shm_arena)
        return (TorchvisionBatch, (tuple(self), self.meta))


def to_continuous_boxes(boxes: np.ndarray, scale: float) -> np.ndarray:
    """Detectron inclusive boxes to continuous XYXY in the scaled frame (float32)."""
    b = np.asarray(boxes, dtype=np.float32).reshape(-1, 4).copy()
    b[:, 2:] += 1
    return b * np.float32(scale)


def _masks(entry: Mapping[str, Any], rows: np.ndarray, scale: float, h: int, w: int,
           shared: bool = False) -> torch.Tensor:
    # shared_empty is zero-filled already (a new segment, or a pool slot re-zeroed).
    t = (shared_empty((rows.size, h, w), torch.uint8) if shared
         else torch.zeros((rows.size, h, w), dtype=torch.uint8))
    out = t.numpy()
    polys: list[np.ndarray] = []  # every polygon part of the image: one pycocotools call
    spans: list[tuple[int, int, int]] = []  # (mask row, first part, part count)
    for j, segm in enumerate([entry["segms"][r] for r in rows]):
        if parts := segm_polygons(segm):
            spans.append((j, len(polys), len(parts)))
            polys.extend(p.astype(np.float64) * scale for p in parts)
        elif (rle := segm_as_rle(segm, int(entry["height"]), int(entry["width"]))) is not None:
            out[j] = cv2.resize(mask_util.decode(rle), (w, h), interpolation=cv2.INTER_NEAREST)
    if polys:
        rles = mask_util.frPyObjects(polys, h, w)
        for j, first, n in spans:
            # merge of one RLE returns it unchanged (pycocotools' rleMerge)
            rle = rles[first] if n == 1 else mask_util.merge(rles[first:first + n])
            decode_rle_into(rle["counts"], out[j])
    return t


def _mask_crops(full: np.ndarray, shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each mask of ``full`` ``(n, h, w)`` cut to the box of its pixels, all concatenated
    and bit-packed: ``(bits, boxes)`` as :func:`~lit_roidata.minibatch.device.paste_mask_crops`
    reads them."""
    boxes = np.zeros((len(full), 4), np.int32)
    crops = []
    for j, (r, c) in enumerate(zip(full.any(2), full.any(1))):
        ys, xs = np.flatnonzero(r), np.flatnonzero(c)
        if ys.size:
            boxes[j] = ys[0], xs[0], ys[-1] + 1, xs[-1] + 1
            crops.append(full[j, ys[0]:ys[-1] + 1, xs[0]:xs[-1] + 1].ravel())
    out = []
    for a in (np.packbits(np.concatenate(crops)) if crops else np.zeros(0, np.uint8), boxes):
        t = shared_empty(a.shape, a.dtype) if shared else torch.from_numpy(a)
        t.numpy()[...] = a
        out.append(t)
    return out[0], out[1]


def _image_tensor(im: np.ndarray, pixel_format: str, shared: bool = False) -> tv_tensors.Image:
    h, w, c = im.shape  # shared: a DataLoader worker sends it without a copy
    t = (shared_empty((c, h, w), im.dtype) if shared
         else torch.from_numpy(np.empty((c, h, w), dtype=im.dtype)))
    out = t.numpy()  # uint8: BGR -> RGB
    split_into(im, [out[i] for i in (range(c - 1, -1, -1) if pixel_format == "uint8"
                                     else range(c))])
    return tv_tensors.Image(t)


def make_target(entry: Mapping[str, Any], scale: float, size: tuple[int, int], cfg: Any, *,
                shared: bool = False, compact_masks: bool = False) -> dict:
    """The target dict of one image (see the module docstring for conventions).

    ``shared=True`` allocates the masks in shared memory (for DataLoader workers);
    ``compact_masks=True`` gives them as bit-packed crops.
    """
    h, w = size
    boxes = np.asarray(entry["boxes"], dtype=np.float32).reshape(-1, 4)
    gt_classes = np.asarray(entry["gt_classes"])
    is_crowd = np.asarray(entry["is_crowd"]).astype(bool)
    is_gt = gt_classes > 0
    gt_rows, crowd_rows, prop_rows = (np.flatnonzero(rows) for rows in (
        is_gt & ~is_crowd, is_gt & is_crowd, ~is_gt))

    def bb(rows: np.ndarray) -> tv_tensors.BoundingBoxes:
        return tv_tensors.BoundingBoxes(torch.from_numpy(to_continuous_boxes(boxes[rows], scale)),
                                        format="XYXY", canvas_size=(h, w))

    target: dict[str, Any] = {
        "boxes": bb(gt_rows), "labels": torch.from_numpy(gt_classes[gt_rows].astype(np.int64)),
        "image_id": int(entry["id"]), "crowd_boxes": bb(crowd_rows), "scale": float(scale),
        "orig_size": (int(entry["height"]), int(entry["width"])),
        "flipped": bool(entry.get("flipped", False))}
    if cfg.MODEL.MASK_ON and compact_masks:
        full = _masks(entry, gt_rows, scale, h, w).numpy()
        target["mask_crops"], target["mask_boxes"] = _mask_crops(full, shared)
    elif cfg.MODEL.MASK_ON:
        target["masks"] = tv_tensors.Mask(_masks(entry, gt_rows, scale, h, w, shared))
    if cfg.MODEL.KEYPOINTS_ON and "gt_keypoints" in entry:
        kps = np.asarray(entry["gt_keypoints"])[gt_rows].astype(np.float32)  # (N, 3, K)
        out = np.zeros((gt_rows.size, kps.shape[2], 3), dtype=np.float32)  # (N, K, 3)
        out[:, :, :2] = np.where((kps[:, 2, :] > 0)[..., None],
                                 (kps[:, :2, :].transpose(0, 2, 1) + 0.5) * scale, 0)
        out[:, :, 2] = kps[:, 2, :]
        target["keypoints"] = torch.from_numpy(out)
    if prop_rows.size:
        target["proposals"] = bb(prop_rows)
    target.update({key: torch.from_numpy(np.asarray(entry[key]).astype(np.int64))
                   for key in LVIS_KEYS if key in entry})  # LVIS roidbs only
    return target


def build_torchvision_batch(entries: Sequence[Mapping[str, Any]], cfg: Any, rng: rng_mod.RNG, *,
                            pixel_format: str = "uint8", loader: ImageLoader | None = None,
                            augment: Any = None, shared: bool = False, compact_masks: bool = False
                            ) -> tuple[list[tv_tensors.Image], list[dict]]:
    """Images and torchvision-style targets for a block of roidb entries.

    Args:
        entries: roidb entries; cfg: the Detectron config; rng: the block's generator
            (the scale draw is the same as for the Detectron blob).
        pixel_format: ``"uint8"`` (RGB uint8) or ``"detectron"`` (BGR float32 - means).
        loader, augment: as :func:`~lit_roidata.minibatch.image.build_image_blob`.
        shared: build the images and masks in shared memory (what a DataLoader worker
            sends then crosses to the main process without a copy).
        compact_masks: masks as bit-packed crops (``mask_format="compact"``), pasted
            into full-image masks on the device by
            :func:`~lit_roidata.minibatch.device.finish_batch`.

    Returns:
        ``(images, targets)``.
    """
    ims, scales, used = load_and_scale(entries, cfg, rng, pixel_format=pixel_format,
                                       loader=loader, augment=augment)
    images = [_image_tensor(im, pixel_format, shared) for im in ims]
    targets = [make_target(e, s, im.shape[:2], cfg, shared=shared, compact_masks=compact_masks)
               for e, s, im in zip(used, scales, ims)]
    return images, targets
