"""Keypoint targets and minibatch validity (Detectron semantics: keypoint targets; minibatch
validity; tested invariants, Detectron quirk Q5/Q25 (docs/detectron_quirks.md))."""

from __future__ import annotations

import warnings

import numpy as np
from hypothesis import given, settings, strategies as st

from lit_roidata.minibatch.fast_rcnn import add_fast_rcnn_blobs
from lit_roidata.minibatch.keypoints import keypoints_to_heatmap_labels
from test_minibatch_helpers import make_entry, small_cfg

K = 4


def _cfg(**kw):
    base = {"MODEL.KEYPOINTS_ON": True, "KRCNN.NUM_KEYPOINTS": K, "KRCNN.HEATMAP_SIZE": 4,
            "KRCNN.MIN_KEYPOINT_COUNT_FOR_VALID_MINIBATCH": 2}
    base.update(kw)
    return small_cfg(**base)


def test_heatmap_indices_hand_case():
    # RoI [0, 0, 8, 8], HM = 4: scale = 4 / (8 - 0) = 0.5 (no +1).
    kps = np.array([[[3, 8, 9, 2], [5, 0, 1, 2], [2, 1, 2, 0]]], np.int32)  # x; y; v
    heats, weights = keypoints_to_heatmap_labels(kps, np.array([[0, 0, 8, 8]], np.float32), 4)
    # (3,5) -> x=1, y=2 -> 9; (8,0) on the right edge -> x=3 -> 3; (9,1) -> x=4 outside;
    # (2,2) has v=0.
    assert heats.tolist() == [[9, 3, 0, 0]]
    assert weights.tolist() == [[1, 1, 0, 0]]


def test_zero_width_roi_q25_no_division_by_zero():
    kps = np.array([[[5, 5], [4, 9], [1, 1]]], np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        heats, weights = keypoints_to_heatmap_labels(kps, np.array([[5, 0, 5, 8]], np.float32), 4)
    # x == x2 maps to HM-1 (Detectron's boundary rule); y = floor(4 * 0.5) = 2
    assert heats.tolist() == [[2 * 4 + 3, 0]] and weights.tolist() == [[1, 0]]


def test_keypoint_draw_follows_detectron_order_and_is_independent_q5():
    cfg = _cfg(**{"TRAIN.BATCH_SIZE_PER_IM": 4, "TRAIN.FG_FRACTION": 0.5})  # fg quota 2
    r = np.random.default_rng(3)
    e = make_entry(r, num_gt=3, num_props=30, keypoints=K)
    e["gt_keypoints"][:, 2, :] = 2  # all visible, all inside their gt box
    blobs: dict = {}
    add_fast_rcnn_blobs(blobs, [1.0], [e], cfg, np.random.RandomState(9))
    mo = e["max_overlaps"]
    rs = np.random.RandomState(9)
    fg = np.flatnonzero(mo >= 0.5)
    bg = np.flatnonzero((mo >= 0) & (mo < 0.5))
    rs.choice(fg, size=min(2, fg.size), replace=False)
    rs.choice(bg, size=min(4 - min(2, fg.size), bg.size), replace=False)
    boxes = e["boxes"]
    kps = e["gt_keypoints"][np.flatnonzero(e["gt_classes"] > 0)[e["box_to_gt_ind_map"]]]
    within = ((kps[:, 0] >= boxes[:, :1]) & (kps[:, 0] <= boxes[:, 2:3])
              & (kps[:, 1] >= boxes[:, 1:2]) & (kps[:, 1] <= boxes[:, 3:4]))
    cand = np.flatnonzero((mo >= 0.5) & within.any(1))
    assert cand.size > 2
    want = rs.choice(cand, size=2, replace=False)
    assert np.array_equal(blobs["keypoint_rois"][:, 1:], boxes[want])


def test_validity_and_normaliser():
    cfg = _cfg(**{"KRCNN.MIN_KEYPOINT_COUNT_FOR_VALID_MINIBATCH": 20})
    e = make_entry(np.random.default_rng(0), num_gt=1, num_props=5, keypoints=K)
    e["gt_keypoints"][:, 2, :] = 1
    blobs: dict = {}
    valid = add_fast_rcnn_blobs(blobs, [1.0], [e], cfg, np.random.default_rng(0))
    vis = blobs["keypoint_weights"].sum()
    assert valid == (vis > 20) and not valid  # <= 4 RoIs (fg quota) x 4 keypoints <= 20
    norm = blobs["keypoint_loss_normalizer"]
    assert norm.shape == () and norm.dtype == np.float32
    assert np.isclose(norm, vis / (2 * 16 * 0.25 * K))
    e["gt_keypoints"][:, 2, :] = 0
    blobs = {}
    assert not add_fast_rcnn_blobs(blobs, [1.0], [e], cfg, np.random.default_rng(0))
    assert blobs["keypoint_rois"].shape == (0, 5)
    assert blobs["keypoint_locations_int32"].shape == (0, 1)


@settings(deadline=None, max_examples=40)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.integers(0, 30), st.booleans())
def test_keypoint_invariants(seed, n_images, min_count, fpn):
    """Detectron semantics: tested invariants on random entries."""
    r = np.random.default_rng(seed)
    cfg = _cfg(**{"KRCNN.MIN_KEYPOINT_COUNT_FOR_VALID_MINIBATCH": min_count,
                  "FPN.FPN_ON": fpn, "FPN.MULTILEVEL_ROIS": fpn})
    entries = [make_entry(r, num_gt=int(r.integers(1, 4)), num_props=int(r.integers(0, 40)),
                          keypoints=K, crowd=bool(r.integers(2))) for _ in range(n_images)]
    blobs: dict = {}
    valid = add_fast_rcnn_blobs(blobs, [1.0] * n_images, entries, cfg, np.random.default_rng(seed))
    loc, w = blobs["keypoint_locations_int32"], blobs["keypoint_weights"]
    assert loc.dtype == np.int32 and w.dtype == np.float32
    assert len(loc) == K * len(blobs["keypoint_rois"]) == len(w)
    on = w[:, 0] == 1
    assert set(np.unique(w)) <= {0.0, 1.0}
    assert ((loc[on, 0] >= 0) & (loc[on, 0] < 16)).all() and (loc[~on, 0] == 0).all()
    assert valid == (w.sum() > min_count)
    quota = int(round(0.25 * 16))
    for i in range(n_images):
        assert (blobs["keypoint_rois"][:, 0] == i).sum() <= quota
