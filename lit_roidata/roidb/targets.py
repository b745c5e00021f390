"""Bounding-box regression targets of one roidb entry (Detectron semantics: bounding-box regression
targets)."""

from __future__ import annotations

import numpy as np

from lit_roidata.boxes import bbox_overlaps, bbox_transform_targets

__all__ = ["compute_bbox_targets"]


def compute_bbox_targets(boxes: np.ndarray, max_overlaps: np.ndarray, max_classes: np.ndarray,
                         gt_classes: np.ndarray, is_crowd: np.ndarray, *, bbox_thresh: float,
                         cls_agnostic: bool,
                         weights: tuple[float, float, float, float]) -> np.ndarray:
    """Detectron's ``_compute_targets``: ``(R, 5)`` float32 ``(class, tx, ty, tw, th)``.

    Args:
        boxes: ``(R, 4)`` float32 entry boxes (gt rows first).
        max_overlaps, max_classes, gt_classes, is_crowd: the entry's per-row columns.
        bbox_thresh: ``TRAIN.BBOX_THRESH``.
        cls_agnostic: ``MODEL.CLS_AGNOSTIC_BBOX_REG``.
        weights: ``MODEL.BBOX_REG_WEIGHTS``.
    """
    targets = np.zeros((boxes.shape[0], 5), dtype=np.float32)
    gt_inds = np.flatnonzero((gt_classes > 0) & ~np.asarray(is_crowd, bool))
    ex_inds = np.flatnonzero(max_overlaps >= bbox_thresh)
    if gt_inds.size == 0 or ex_inds.size == 0:
        return targets
    assign = bbox_overlaps(boxes[ex_inds].astype(np.float32, copy=False),
                           boxes[gt_inds].astype(np.float32, copy=False)).argmax(axis=1)
    targets[ex_inds, 0] = 1 if cls_agnostic else max_classes[ex_inds]
    targets[ex_inds, 1:] = bbox_transform_targets(boxes[ex_inds], boxes[gt_inds[assign]],
                                                  tuple(weights))
    return targets
