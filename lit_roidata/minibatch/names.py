"""Blob names per model family, in Detectron's queue order (Detectron semantics: blob names).

The order matters: Detectron feeds blobs to the network positionally, and the
in-network label ops of end-to-end training (Detectron semantics: end-to-end training) emit the Fast
R-CNN list in
this same order. Every training blob is float32 or int32 (Detectron semantics: tested invariants).
"""

from __future__ import annotations

from typing import Any

from lit_roidata.minibatch.model_type import blob_family

__all__ = ["get_minibatch_blob_names", "get_fast_rcnn_blob_names", "get_rpn_blob_names",
           "get_retinanet_blob_names", "multilevel_roi_prefixes"]


def _levels(lo: int, hi: int) -> range:
    return range(int(lo), int(hi) + 1)


#: The four "wide" RPN target blobs of one level (suffixed ``_fpn<l>`` with FPN).
RPN_BLOB_KINDS = ("rpn_labels_int32_wide", "rpn_bbox_targets_wide",
                  "rpn_bbox_inside_weights_wide", "rpn_bbox_outside_weights_wide")
#: The compact RPN targets a worker ships with ``target_format="compact"`` instead of the
#: wide blobs (:func:`lit_roidata.minibatch.rpn.add_rpn_blobs`), in this order.
RPN_COMPACT_KEYS = ("rpn_compact_layout", "rpn_compact_labels_int32", "rpn_compact_fg_int32",
                    "rpn_compact_bbox_targets", "rpn_compact_outside_weights")


def get_rpn_blob_names(cfg: Any) -> list[str]:
    """RPN family (``RPN.RPN_ON``): ``im_info``, ``roidb`` and the wide RPN targets."""
    names = ["im_info", "roidb"]
    if cfg.FPN.FPN_ON and cfg.FPN.MULTILEVEL_RPN:
        for lvl in _levels(cfg.FPN.RPN_MIN_LEVEL, cfg.FPN.RPN_MAX_LEVEL):
            names += [f"{kind}_fpn{lvl}" for kind in RPN_BLOB_KINDS]
    else:
        names += RPN_BLOB_KINDS
    return names


def get_retinanet_blob_names(cfg: Any) -> list[str]:
    """RetinaNet family: ``im_info``, fg/bg counts, then three blobs per FPN level.

    Raises:
        ValueError: RetinaNet without ``FPN.FPN_ON`` (Detectron asserts the same).
    """
    if not cfg.FPN.FPN_ON:
        raise ValueError("RETINANET.RETINANET_ON needs FPN.FPN_ON: True (Detectron's RetinaNet "
                         "is always built on FPN); set FPN.FPN_ON in the config")
    names = ["im_info", "retnet_fg_num", "retnet_bg_num"]
    for lvl in _levels(cfg.FPN.RPN_MIN_LEVEL, cfg.FPN.RPN_MAX_LEVEL):
        names += [f"retnet_{k}_fpn{lvl}" for k in ("cls_labels", "roi_bbox_targets",
                                                    "roi_fg_bbox_locs")]
    return names


def multilevel_roi_prefixes(cfg: Any) -> list[str]:
    """The RoI blobs FPN distributes over levels: ``rois``, then ``mask_rois`` and
    ``keypoint_rois`` when their heads are on (Detectron semantics: FPN RoI levels)."""
    prefixes = ["rois"]
    if cfg.MODEL.MASK_ON:
        prefixes.append("mask_rois")
    if cfg.MODEL.KEYPOINTS_ON:
        prefixes.append("keypoint_rois")
    return prefixes


def get_fast_rcnn_blob_names(cfg: Any) -> list[str]:
    """Fast R-CNN family (precomputed proposals, or the output of Detectron semantics: end-to-end
    training's label op)."""
    names = ["rois", "labels_int32", "bbox_targets", "bbox_inside_weights", "bbox_outside_weights"]
    if cfg.MODEL.MASK_ON:
        names += ["mask_rois", "roi_has_mask_int32", "masks_int32"]
    if cfg.MODEL.KEYPOINTS_ON:
        names += ["keypoint_rois", "keypoint_locations_int32", "keypoint_weights",
                  "keypoint_loss_normalizer"]
    if cfg.FPN.FPN_ON and cfg.FPN.MULTILEVEL_ROIS:
        levels = _levels(cfg.FPN.ROI_MIN_LEVEL, cfg.FPN.ROI_MAX_LEVEL)
        for prefix in multilevel_roi_prefixes(cfg):
            names += [f"{prefix}_fpn{lvl}" for lvl in levels]
            names.append(f"{prefix}_idx_restore_int32")
    return names


def get_minibatch_blob_names(cfg: Any) -> list[str]:
    """All training blob names for the configured model family, in queue order.

    ``data`` first, then the blobs of the family
    :func:`~lit_roidata.minibatch.model_type.blob_family` chooses.

    Args:
        cfg: a :class:`~lit_roidata.config.DetectronConfig`.

    Returns:
        The list of blob names (Detectron semantics: blob names).
    """
    family = blob_family(cfg)
    return ["data"] + {"rpn": get_rpn_blob_names, "retinanet": get_retinanet_blob_names,
                       "fast_rcnn": get_fast_rcnn_blob_names}[family](cfg)
