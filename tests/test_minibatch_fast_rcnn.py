"""Fast R-CNN blobs (Detectron semantics: blob names; Fast R-CNN targets; tested invariants)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from lit_roidata.minibatch import get_minibatch_blob_names
from lit_roidata.minibatch.fast_rcnn import add_fast_rcnn_blobs, expand_bbox_targets
from test_minibatch_helpers import make_entry, small_cfg


def _hand_entry():
    mo = np.array([1, 1, 0.7, 0.6, 0.3, 0.2, 0.1, 0.0, -1], np.float32)
    R = mo.size
    boxes = np.tile(np.array([[0, 0, 9, 9]], np.float32), (R, 1)) + np.arange(R)[:, None]
    mc = np.array([1, 2, 1, 2, 1, 0, 0, 0, 0])
    targets = np.zeros((R, 5), np.float32)
    targets[:4, 0] = mc[:4]
    targets[:4, 1:] = np.arange(16, dtype=np.float32).reshape(4, 4) / 10
    return dict(boxes=boxes, max_overlaps=mo, max_classes=mc, bbox_targets=targets,
                gt_classes=np.array([1, 2, 0, 0, 0, 0, 0, 0, 3], np.int32),
                is_crowd=np.array([0, 0, 0, 0, 0, 0, 0, 0, 1], bool),
                box_to_gt_ind_map=np.zeros(R, np.int32), segms=[[], [], []])


def test_blob_names_per_family():
    cfg = small_cfg()
    assert get_minibatch_blob_names(cfg) == [
        "data", "rois", "labels_int32", "bbox_targets", "bbox_inside_weights",
        "bbox_outside_weights"]
    cfg = small_cfg(**{"MODEL.MASK_ON": True, "MODEL.KEYPOINTS_ON": True, "FPN.FPN_ON": True,
                       "FPN.MULTILEVEL_ROIS": True, "FPN.ROI_MIN_LEVEL": 2,
                       "FPN.ROI_MAX_LEVEL": 3})
    assert get_minibatch_blob_names(cfg)[6:] == [
        "mask_rois", "roi_has_mask_int32", "masks_int32", "keypoint_rois",
        "keypoint_locations_int32", "keypoint_weights", "keypoint_loss_normalizer",
        "rois_fpn2", "rois_fpn3", "rois_idx_restore_int32", "mask_rois_fpn2", "mask_rois_fpn3",
        "mask_rois_idx_restore_int32", "keypoint_rois_fpn2", "keypoint_rois_fpn3",
        "keypoint_rois_idx_restore_int32"]
    cfg = small_cfg(**{"MODEL.FASTER_RCNN": True})
    assert get_minibatch_blob_names(cfg) == [
        "data", "im_info", "roidb", "rpn_labels_int32_wide", "rpn_bbox_targets_wide",
        "rpn_bbox_inside_weights_wide", "rpn_bbox_outside_weights_wide"]
    cfg = small_cfg(**{"MODEL.FASTER_RCNN": True, "FPN.FPN_ON": True, "FPN.MULTILEVEL_RPN": True,
                       "FPN.RPN_MIN_LEVEL": 2, "FPN.RPN_MAX_LEVEL": 3,
                       "RETINANET.RETINANET_ON": True})  # RPN takes precedence
    assert get_minibatch_blob_names(cfg)[3:] == [
        f"rpn_{k}_fpn{l}" for l in (2, 3) for k in
        ("labels_int32_wide", "bbox_targets_wide", "bbox_inside_weights_wide",
         "bbox_outside_weights_wide")]
    cfg = small_cfg(**{"RETINANET.RETINANET_ON": True, "FPN.FPN_ON": True,
                       "FPN.RPN_MIN_LEVEL": 3, "FPN.RPN_MAX_LEVEL": 4})
    assert get_minibatch_blob_names(cfg) == [
        "data", "im_info", "retnet_fg_num", "retnet_bg_num", "retnet_cls_labels_fpn3",
        "retnet_roi_bbox_targets_fpn3", "retnet_roi_fg_bbox_locs_fpn3", "retnet_cls_labels_fpn4",
        "retnet_roi_bbox_targets_fpn4", "retnet_roi_fg_bbox_locs_fpn4"]
    with pytest.raises(ValueError, match="FPN.FPN_ON"):
        get_minibatch_blob_names(small_cfg(**{"RETINANET.RETINANET_ON": True}))


def test_sampling_counts_and_randomstate_order():
    cfg = small_cfg(**{"TRAIN.BATCH_SIZE_PER_IM": 4, "TRAIN.FG_FRACTION": 0.5})
    e = _hand_entry()
    blobs: dict = {}
    assert add_fast_rcnn_blobs(blobs, [2.0], [e], cfg, np.random.RandomState(5))
    rs = np.random.RandomState(5)
    fg = rs.choice(np.array([0, 1, 2, 3]), size=2, replace=False)
    bg = rs.choice(np.array([4, 5, 6, 7]), size=2, replace=False)
    keep = np.append(fg, bg)
    assert np.array_equal(blobs["rois"][:, 1:], e["boxes"][keep] * 2)
    assert np.array_equal(blobs["rois"][:, 0], np.zeros(4))
    assert np.array_equal(blobs["labels_int32"], np.r_[e["max_classes"][fg], 0, 0])
    assert list(blobs) == ["rois", "labels_int32", "bbox_targets", "bbox_inside_weights",
                           "bbox_outside_weights"]


def test_sampling_few_fg_fills_with_bg_and_never_crowd():
    cfg = small_cfg(**{"TRAIN.BATCH_SIZE_PER_IM": 6, "TRAIN.FG_FRACTION": 0.5})
    e = _hand_entry()
    e["max_overlaps"] = np.array([1, 0.4, 0.3, 0.3, 0.2, 0.2, 0.1, 0.0, -1], np.float32)
    blobs: dict = {}
    add_fast_rcnn_blobs(blobs, [1.0, 1.0], [e, e], cfg, np.random.default_rng(0))
    assert blobs["rois"].shape == (12, 5)  # 1 fg + 5 bg per image
    assert np.array_equal(blobs["rois"][:, 0], np.repeat([0, 1], 6))
    labels = blobs["labels_int32"].reshape(2, 6)
    assert (labels[:, 0] == 1).all() and (labels[:, 1:] == 0).all()
    # the crowd row (box offset 8) is never sampled
    assert not np.any(blobs["rois"][:, 1] == 8)


def test_target_expansion_hand_case():
    cfg = small_cfg(**{"MODEL.NUM_CLASSES": 5})
    data = np.array([[3, .1, .2, .3, .4], [0, 9, 9, 9, 9], [1, -1, -2, -3, -4]], np.float32)
    t, w = expand_bbox_targets(data, cfg)
    assert t.shape == (3, 20) and t.dtype == np.float32
    assert np.array_equal(t[0, 12:16], data[0, 1:]) and t[0].sum() == pytest.approx(1.0)
    assert not t[1].any() and not w[1].any()
    assert np.array_equal(t[2, 4:8], data[2, 1:])
    assert np.array_equal(np.flatnonzero(w[0]), [12, 13, 14, 15])
    cfg.MODEL.CLS_AGNOSTIC_BBOX_REG = True
    t, w = expand_bbox_targets(np.array([[1, .1, .2, .3, .4]], np.float32), cfg)
    assert t.shape == (1, 8) and np.allclose(t[0, 4:], [.1, .2, .3, .4]) and w[0, 4:].all()
    with pytest.raises(ValueError, match="NUM_CLASSES"):
        expand_bbox_targets(np.array([[7, 0, 0, 0, 0]], np.float32), small_cfg())


def test_bg_rows_keep_roidb_targets_q30():
    # BBOX_THRESH < FG_THRESH: a row labelled bg can still carry a regression target.
    cfg = small_cfg(**{"TRAIN.BATCH_SIZE_PER_IM": 9, "TRAIN.FG_FRACTION": 0.0})
    e = _hand_entry()
    blobs: dict = {}
    add_fast_rcnn_blobs(blobs, [1.0], [e], cfg, np.random.default_rng(0))
    assert (blobs["labels_int32"] == 0).all()
    assert blobs["bbox_inside_weights"].sum() == 0  # bg candidates 4..7 have class 0 targets
    e["bbox_targets"][5, 0] = 2
    blobs = {}
    add_fast_rcnn_blobs(blobs, [1.0], [e], cfg, np.random.default_rng(0))
    assert blobs["bbox_inside_weights"].sum() == 4


@settings(deadline=None, max_examples=40)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.sampled_from([4, 16, 64]),
       st.sampled_from([0.25, 0.5]), st.booleans(), st.booleans())
def test_fast_rcnn_invariants(seed, n_images, per_im, fg_frac, cls_agnostic, use_rs):
    """Detectron semantics: tested invariants on random labelled entries."""
    r = np.random.default_rng(seed)
    cfg = small_cfg(**{"TRAIN.BATCH_SIZE_PER_IM": per_im, "TRAIN.FG_FRACTION": fg_frac,
                       "MODEL.CLS_AGNOSTIC_BBOX_REG": cls_agnostic})
    entries = [make_entry(r, num_gt=int(r.integers(0, 4)), num_props=int(r.integers(0, 60)),
                          crowd=bool(r.integers(2)), image_id=i) for i in range(n_images)]
    entries = [e for e in entries if e["boxes"].shape[0]] or [make_entry(r)]
    if cls_agnostic:  # the roidb builds class-agnostic targets with class 1
        for e in entries:
            e["bbox_targets"][:, 0] = (e["bbox_targets"][:, 0] > 0)
    ims = {e["id"]: np.zeros((e["height"], e["width"], 3), np.uint8) for e in entries}
    rng = np.random.RandomState(seed % 2**32) if use_rs else np.random.default_rng(seed)
    from lit_roidata.minibatch.core import build_minibatch
    mb = build_minibatch(entries, cfg, rng, loader=lambda e: ims[e["id"]])
    blobs = mb.blobs
    assert mb.valid and list(blobs) == get_minibatch_blob_names(cfg)
    assert all(v.dtype in (np.float32, np.int32) for v in blobs.values())
    C = 2 if cls_agnostic else cfg.MODEL.NUM_CLASSES
    fn = int(round(fg_frac * per_im))
    rois, labels = blobs["rois"], blobs["labels_int32"]
    assert np.all(np.diff(rois[:, 0]) >= 0)
    for i, e in enumerate(entries):
        rows = np.flatnonzero(rois[:, 0] == i)
        assert rows.size <= per_im
        lab = labels[rows]
        nfg = int((lab > 0).sum())
        assert nfg <= fn and (lab[:nfg] > 0).all() and (lab[nfg:] == 0).all()
        n_fg_cand = int((e["max_overlaps"] >= 0.5).sum())
        n_bg_cand = int(((e["max_overlaps"] >= 0) & (e["max_overlaps"] < 0.5)).sum())
        assert nfg == min(fn, n_fg_cand)
        assert rows.size - nfg == min(per_im - nfg, n_bg_cand)
        # every sampled box is one of the entry's boxes, scaled
        scaled = e["boxes"] * np.float32(mb.image.im_scales[i])
        assert all((np.abs(scaled - b).max(1) < 1e-4).any() for b in rois[rows, 1:])
    inside = blobs["bbox_inside_weights"]
    assert inside.shape == (rois.shape[0], 4 * C) == blobs["bbox_targets"].shape
    ones = inside.reshape(-1, C, 4)
    per_row = ones.sum(axis=(1, 2))
    assert set(np.unique(per_row)) <= {0.0, 4.0}
    nz = np.flatnonzero(per_row)
    cls = ones[nz].sum(2).argmax(1)
    assert (cls > 0).all() and (ones[nz, cls] == 1).all()
    assert np.array_equal(blobs["bbox_outside_weights"], (inside > 0).astype(np.float32))
    assert not blobs["bbox_targets"][per_row == 0].any()


def test_lazy_family_modules_and_the_proposal_labels_function():
    import importlib
    import types

    import lit_roidata.minibatch as mb
    from lit_roidata.minibatch.second_stage import proposal_labels

    assert isinstance(mb.proposal_labels, types.FunctionType) and mb.proposal_labels is proposal_labels
    assert mb.rpn is importlib.import_module("lit_roidata.minibatch.rpn")
    with pytest.raises(AttributeError):
        mb.not_a_module  # noqa: B018


def test_whole_minibatch_follows_detectron_call_order():
    """randint(scales) for all images first, then per image fg choice, bg choice."""
    from lit_roidata.minibatch.core import build_minibatch

    cfg = small_cfg(**{"TRAIN.SCALES": (30, 40, 50), "TRAIN.BATCH_SIZE_PER_IM": 8})
    r = np.random.default_rng(7)
    entries = [make_entry(r, image_id=i, num_props=30) for i in range(2)]
    mb = build_minibatch(entries, cfg, np.random.RandomState(123),
                         loader=lambda e: np.zeros((48, 64, 3), np.uint8))
    rs = np.random.RandomState(123)
    scale_inds = rs.randint(0, 3, size=2)
    rows = []
    for i, e in enumerate(entries):
        mo = e["max_overlaps"]
        fg = np.flatnonzero(mo >= 0.5)
        bg = np.flatnonzero((mo >= 0) & (mo < 0.5))
        nf = min(2, fg.size)
        fg = rs.choice(fg, size=nf, replace=False) if fg.size else fg
        bg = rs.choice(bg, size=min(8 - nf, bg.size), replace=False) if bg.size else bg
        s = cfg.TRAIN.SCALES[scale_inds[i]] / 48
        assert mb.image.im_scales[i] == s
        rows.append(np.hstack([np.full((nf + bg.size, 1), i, np.float32),
                               e["boxes"][np.append(fg, bg).astype(int)] * s]))
    assert np.array_equal(mb.blobs["rois"], np.vstack(rows).astype(np.float32))
