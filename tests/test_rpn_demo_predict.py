"""RPNExchangeDemo's RPN-only test path (Detectron's FPN GenerateProposals + collect)."""

from __future__ import annotations

import math

import numpy as np
import torch

from lit_roidata.config import get_cfg
from lit_roidata.evaluation import detections_to_coco_results
from lit_roidata.demo.rpn_exchange_model import RPNExchangeDemo


def _cfg(pre: int, post: int, nms: float = 0.7):
    cfg = get_cfg()
    cfg.merge_from_dict({"FPN.FPN_ON": True, "FPN.MULTILEVEL_RPN": True,
                         "FPN.RPN_MIN_LEVEL": 2, "FPN.RPN_MAX_LEVEL": 2,
                         "TEST.RPN_PRE_NMS_TOP_N": pre, "TEST.RPN_POST_NMS_TOP_N": post,
                         "TEST.RPN_NMS_THRESH": nms})
    return cfg


def _one_level_outputs(hot: list[tuple[int, int, int, float, list[float]]],
                       hf: int = 16, wf: int = 16) -> dict[str, torch.Tensor]:
    """Level-2 maps, all objectness 0 except ``(a, y, x) -> prob`` with given deltas."""
    probs = torch.zeros(1, 3, hf, wf)
    deltas = torch.zeros(1, 12, hf, wf)
    for a, y, x, p, d in hot:
        probs[0, a, y, x] = p
        deltas[0, 4 * a:4 * a + 4, y, x] = torch.tensor(d)
    return {"rpn_cls_probs_fpn2": probs, "rpn_bbox_pred_fpn2": deltas}


def test_one_anchor_known_deltas_give_the_known_box() -> None:
    model = RPNExchangeDemo(levels=(2, 2))
    # Level 2: stride 4, size 32; ratio 1 (a = 1) is the cell [-14, -14, 17, 17];
    # at (y, x) = (2, 3) it shifts by (12, 8): [-2, -6, 29, 25], w = h = 32, centre (14, 10).
    # dx 0.5 -> cx 30, dy 0.25 -> cy 18, dw log 0.5 -> w 16, dh 0 -> h 32: [22, 2, 37, 33].
    out = _one_level_outputs([(1, 2, 3, 0.9, [0.5, 0.25, math.log(0.5), 0.0])])
    (boxes, scores), = model.proposals(out, [[64.0, 64.0, 1.0]], _cfg(pre=1, post=10))
    np.testing.assert_allclose(boxes.numpy(), [[22.0, 2.0, 37.0, 33.0]], atol=1e-4)
    np.testing.assert_allclose(scores.numpy(), [0.9], rtol=1e-6)


def test_clip_nms_and_top_n() -> None:
    model = RPNExchangeDemo(levels=(2, 2))
    # Two near-identical anchors (same cell, neighbouring x) overlap with IoU 28/36 > 0.7:
    # NMS keeps the higher; a third anchor at the corner is clipped to the image.
    out = _one_level_outputs([(1, 4, 4, 0.9, [0.0] * 4), (1, 4, 5, 0.8, [0.0] * 4),
                              (1, 0, 0, 0.7, [0.0] * 4)])
    (boxes, scores), = model.proposals(out, [[64.0, 64.0, 1.0]], _cfg(pre=3, post=10))
    np.testing.assert_allclose(scores.numpy(), [0.9, 0.7], rtol=1e-6)
    np.testing.assert_allclose(boxes.numpy(), [[2.0, 2.0, 33.0, 33.0], [0.0, 0.0, 17.0, 17.0]],
                               atol=1e-4)
    # post-NMS top-n; all 768 anchors of the 16x16 map are candidates without a pre cap
    (boxes, _), = model.proposals(out, [[64.0, 64.0, 1.0]], _cfg(pre=10**6, post=5))
    assert len(boxes) == 5
    assert (boxes[:, :2] >= 0).all() and (boxes[:, 2:] <= 63).all()


def test_proposal_results_are_category_one_without_labels() -> None:
    det = {"image_id": 7, "dataset": "x", "boxes": np.array([[0, 0, 9, 19]], np.float32),
           "scores": np.array([0.5], np.float32), "proposals": True}
    res = detections_to_coco_results([det], {})
    assert res == [{"image_id": 7, "category_id": 1, "bbox": [0.0, 0.0, 10.0, 20.0],
                    "score": 0.5}]
    # detectors are unchanged: labels map through the dataset's ids
    det = dict(det, labels=np.array([2]), proposals=False)
    assert detections_to_coco_results([det], {1: 1, 2: 18})[0]["category_id"] == 18
