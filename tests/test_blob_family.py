"""The blob family is decided in one function (``model_type.blob_family``): a hand-checked
table of Detectron flag sets -> family, and the names / minibatch builder follow it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lit_roidata.catalog import Catalog
from lit_roidata.config import get_cfg, load_detectron_cfg
from lit_roidata.demo.data import register_demo_datasets
from lit_roidata.minibatch import get_minibatch, get_minibatch_blob_names
from lit_roidata.minibatch.model_type import blob_family
from lit_roidata.roidb.build import combined_roidb_for_training

REPO = Path(__file__).resolve().parents[1]
FPN_RPN = {"FPN.FPN_ON": True, "FPN.MULTILEVEL_RPN": True}
FPN_ROIS = {"FPN.FPN_ON": True, "FPN.MULTILEVEL_ROIS": True}

# (what it is, Detectron flags, family) -- checked by hand against Detectron's
# precedence: RPN_ON (or FASTER_RCNN / RPN_ONLY, which infer it) first, then
# RETINANET_ON, else Fast R-CNN on precomputed proposals. Heads and FPN do not
# change the family.
TABLE = [
    ("Fast R-CNN", {}, "fast_rcnn"),
    ("Fast R-CNN, FPN", FPN_ROIS, "fast_rcnn"),
    ("Mask R-CNN from proposals", {"MODEL.MASK_ON": True}, "fast_rcnn"),
    ("Mask R-CNN from proposals, FPN", {"MODEL.MASK_ON": True, **FPN_ROIS}, "fast_rcnn"),
    ("Keypoint R-CNN from proposals", {"MODEL.KEYPOINTS_ON": True}, "fast_rcnn"),
    ("RPN only", {"MODEL.RPN_ONLY": True}, "rpn"),
    ("RPN only, FPN", {"MODEL.RPN_ONLY": True, **FPN_RPN}, "rpn"),
    ("RPN_ON given directly", {"RPN.RPN_ON": True}, "rpn"),
    ("Faster R-CNN e2e", {"MODEL.FASTER_RCNN": True}, "rpn"),
    ("Faster R-CNN e2e, FPN", {"MODEL.FASTER_RCNN": True, **FPN_RPN, **FPN_ROIS}, "rpn"),
    ("Mask R-CNN e2e", {"MODEL.FASTER_RCNN": True, "MODEL.MASK_ON": True}, "rpn"),
    ("Mask R-CNN e2e, FPN",
     {"MODEL.FASTER_RCNN": True, "MODEL.MASK_ON": True, **FPN_RPN, **FPN_ROIS}, "rpn"),
    ("Keypoint R-CNN e2e, FPN",
     {"MODEL.FASTER_RCNN": True, "MODEL.KEYPOINTS_ON": True, **FPN_RPN, **FPN_ROIS}, "rpn"),
    ("RetinaNet", {"RETINANET.RETINANET_ON": True, "FPN.FPN_ON": True}, "retinanet"),
    ("RetinaNet and Faster R-CNN: RPN wins",
     {"RETINANET.RETINANET_ON": True, "FPN.FPN_ON": True, "MODEL.FASTER_RCNN": True}, "rpn"),
]
# the blob each family, and only it, starts with after "data"
FIRST_BLOB = {"fast_rcnn": "rois", "rpn": "im_info", "retinanet": "im_info"}
MARKER = {"fast_rcnn": "labels_int32", "rpn": "roidb", "retinanet": "retnet_fg_num"}


@pytest.mark.parametrize("what,flags,family", TABLE, ids=[t[0] for t in TABLE])
def test_family_table(what, flags, family):
    built = load_detectron_cfg(None, flags)  # inferred and frozen
    assert blob_family(built) == family, what
    # the same flags set by hand on a mutable config, never re-inferred
    raw = get_cfg()
    for key, value in flags.items():
        section, name = key.split(".")
        setattr(raw[section], name, value)
    assert blob_family(raw) == family, what
    for cfg in (built, raw):
        names = get_minibatch_blob_names(cfg)
        assert names[:2] == ["data", FIRST_BLOB[family]] and MARKER[family] in names, what
        others = set(MARKER.values()) - {MARKER[family]}
        assert not others & set(names), what


def test_retinanet_needs_fpn():
    with pytest.raises(ValueError, match="FPN.FPN_ON"):
        blob_family(load_detectron_cfg(None, {"RETINANET.RETINANET_ON": True}))


@pytest.mark.parametrize("name,family", [
    ("fast_rcnn_R-50-FPN_1x.yaml", "fast_rcnn"), ("e2e_faster_rcnn_R-50-FPN_1x.yaml", "rpn"),
    ("e2e_mask_rcnn_R-50-FPN_1x.yaml", "rpn"), ("e2e_keypoint_rcnn_R-50-FPN_1x.yaml", "rpn"),
    ("retinanet_R-50-FPN_1x.yaml", "retinanet")])
def test_shipped_detectron_configs(name, family):
    assert blob_family(load_detectron_cfg(REPO / "configs" / "detectron" / name)) == family


def test_minibatch_builder_follows_the_same_decision(tmp_path):
    """A hand-edited, non-inferred config (FASTER_RCNN on, RPN_ON still off): the builder
    and the blob names agree on the RPN family (they used to read RPN_ON alone)."""
    demo = register_demo_datasets(tmp_path / "demo", Catalog(), num_images={
        "demo_train_a": 2, "demo_train_b": 1, "demo_val": 1})
    cfg = get_cfg()
    cfg.merge_from_dict({"MODEL.NUM_CLASSES": 5, "TRAIN.SCALES": (160,),
                         "TRAIN.MAX_SIZE": 256})
    roidb = combined_roidb_for_training(demo.train_datasets[:1], (), load_detectron_cfg(
        cfg, {"MODEL.FASTER_RCNN": True}), str(tmp_path / "cache"), catalog=demo.catalog,
        progress=False)
    cfg.MODEL.FASTER_RCNN = True
    assert not cfg.RPN.RPN_ON and blob_family(cfg) == "rpn"
    blobs, _ = get_minibatch([roidb[0]], cfg, np.random.default_rng(0))
    assert list(blobs) == get_minibatch_blob_names(cfg)
    assert "rpn_labels_int32_wide" in blobs
