"""``model_type`` names and the blob family they select (Detectron semantics: configuration;
blob names).

Detectron's precedence: ``RPN.RPN_ON`` (inferred from ``MODEL.FASTER_RCNN`` /
``MODEL.RPN_ONLY``), then ``RETINANET.RETINANET_ON``, else Fast R-CNN with precomputed
proposals. ``RoIDataModule(model_type=...)`` merges :func:`flags_for_model_type` into the
config and :func:`blob_family` reads the result, so a Detectron YAML with the flags set
behaves the same. End-to-end names build the RPN family in the loader (second stage:
:func:`lit_roidata.minibatch.proposal_labels`); ``*_proposals`` names read precomputed
proposal files.
"""

from __future__ import annotations

from typing import Any

from lit_roidata.config import blob_family  # noqa: F401 - re-exported (it lives below roidb)

__all__ = ["MODEL_TYPES", "flags_for_model_type", "blob_family"]

_OFF = {"MODEL.FASTER_RCNN": False, "MODEL.RPN_ONLY": False, "MODEL.MASK_ON": False,
        "MODEL.KEYPOINTS_ON": False, "RPN.RPN_ON": False, "RETINANET.RETINANET_ON": False}

_BASE: dict[str, dict[str, Any]] = {
    "fast_rcnn": {}, "mask_rcnn_proposals": {"MODEL.MASK_ON": True},
    "keypoint_rcnn_proposals": {"MODEL.KEYPOINTS_ON": True},
    "faster_rcnn": {"MODEL.FASTER_RCNN": True, "RPN.RPN_ON": True},
    "mask_rcnn": {"MODEL.FASTER_RCNN": True, "RPN.RPN_ON": True, "MODEL.MASK_ON": True},
    "keypoint_rcnn": {"MODEL.FASTER_RCNN": True, "RPN.RPN_ON": True, "MODEL.KEYPOINTS_ON": True},
    "rpn_only": {"MODEL.RPN_ONLY": True, "RPN.RPN_ON": True},
    "retinanet": {"RETINANET.RETINANET_ON": True, "FPN.FPN_ON": True},
}


MODEL_TYPES: tuple[str, ...] = tuple(_BASE) + tuple(
    f"{name}_fpn" for name in _BASE if name != "retinanet")


def flags_for_model_type(model_type: str) -> dict[str, Any]:
    """Dotted Detectron keys that select ``model_type``'s blob family.

    Every family flag is set explicitly (the others to False), so merging the result
    over any config gives that family. ``<name>_fpn`` adds ``FPN.FPN_ON`` with
    multilevel RoIs (second stage) and multilevel RPN anchors (RPN families).
    ``retinanet`` always uses FPN (Detectron asserts it); its levels, anchor scales
    and ``FPN.COARSEST_STRIDE`` (128 in Detectron's configs) stay with the config.

    Example:
        >>> flags_for_model_type("mask_rcnn_fpn")["FPN.MULTILEVEL_RPN"]
        True

    Raises:
        ValueError: an unknown name (the message lists the valid ones).
    """
    name = model_type.strip().lower()
    base = name[:-4] if name.endswith("_fpn") else name
    if name not in MODEL_TYPES:
        raise ValueError(f"unknown model_type {model_type!r}; choose one of "
                         f"{', '.join(MODEL_TYPES)} (or leave it unset and use Detectron's "
                         "MODEL/RPN/RETINANET/FPN flags)")
    flags = {**_OFF, **_BASE[base]}
    if name.endswith("_fpn"):
        flags["FPN.FPN_ON"] = True
        if base != "rpn_only":
            flags["FPN.MULTILEVEL_ROIS"] = True  # second stage on P2..P5
        if _BASE[base].get("RPN.RPN_ON"):
            flags["FPN.MULTILEVEL_RPN"] = True  # anchors on P2..P6
    return flags
