"""The minibatch code as it was before the speed work (issue 10), kept as test oracles.

Each function is a verbatim copy of the package's implementation at the time it was
replaced; the equivalence tests compare the current code to these on many inputs.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

import cv2
import numpy as np
import pycocotools.mask as mask_util
import torch
from torchvision import tv_tensors

from lit_roidata import rng as rng_mod
from lit_roidata.minibatch.fast_rcnn import _expanded_targets
from lit_roidata.minibatch.keypoints import add_keypoint_rcnn_blobs
from lit_roidata.minibatch.mask import add_mask_rcnn_blobs, segm_as_rle, segm_polygons
from lit_roidata.minibatch.transport import shared_empty


def tv_masks(entry: Mapping[str, Any], rows: np.ndarray, scale: float, h: int, w: int,
             shared: bool = False) -> torch.Tensor:
    """torchvision_format._masks: one frPyObjects + merge + full decode per instance."""
    t = (shared_empty((rows.size, h, w), torch.uint8).zero_() if shared
         else torch.zeros((rows.size, h, w), dtype=torch.uint8))
    out = t.numpy()
    height, width = int(entry["height"]), int(entry["width"])
    for j, r in enumerate(rows):
        segm = entry["segms"][r]
        parts = segm_polygons(segm)
        if parts:
            rles = mask_util.frPyObjects([p.astype(np.float64) * scale for p in parts], h, w)
            out[j] = mask_util.decode(mask_util.merge(rles))
            continue
        rle = segm_as_rle(segm, height, width)
        if rle is not None:
            full = mask_util.decode(rle)
            out[j] = cv2.resize(full, (w, h), interpolation=cv2.INTER_NEAREST)
    return t


def tv_image_tensor(im: np.ndarray, pixel_format: str, shared: bool = False) -> tv_tensors.Image:
    """torchvision_format._image_tensor: a strided transpose copy."""
    src = im[:, :, ::-1] if pixel_format == "uint8" else im  # uint8: BGR -> RGB
    if shared:
        t = shared_empty((im.shape[2], im.shape[0], im.shape[1]), im.dtype)
        t.numpy()[...] = src.transpose(2, 0, 1)
        return tv_tensors.Image(t)
    return tv_tensors.Image(torch.from_numpy(np.ascontiguousarray(src.transpose(2, 0, 1))))


# --- fpn.py / fast_rcnn.py before the speed work ------------------------------------


def rois_blob(boxes: np.ndarray, batch_idx: int) -> np.ndarray:
    """``(n, 5)`` float32 rows ``(batch_idx, x1, y1, x2, y2)`` for ``(n, 4)`` scaled boxes."""
    batch_col = np.full((boxes.shape[0], 1), batch_idx, dtype=np.float32)
    return np.hstack((batch_col, boxes)).astype(np.float32, copy=False)


def add_multilevel_roi_blobs(blobs: MutableMapping[str, Any], blob_prefix: str,
                             rois: np.ndarray, target_lvls: np.ndarray, lvl_min: int,
                             lvl_max: int) -> None:
    """Write ``<prefix>_fpn<l>`` (rows of level l, original order) and
    ``<prefix>_idx_restore_int32`` so that ``concat(levels)[restore] == rois``."""
    order = []
    for lvl in range(lvl_min, lvl_max + 1):
        idx_lvl = np.where(target_lvls == lvl)[0]
        blobs[f"{blob_prefix}_fpn{lvl}"] = rois[idx_lvl, :]
        order.append(idx_lvl)
    idx_order = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
    blobs[f"{blob_prefix}_idx_restore_int32"] = np.argsort(idx_order, kind="stable").astype(
        np.int32, copy=False)


def fg_rois_per_image(cfg: Any) -> int:
    """Nominal fg quota ``round(FG_FRACTION * BATCH_SIZE_PER_IM)`` (16 for 64)."""
    return int(np.round(cfg.TRAIN.FG_FRACTION * int(cfg.TRAIN.BATCH_SIZE_PER_IM)))


def sample_rois(entry: Mapping[str, Any], im_scale: float, batch_idx: int, cfg: Any,
                rng: rng_mod.RNG, *, expand_targets: bool = True) -> dict[str, np.ndarray]:
    """Sample fg/bg RoIs of one image and build its Fast R-CNN (+mask/keypoint) blobs.

    Draw order: ``choice`` over fg candidates (if any), then over bg candidates (if
    any), then the keypoint draw — Detectron's order, so a ``RandomState`` seeded like
    Detectron's reproduces its RoIs. With ``expand_targets=False`` the compact
    ``(r, 5)`` targets are returned as ``_bbox_target_data`` instead of the three
    ``(r, 4C)`` blobs (the caller expands the whole minibatch at once).
    """
    rois_per_image = int(cfg.TRAIN.BATCH_SIZE_PER_IM)
    fg_quota = fg_rois_per_image(cfg)
    max_overlaps = np.asarray(entry["max_overlaps"])
    fg_inds = np.where(max_overlaps >= cfg.TRAIN.FG_THRESH)[0]
    n_fg = int(min(fg_quota, fg_inds.size))
    if fg_inds.size > 0:
        fg_inds = rng_mod.choice(rng, fg_inds, size=n_fg, replace=False)
    bg_inds = np.where((max_overlaps < cfg.TRAIN.BG_THRESH_HI)
                       & (max_overlaps >= cfg.TRAIN.BG_THRESH_LO))[0]
    n_bg = int(min(rois_per_image - n_fg, bg_inds.size))
    if bg_inds.size > 0:
        bg_inds = rng_mod.choice(rng, bg_inds, size=n_bg, replace=False)
    keep = np.append(fg_inds, bg_inds).astype(np.int64)
    labels = np.asarray(entry["max_classes"])[keep].astype(np.int32)
    labels[n_fg:] = 0
    sampled_boxes = np.asarray(entry["boxes"], dtype=np.float32)[keep]
    target_data = np.asarray(entry["bbox_targets"], dtype=np.float32)[keep]
    scale = float(im_scale)
    blob = {"rois": rois_blob(sampled_boxes * scale, batch_idx), "labels_int32": labels}
    if expand_targets:
        blob.update(_expanded_targets(target_data, cfg))
    else:
        blob["_bbox_target_data"] = target_data
    if cfg.MODEL.MASK_ON:
        add_mask_rcnn_blobs(blob, sampled_boxes, entry, scale, batch_idx, cfg, expand=False)
    if cfg.MODEL.KEYPOINTS_ON:
        add_keypoint_rcnn_blobs(blob, entry, fg_quota, scale, batch_idx, cfg, rng)
    return blob
