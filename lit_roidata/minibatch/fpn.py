"""RoI blobs: ``(batch_idx, x1, y1, x2, y2)`` rows and their FPN multilevel distribution
with restore indices (Detectron semantics: FPN RoI levels)."""

from __future__ import annotations

from typing import Any, MutableMapping, Sequence

import numpy as np

from lit_roidata.minibatch.names import multilevel_roi_prefixes

__all__ = ["rois_blob", "map_rois_to_fpn_levels", "add_multilevel_roi_blobs",
           "add_multilevel_rois"]


def rois_blob(boxes: np.ndarray, batch_idx: int) -> np.ndarray:
    """``(n, 5)`` float32 rows ``(batch_idx, x1, y1, x2, y2)`` for ``(n, 4)`` scaled boxes."""
    boxes = np.asarray(boxes)  # (any dtype: rounded once to float32, as through np.hstack)
    out = np.empty((boxes.shape[0], 5), dtype=np.float32)
    out[:, 0] = batch_idx
    out[:, 1:] = boxes
    return out


def map_rois_to_fpn_levels(rois: np.ndarray, k_min: int, k_max: int, *,
                           canonical_scale: float = 224, canonical_level: int = 4) -> np.ndarray:
    """FPN level of each box: ``floor(lvl0 + log2(sqrt(area) / s0 + 1e-6))`` clipped.

    Areas use the +1 convention. The arithmetic stays in float32 like Detectron's,
    so boxes exactly at a level boundary land where Detectron puts them.

    Args:
        rois: ``(n, 4)`` boxes in the scaled (network input) frame.
        k_min, k_max: ``FPN.ROI_MIN_LEVEL`` / ``ROI_MAX_LEVEL``.
        canonical_scale, canonical_level: ``FPN.ROI_CANONICAL_SCALE`` / ``_LEVEL``.

    Returns:
        float array of levels in ``[k_min, k_max]``.
    """
    s = np.sqrt((rois[:, 2] - rois[:, 0] + 1) * (rois[:, 3] - rois[:, 1] + 1))
    return np.clip(np.floor(canonical_level + np.log2(s / canonical_scale + 1e-6)), k_min, k_max)


def add_multilevel_roi_blobs(blobs: MutableMapping[str, Any], blob_prefix: str, rois: np.ndarray,
                             target_lvls: np.ndarray, lvl_min: int, lvl_max: int) -> None:
    """Write ``<prefix>_fpn<l>`` (rows of level l, original order) and
    ``<prefix>_idx_restore_int32`` so that ``concat(levels)[restore] == rois``."""
    lvls = np.asarray(target_lvls).reshape(-1)
    by_level = np.argsort(lvls, kind="stable")  # level order; original order within a level
    levels = np.arange(lvl_min, lvl_max + 1)
    lo, hi = (np.searchsorted(lvls[by_level], levels, side=side) for side in ("left", "right"))
    for lvl, a, b in zip(levels.tolist(), lo.tolist(), hi.tolist()):
        blobs[f"{blob_prefix}_fpn{lvl}"] = rois[by_level[a:b], :]
    # rows outside [lvl_min, lvl_max] are left out
    idx_order = np.concatenate([by_level[a:b] for a, b in zip(lo.tolist(), hi.tolist())]
                               or [np.zeros(0, dtype=np.int64)])
    blobs[f"{blob_prefix}_idx_restore_int32"] = np.argsort(idx_order, kind="stable").astype(
        np.int32, copy=False)


def add_multilevel_rois(blobs: MutableMapping[str, Any], cfg: Any,
                        prefixes: Sequence[str] | None = None) -> None:
    """Distribute ``rois`` (and ``mask_rois`` / ``keypoint_rois`` when on) over levels.

    ``prefixes`` overrides which ``(n, 5)`` RoI blobs are distributed (default:
    :func:`~lit_roidata.minibatch.names.multilevel_roi_prefixes`).
    """
    f = cfg.FPN
    lo, hi = f.ROI_MIN_LEVEL, f.ROI_MAX_LEVEL
    for prefix in multilevel_roi_prefixes(cfg) if prefixes is None else prefixes:
        rois = blobs[prefix]
        lvls = map_rois_to_fpn_levels(rois[:, 1:5], lo, hi, canonical_scale=f.ROI_CANONICAL_SCALE,
                                      canonical_level=f.ROI_CANONICAL_LEVEL)
        add_multilevel_roi_blobs(blobs, prefix, rois, lvls, lo, hi)
