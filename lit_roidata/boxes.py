"""Box primitives shared by the roidb builder and the minibatch builders (Detectron semantics:
minibatch primitives).

Every function follows Detectron's "+1" convention: a box ``[x1, y1, x2, y2]`` holds
inclusive pixel indices, so its width is ``x2 - x1 + 1``. NumPy versions serve the
roidb and the loader; the ``*_torch`` versions serve code that runs on the model's
device every step (second-stage labels, Detectron semantics: end-to-end training).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported lazily: the roidb builder needs NumPy only.
    import torch

__all__ = ["iou_kernel", "iou_kernel_torch", "bbox_overlaps", "bbox_overlaps_pairs",
           "bbox_overlaps_torch", "bbox_transform_targets", "bbox_transform_targets_torch",
           "bbox_transform_inv", "bbox_transform_inv_torch", "clip_boxes", "flip_boxes",
           "box_areas"]


def box_areas(boxes: np.ndarray) -> np.ndarray:
    """Areas with the +1 convention."""
    return (boxes[..., 2] - boxes[..., 0] + 1) * (boxes[..., 3] - boxes[..., 1] + 1)


def iou_kernel(ax1: np.ndarray, ay1: np.ndarray, ax2: np.ndarray, ay2: np.ndarray,
               a_area: np.ndarray, bx1: np.ndarray, by1: np.ndarray, bx2: np.ndarray,
               by2: np.ndarray, b_area: np.ndarray, *, out: np.ndarray | None = None,
               work: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
               positive_areas: bool = False) -> np.ndarray:
    """Detectron's per-pair IoU arithmetic, the one NumPy kernel every IoU site calls.

    Coordinates and areas (:func:`box_areas`) are float64 arrays that broadcast to one
    shape; the result is float32. The steps are those of Detectron's Cython
    ``bbox_overlaps``: ``iw = min(x2) - max(x1) + 1`` and likewise ``ih`` (clamped at
    0), ``inter = iw * ih``, ``union = a_area + b_area - inter``, IoU ``inter / union``
    computed in float64 and rounded once to float32, and 0 wherever ``inter > 0`` fails
    (including NaN). Blocked callers pass ``out`` (float32) and ``work`` (three float64
    buffers of the broadcast shape, overwritten) so no temporaries are allocated, and
    ``positive_areas=True`` when every area is known to be > 0 (then ``union > 0``, and
    the division alone already gives the 0s).
    """
    if work is None:
        shape = np.broadcast_shapes(np.shape(ax1), np.shape(bx1), np.shape(a_area),
                                    np.shape(b_area))
        work = (np.empty(shape), np.empty(shape), np.empty(shape))
    iw, ih, tmp = work
    if out is None:
        out = np.empty(iw.shape, np.float32)
    for side, lo_a, lo_b, hi_a, hi_b in ((iw, ax1, bx1, ax2, bx2), (ih, ay1, by1, ay2, by2)):
        np.minimum(hi_a, hi_b, out=side)
        side -= np.maximum(lo_a, lo_b, out=tmp)
        side += 1
        np.maximum(side, 0, out=side)
    iw *= ih  # intersection
    np.add(a_area, b_area, out=tmp)
    tmp -= iw  # union
    if positive_areas:
        np.divide(iw, tmp, out=out)  # computed in float64, rounded once to float32
        return out
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        np.divide(iw, tmp, out=out)
    out[~(iw > 0)] = 0.0  # Detectron writes 0 unless iw > 0 and ih > 0
    return out


def _rows(boxes: Any) -> np.ndarray:
    """``boxes`` as float64 rows of four."""
    return np.asarray(boxes, dtype=np.float64).reshape(-1, 4)


def _iou_boxes(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """:func:`iou_kernel` of float64 boxes ``a[..., :4]`` and ``b[..., :4]``, broadcast."""
    return iou_kernel(a[..., 0], a[..., 1], a[..., 2], a[..., 3], box_areas(a),
                      b[..., 0], b[..., 1], b[..., 2], b[..., 3], box_areas(b))


def bbox_overlaps(boxes: np.ndarray, query: np.ndarray) -> np.ndarray:
    """IoU matrix ``(N, K)`` of ``boxes`` against ``query`` (Detectron's ``bbox_overlaps``).

    ``iw = min(x2) - max(x1) + 1`` and likewise ``ih``; pairs with ``iw <= 0`` or
    ``ih <= 0`` have IoU 0. Computed in float64 and returned as float32, like the
    Cython original (the arithmetic is :func:`iou_kernel`'s).
    """
    return _iou_boxes(_rows(boxes)[:, None, :], _rows(query)[None, :, :])


def bbox_overlaps_pairs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise IoU of ``a[i]`` and ``b[i]`` (``(N,)``), the arithmetic of :func:`bbox_overlaps`.

    For sparse work (only the anchor/gt pairs that can matter), where the dense
    ``(N, K)`` matrix would be wasteful.
    """
    return _iou_boxes(_rows(a), _rows(b))


def iou_kernel_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`iou_kernel` on any device: IoU of boxes ``a[..., :4]`` and
    ``b[..., :4]`` (broadcast), computed in float64 with Detectron's steps, float32 result."""
    import torch

    a, b = a.to(torch.float64), b.to(torch.float64)
    lo = torch.maximum(a[..., :2], b[..., :2])
    wh = (torch.minimum(a[..., 2:4], b[..., 2:4]) - lo + 1).clamp_(min=0)
    inter = wh[..., 0] * wh[..., 1]
    union = box_areas(a) + box_areas(b) - inter
    return torch.where(inter > 0, inter / union, torch.zeros_like(inter)).to(torch.float32)


def bbox_overlaps_torch(boxes: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Torch twin of :func:`bbox_overlaps` on any device (float32 result)."""
    return iou_kernel_torch(boxes.reshape(-1, 4)[:, None, :], query.reshape(-1, 4)[None, :, :])


def _targets(xp: Any, ex: Any, gt: Any, weights: tuple[float, float, float, float]) -> Any:
    """The target arithmetic on float64 rows, for ``xp`` = numpy or torch (same steps)."""
    wx, wy, ww, wh = weights
    ex_w, ex_h = ex[:, 2] - ex[:, 0] + 1.0, ex[:, 3] - ex[:, 1] + 1.0
    gt_w, gt_h = gt[:, 2] - gt[:, 0] + 1.0, gt[:, 3] - gt[:, 1] + 1.0
    dx = (gt[:, 0] + 0.5 * gt_w) - (ex[:, 0] + 0.5 * ex_w)
    dy = (gt[:, 1] + 0.5 * gt_h) - (ex[:, 1] + 0.5 * ex_h)
    return xp.stack([wx * dx / ex_w, wy * dy / ex_h, ww * xp.log(gt_w / ex_w),
                     wh * xp.log(gt_h / ex_h)], 1)


def bbox_transform_targets(ex_rois: np.ndarray, gt_rois: np.ndarray,
                           weights: tuple[float, float, float, float]) -> np.ndarray:
    """Regression targets ``(tx, ty, tw, th)`` from ``ex_rois`` to ``gt_rois`` (Detectron semantics:
    bounding-box regression targets)."""
    return _targets(np, _rows(ex_rois), _rows(gt_rois), weights).astype(np.float32)


def bbox_transform_targets_torch(ex_rois: torch.Tensor, gt_rois: torch.Tensor,
                                 weights: tuple[float, float, float, float]) -> torch.Tensor:
    """Torch twin of :func:`bbox_transform_targets` (float32 result)."""
    import torch

    ex, gt = ex_rois.reshape(-1, 4).to(torch.float64), gt_rois.reshape(-1, 4).to(torch.float64)
    return _targets(torch, ex, gt, weights).to(torch.float32)


def _decode(xp: Any, b: Any, d: Any, weights: tuple[float, float, float, float],
            clip: float | None) -> Any:
    """The decoding arithmetic, for ``xp`` = numpy or torch (same steps)."""
    wx, wy, ww, wh = weights
    w, h = b[:, 2] - b[:, 0] + 1.0, b[:, 3] - b[:, 1] + 1.0
    cx, cy = b[:, 0] + 0.5 * w, b[:, 1] + 0.5 * h
    dw, dh = d[:, 2] / ww, d[:, 3] / wh
    if clip is not None:
        dw, dh = dw.clip(max=clip), dh.clip(max=clip)
    pcx, pcy = d[:, 0] / wx * w + cx, d[:, 1] / wy * h + cy
    pw, ph = xp.exp(dw) * w, xp.exp(dh) * h
    return xp.stack([pcx - 0.5 * pw, pcy - 0.5 * ph, pcx + 0.5 * pw - 1, pcy + 0.5 * ph - 1], 1)


def bbox_transform_inv(boxes: np.ndarray, deltas: np.ndarray,
                       weights: tuple[float, float, float, float]) -> np.ndarray:
    """Decode ``deltas`` relative to ``boxes``: the inverse of :func:`bbox_transform_targets`."""
    return _decode(np, _rows(boxes), _rows(deltas), weights, None)


def bbox_transform_inv_torch(boxes: torch.Tensor, deltas: torch.Tensor,
                             weights: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0),
                             clip: float | None = None) -> torch.Tensor:
    """Torch twin of :func:`bbox_transform_inv` (Detectron's ``bbox_transform``).

    Computes in the dtype of ``deltas``. ``clip`` (Detectron's ``BBOX_XFORM_CLIP``,
    ``log(1000/16)``) caps ``dw, dh`` after dividing by their weights, so no box grows
    more than ``1000/16`` times its reference; ``None`` caps nothing.
    """
    import torch

    d = deltas.reshape(-1, 4)
    return _decode(torch, boxes.reshape(-1, 4).to(d.dtype), d, weights, clip)


def clip_boxes(boxes: np.ndarray, height: int, width: int) -> np.ndarray:
    """Clip to ``[0, width-1] x [0, height-1]`` (a new array)."""
    out = np.array(boxes, copy=True)
    out[:, 0::2] = np.clip(out[:, 0::2], 0, width - 1)
    out[:, 1::2] = np.clip(out[:, 1::2], 0, height - 1)
    return out


def flip_boxes(boxes: np.ndarray, width: int) -> np.ndarray:
    """Horizontal mirror in pixel-index space: ``x1' = W - x2 - 1``, ``x2' = W - x1 - 1``."""
    out = np.array(boxes, copy=True)
    out[:, 0] = width - boxes[:, 2] - 1
    out[:, 2] = width - boxes[:, 0] - 1
    return out
