"""Keypoint R-CNN targets and minibatch validity (Detectron semantics: keypoint targets;
minibatch validity).

Kept from Detectron on purpose (docs/detectron_quirks.md): keypoint RoIs are sampled
independently of the box head's fg RoIs (Q5), rows without a gt wrap to the last gt like
NumPy's ``-1`` index (Q6, harmless: such rows are never fg), and the loss normaliser uses
nominal counts (Q34). Fixed: a zero-width (or zero-height) RoI divides by zero in
Detectron (Q25); here its extent is taken as 1 pixel, as in the mask rasteriser.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

import numpy as np

from lit_roidata import rng as rng_mod
from lit_roidata.minibatch.fpn import rois_blob

__all__ = ["keypoints_to_heatmap_labels", "add_keypoint_rcnn_blobs",
           "finalize_keypoint_minibatch", "check_keypoint_cfg"]


def check_keypoint_cfg(cfg: Any) -> tuple[int, int]:
    """``(NUM_KEYPOINTS, HEATMAP_SIZE)``, or a clear error if they are unset."""
    k, hm = int(cfg.KRCNN.NUM_KEYPOINTS), int(cfg.KRCNN.HEATMAP_SIZE)
    if k <= 0 or hm <= 0:
        raise ValueError("MODEL.KEYPOINTS_ON needs KRCNN.NUM_KEYPOINTS and KRCNN.HEATMAP_SIZE "
                         f"(got {k} and {hm}); COCO person keypoints use 17 and 56")
    return k, hm


def keypoints_to_heatmap_labels(keypoints: np.ndarray, rois: np.ndarray,
                                heatmap_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Linear heatmap index ``y*HM + x`` and validity of each keypoint in its RoI.

    Args:
        keypoints: ``(n, 3, K)`` rows ``x, y, v`` in original image pixels.
        rois: ``(n, 4)`` float32 boxes (original coordinates).
        heatmap_size: ``KRCNN.HEATMAP_SIZE``.

    Returns:
        ``(heatmaps, weights)``, both float32 ``(n, K)``; location is 0 where invalid.
    """
    HM = heatmap_size
    rois = np.asarray(rois, dtype=np.float32).reshape(-1, 4)
    extent = rois[:, 2:] - rois[:, :2]  # (n, 2): width and height
    # Detectron quirk Q25 (docs/detectron_quirks.md) guard, a no-op for real boxes
    scale = (HM / np.where(extent > 0, extent, np.float32(1)))[:, :, None]
    vis = keypoints[:, 2, :] > 0
    xy = keypoints[:, :2, :].astype(np.float32)
    boundary = xy == rois[:, 2:, None]
    xy = np.floor((xy - rois[:, :2, None]) * scale)
    xy[boundary] = HM - 1
    x, y = xy[:, 0], xy[:, 1]
    valid = ((x >= 0) & (y >= 0) & (x < HM) & (y < HM) & vis).astype(np.int32)
    return ((y * HM + x) * valid).astype(np.float32), valid.astype(np.float32)


def add_keypoint_rcnn_blobs(blobs: MutableMapping[str, Any], entry: Mapping[str, Any],
                            fg_rois_per_image: int, im_scale: float, batch_idx: int,
                            cfg: Any, rng: rng_mod.RNG) -> None:
    """Add ``keypoint_rois``, ``keypoint_locations_int32``, ``keypoint_weights`` for one
    image; draws ``choice`` only when there are more candidates than the fg quota."""
    K, HM = check_keypoint_cfg(cfg)
    gt_keypoints = np.asarray(entry["gt_keypoints"])
    if gt_keypoints.ndim != 3 or gt_keypoints.shape[2] != K:
        raise ValueError(f"image id {entry.get('id')}: gt_keypoints has shape "
                         f"{gt_keypoints.shape}, expected (R_gt, 3, {K}); check "
                         "KRCNN.NUM_KEYPOINTS against the dataset's keypoints")
    boxes = np.asarray(entry["boxes"], dtype=np.float32)
    max_overlaps = np.asarray(entry["max_overlaps"])
    gt_inds = np.where(np.asarray(entry["gt_classes"]) > 0)[0]
    box_to_gt = np.asarray(entry["box_to_gt_ind_map"]).astype(np.int64)
    if gt_inds.size == 0 or boxes.shape[0] == 0:
        kp_fg_inds = np.zeros((0,), dtype=np.int64)
    else:
        # -1 wraps to the last gt, as in Detectron (Detectron quirk Q6, docs/detectron_quirks.md)
        kps = gt_keypoints[gt_inds[box_to_gt]]
        xy = kps[:, :2, :]
        within = ((xy >= boxes[:, :2, None]) & (xy <= boxes[:, 2:, None])).all(axis=1)
        is_visible = np.sum((kps[:, 2, :] > 0) & within, axis=1) > 0
        kp_fg_inds = np.where((max_overlaps >= cfg.TRAIN.FG_THRESH) & is_visible)[0]
    if kp_fg_inds.size > fg_rois_per_image:  # drawn only when over the fg quota
        kp_fg_inds = rng_mod.choice(rng, kp_fg_inds, size=fg_rois_per_image, replace=False)
    sampled_rois = boxes[kp_fg_inds]
    maps = box_to_gt[kp_fg_inds]
    sampled_kps = -np.ones((len(sampled_rois), 3, K), dtype=gt_keypoints.dtype)
    has_gt = maps >= 0
    sampled_kps[has_gt] = gt_keypoints[gt_inds[maps[has_gt]]]
    heats, weights = keypoints_to_heatmap_labels(sampled_kps, sampled_rois, HM)
    blobs["keypoint_rois"] = rois_blob(sampled_rois * float(im_scale), batch_idx)
    blobs["keypoint_locations_int32"] = heats.reshape(-1, 1).astype(np.int32, copy=False)
    blobs["keypoint_weights"] = weights.reshape(-1, 1)  # (rows * K, 1), as the locations


def finalize_keypoint_minibatch(blobs: MutableMapping[str, Any], valid: bool, cfg: Any) -> bool:
    """Add ``keypoint_loss_normalizer`` and apply the validity rule (Detectron semantics: keypoint
    targets).

    Returns:
        ``valid and rows > 0 and visible > MIN_KEYPOINT_COUNT_FOR_VALID_MINIBATCH``.
    """
    weights = blobs["keypoint_weights"]
    num_visible = float(np.sum(weights))
    norm = num_visible / (cfg.TRAIN.IMS_PER_BATCH * cfg.TRAIN.BATCH_SIZE_PER_IM
                          * cfg.TRAIN.FG_FRACTION * cfg.KRCNN.NUM_KEYPOINTS)
    blobs["keypoint_loss_normalizer"] = np.array(norm, dtype=np.float32)
    return bool(valid and len(weights) > 0
                and num_visible > cfg.KRCNN.MIN_KEYPOINT_COUNT_FOR_VALID_MINIBATCH)

