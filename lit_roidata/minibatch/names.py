"""Blob names per model family, in Detectron's queue order (Detectron semantics: blob names).

The order matters: Detectron feeds blobs to the network positionally, and the in-network
label ops of end-to-end training emit the Fast R-CNN list in this same order. Every training
blob is float32 or int32 (Detectron semantics: blob names; end-to-end training).
"""

from __future__ import annotations

from typing import Any

from lit_roidata.minibatch.model_type import blob_family

__all__ = ["get_minibatch_blob_names", "get_fast_rcnn_blob_names", "get_rpn_blob_names",
           "get_retinanet_blob_names", "multilevel_roi_prefixes", "rpn_levels"]


def _levels(lo: int, hi: int) -> range:
    return range(int(lo), int(hi) + 1)


#: The four "wide" RPN target blobs of one level (suffixed ``_fpn<l>`` with FPN).
RPN_BLOB_KINDS = ("rpn_labels_int32_wide", "rpn_bbox_targets_wide",
                  "rpn_bbox_inside_weights_wide", "rpn_bbox_outside_weights_wide")
#: The compact RPN targets a worker ships with ``target_format="compact"`` instead of the
#: wide blobs (:func:`lit_roidata.minibatch.rpn.add_rpn_blobs`), in this order.
RPN_COMPACT_KEYS = ("rpn_compact_layout", "rpn_compact_labels_int32", "rpn_compact_fg_int32",
                    "rpn_compact_bbox_targets", "rpn_compact_outside_weights")


def rpn_levels(cfg: Any) -> list[int | None]:
    """The RPN's anchor levels: the FPN levels with a multilevel RPN, else ``[None]``."""
    if cfg.FPN.FPN_ON and cfg.FPN.MULTILEVEL_RPN:
        return list(_levels(cfg.FPN.RPN_MIN_LEVEL, cfg.FPN.RPN_MAX_LEVEL))
    return [None]


def get_rpn_blob_names(cfg: Any) -> list[str]:
    """RPN family (``RPN.RPN_ON``): ``im_info``, ``roidb`` and the wide RPN targets."""
    return ["im_info", "roidb"] + [kind if lvl is None else f"{kind}_fpn{lvl}"
                                   for lvl in rpn_levels(cfg) for kind in RPN_BLOB_KINDS]


def get_retinanet_blob_names(cfg: Any) -> list[str]:
    """RetinaNet family: ``im_info``, fg/bg counts, then three blobs per FPN level.

    Raises:
        ValueError: RetinaNet without ``FPN.FPN_ON`` (Detectron asserts the same).
    """
    if not cfg.FPN.FPN_ON:
        raise ValueError("RETINANET.RETINANET_ON needs FPN.FPN_ON: True (Detectron's RetinaNet "
                         "is always built on FPN); set FPN.FPN_ON in the config")
    return ["im_info", "retnet_fg_num", "retnet_bg_num"] + [
        f"retnet_{k}_fpn{lvl}" for lvl in _levels(cfg.FPN.RPN_MIN_LEVEL, cfg.FPN.RPN_MAX_LEVEL)
        for k in ("cls_labels", "roi_bbox_targets", "roi_fg_bbox_locs")]


def multilevel_roi_prefixes(cfg: Any) -> list[str]:
    """The RoI blobs FPN distributes over levels: ``rois``, then ``mask_rois`` and
    ``keypoint_rois`` when their heads are on (Detectron semantics: FPN RoI levels)."""
    return [prefix for prefix, on in (("rois", True), ("mask_rois", cfg.MODEL.MASK_ON),
                                      ("keypoint_rois", cfg.MODEL.KEYPOINTS_ON)) if on]


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
        suffixes = [f"fpn{lvl}" for lvl in _levels(cfg.FPN.ROI_MIN_LEVEL, cfg.FPN.ROI_MAX_LEVEL)]
        names += [f"{prefix}_{suffix}" for prefix in multilevel_roi_prefixes(cfg)
                  for suffix in suffixes + ["idx_restore_int32"]]
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
    return ["data"] + {"rpn": get_rpn_blob_names, "retinanet": get_retinanet_blob_names,
                       "fast_rcnn": get_fast_rcnn_blob_names}[blob_family(cfg)](cfg)
