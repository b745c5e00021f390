"""model_type -> Detectron flags, and Detectron's blob-family precedence (Detectron semantics:
configuration)."""

from __future__ import annotations

import pytest

from lit_roidata.config import get_cfg
from lit_roidata.minibatch.model_type import MODEL_TYPES, blob_family, flags_for_model_type
from lit_roidata.minibatch.names import get_minibatch_blob_names

_EXPECTED = {
    "fast_rcnn": "fast_rcnn", "mask_rcnn_proposals": "fast_rcnn",
    "keypoint_rcnn_proposals": "fast_rcnn", "faster_rcnn": "rpn", "mask_rcnn": "rpn",
    "keypoint_rcnn": "rpn", "rpn_only": "rpn", "retinanet": "retinanet",
}


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_every_type_selects_its_family(name):
    cfg = get_cfg()
    # start from a config with every family flag on: the flags must override them all
    cfg.merge_from_dict({"MODEL.MASK_ON": True, "MODEL.KEYPOINTS_ON": True,
                         "RETINANET.RETINANET_ON": True, "FPN.FPN_ON": True})
    cfg.merge_from_dict(flags_for_model_type(name))
    base = name[:-4] if name.endswith("_fpn") else name
    assert blob_family(cfg) == _EXPECTED[base]
    assert cfg.MODEL.MASK_ON == ("mask" in name)
    assert cfg.MODEL.KEYPOINTS_ON == ("keypoint" in name)
    names = get_minibatch_blob_names(cfg)
    if name.endswith("_fpn") and _EXPECTED[base] == "rpn":
        assert "rpn_labels_int32_wide_fpn2" in names
    if name == "mask_rcnn_proposals_fpn":
        assert "mask_rois_fpn2" in names and "rois_idx_restore_int32" in names


def test_unknown_name_lists_choices():
    with pytest.raises(ValueError, match="faster_rcnn.*retinanet"):
        flags_for_model_type("yolo")
    with pytest.raises(ValueError):
        flags_for_model_type("retinanet_fpn")


def test_precedence_rpn_then_retinanet():
    cfg = get_cfg()
    assert blob_family(cfg) == "fast_rcnn"
    cfg.RETINANET.RETINANET_ON = True
    cfg.FPN.FPN_ON = True
    assert blob_family(cfg) == "retinanet"
    cfg.MODEL.FASTER_RCNN = True  # not re-inferred: RPN_ON is still False
    assert blob_family(cfg) == "rpn"
    cfg = get_cfg()
    cfg.RETINANET.RETINANET_ON = True
    with pytest.raises(ValueError, match="FPN.FPN_ON"):
        blob_family(cfg)


def test_detectron_yaml_style_flags_without_model_type():
    cfg = get_cfg()
    cfg.merge_from_dict({"MODEL": {"FASTER_RCNN": True, "MASK_ON": True},
                         "FPN": {"FPN_ON": True, "MULTILEVEL_RPN": True}})
    assert cfg.RPN.RPN_ON and blob_family(cfg) == "rpn"
