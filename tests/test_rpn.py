"""RPN targets (Detectron semantics: RPN targets; tested invariants): hand-checked cases, quirk
flags, and equality
with a literal dense port of Detectron's ``_get_rpn_blobs``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.boxes import bbox_overlaps, bbox_transform_targets
from lit_roidata.config import get_cfg
from lit_roidata.minibatch import rpn
from lit_roidata.minibatch.anchors import concat_fields, rpn_fields
from lit_roidata.minibatch.device import expand_targets
from lit_roidata.minibatch.roidb_blob import deserialize_roidb


def _entry(boxes, classes=None, crowd=None, width=64, height=64, image_id=1):
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    n = len(boxes)
    return {"id": image_id, "image": f"/x/{image_id}.jpg", "width": width, "height": height,
            "boxes": boxes,
            "gt_classes": np.asarray(classes if classes is not None else [1] * n, np.int32),
            "is_crowd": np.asarray(crowd if crowd is not None else [False] * n, bool),
            "seg_areas": np.ones(n, np.float32), "box_to_gt_ind_map": np.arange(n, dtype=np.int32),
            "segms": [[[0.0, 0.0, 1.0, 0.0, 1.0, 1.0]] for _ in range(n)]}


def _tiny_cfg():
    """64x64 images, one 32x32 square anchor per 16-px cell: F = 4, 4 inside anchors."""
    cfg = get_cfg()
    cfg.merge_from_dict({"MODEL.FASTER_RCNN": True, "RPN.STRIDE": 16, "RPN.SIZES": (32,),
                         "RPN.ASPECT_RATIOS": (1,), "TRAIN.MAX_SIZE": 64})
    return cfg


def _fpn_cfg(max_size=200, coarsest=64):
    cfg = get_cfg()
    cfg.merge_from_dict({"MODEL.FASTER_RCNN": True, "FPN.FPN_ON": True,
                         "FPN.MULTILEVEL_RPN": True, "FPN.COARSEST_STRIDE": coarsest,
                         "TRAIN.MAX_SIZE": max_size})
    return cfg


def test_blob_names():
    cfg = get_cfg()
    assert rpn.get_rpn_blob_names(cfg) == ["im_info", "roidb", *rpn.RPN_BLOB_KINDS]
    names = rpn.get_rpn_blob_names(_fpn_cfg())
    assert names[:6] == ["im_info", "roidb", "rpn_labels_int32_wide_fpn2",
                         "rpn_bbox_targets_wide_fpn2", "rpn_bbox_inside_weights_wide_fpn2",
                         "rpn_bbox_outside_weights_wide_fpn2"]
    assert names[-1] == "rpn_bbox_outside_weights_wide_fpn6" and len(names) == 22


def test_hand_computed_tiny_image():
    # Inside anchors (straddle 0): cells (y, x) in {1,2}^2, boxes [8|24, 8|24, +31, +31].
    # gt A = [8,8,39,39] is exactly anchor (1,1); gt B = [30,30,50,50] has IoU 441/1024
    # with anchor (2,2) (its best match, below 0.7). Anchors (1,2) and (2,1) have IoU 1/3
    # with A: neither positive nor negative.
    cfg = _tiny_cfg()
    blobs: dict = {}
    rpn.add_rpn_blobs(blobs, [1.0], [_entry([[8, 8, 39, 39], [30, 30, 50, 50]])], cfg,
                      np.random.RandomState(0))
    labels = blobs["rpn_labels_int32_wide"]
    assert labels.shape == (1, 1, 4, 4) and labels.dtype == np.int32
    expected = np.full((4, 4), -1)
    expected[1, 1] = expected[2, 2] = 1
    np.testing.assert_array_equal(labels[0, 0], expected)
    tgt = blobs["rpn_bbox_targets_wide"][0]
    np.testing.assert_array_equal(tgt[:, 1, 1], 0)  # exact match
    np.testing.assert_allclose(tgt[:, 2, 2], [0.5 / 32, 0.5 / 32, np.log(21 / 32),
                                              np.log(21 / 32)], rtol=1e-6)
    inside = blobs["rpn_bbox_inside_weights_wide"][0]
    outside = blobs["rpn_bbox_outside_weights_wide"][0]
    assert inside.sum() == 8 and (inside[:, 1, 1] == 1).all() and (inside[:, 2, 2] == 1).all()
    assert outside.sum() == pytest.approx(4.0) and (outside[:, 2, 2] == 0.5).all()
    np.testing.assert_array_equal(blobs["im_info"], [[64, 64, 1]])


def test_hand_computed_negatives():
    # Only gt A: anchor (2,2) has IoU 256/1792 < 0.3 with it, so it is the one negative.
    cfg = _tiny_cfg()
    blobs: dict = {}
    rpn.add_rpn_blobs(blobs, [1.0], [_entry([[8, 8, 39, 39]])], cfg, np.random.RandomState(0))
    lab = blobs["rpn_labels_int32_wide"][0, 0]
    assert lab[1, 1] == 1 and lab[2, 2] == 0 and lab[1, 2] == -1 and lab[2, 1] == -1
    assert (blobs["rpn_bbox_outside_weights_wide"][0][:, 2, 2] == 0.5).all()


def test_scaled_gt_and_crowd_ignored():
    # Scale 2 doubles the gt box; the crowd box is not a gt for the RPN.
    cfg = _tiny_cfg()
    blobs: dict = {}
    e = _entry([[4, 4, 19.5, 19.5], [0, 0, 30, 30]], crowd=[False, True], width=32, height=32)
    rpn.add_rpn_blobs(blobs, [2.0], [e], cfg, np.random.RandomState(0))
    assert blobs["rpn_labels_int32_wide"][0, 0, 1, 1] == 1
    np.testing.assert_array_equal(blobs["im_info"], [[64, 64, 2]])
    back = deserialize_roidb(blobs["roidb"])
    np.testing.assert_array_equal(back[0]["boxes"], e["boxes"])
    np.testing.assert_array_equal(back[0]["is_crowd"], e["is_crowd"])


def test_no_gt_raises_clear_error():
    with pytest.raises(ValueError, match=r"image id 7.*quirk Q27, see docs/detectron_quirks\.md"):
        rpn.add_rpn_blobs({}, [1.0], [_entry([[8, 8, 39, 39]], crowd=[True], image_id=7)],
                          _tiny_cfg(), np.random.RandomState(0))


def _q2_case(fix):
    # Detectron quirk Q2 (docs/detectron_quirks.md): a 5-px corner box has zero IoU with every
    # inside anchor (default
    # single-level anchors of the C4 configs, straddle 0, 800x600).
    cfg = get_cfg()
    cfg.RPN.SIZES = (32, 64, 128, 256, 512)
    fields = rpn_fields(cfg)
    anchors = concat_fields(fields)
    gt = np.array([[0, 0, 4, 4]], np.float32)
    return anchors, rpn.label_anchors(anchors, fields, gt, 600.0, 800.0, cfg.TRAIN,
                                      np.random.RandomState(3), fix_rpn_quirks=fix)


def test_q2_default_makes_zero_iou_anchors_positive():
    anchors, (labelled, labels, fg, _, _) = _q2_case(False)
    inside = (anchors[:, 0] >= 0) & (anchors[:, 1] >= 0) & (anchors[:, 2] < 800) & (
        anchors[:, 3] < 600)
    assert 15000 < inside.sum() < 16500  # ~15.7k, all of them "positive" before sampling
    assert len(fg) == 128  # subsampled from "all inside anchors are positive"
    pos = labelled[labels == 1]
    # a few overwritten by negatives (Detectron quirk Q3,
    # docs/detectron_quirks.md)
    assert 100 <= len(pos) <= 128
    assert (bbox_overlaps(anchors[pos], np.array([[0, 0, 4, 4]], np.float32)) == 0).all()


def test_q2_fixed_makes_no_positive():
    _, (labelled, labels, fg, _, _) = _q2_case(True)
    assert len(fg) == 0 and (labels == 0).all() and len(labelled) == 256


def test_q3_flag_changes_only_negative_sampling():
    cfg = _fpn_cfg(max_size=800, coarsest=32)
    cfg.TRAIN.RPN_POSITIVE_OVERLAP = 0.95  # positives are mostly low-IoU best matches
    fields = rpn_fields(cfg)
    anchors = concat_fields(fields)
    r = np.random.RandomState(5)
    # every gt overlaps some anchor: Detectron quirk Q2 (docs/detectron_quirks.md) cannot
    # occur
    xy = r.uniform(50, 450, (30, 2))
    gt = np.concatenate([xy, xy + r.uniform(20, 150, (30, 2))], 1).astype(np.float32)
    out = {fix: rpn.label_anchors(anchors, fields, gt, 600.0, 800.0, cfg.TRAIN,
                                  np.random.RandomState(11), fix_rpn_quirks=fix)
           for fix in (False, True)}
    d_lab, d_labels, d_fg, d_tgt, _ = out[False]
    f_lab, f_labels, f_fg, f_tgt, _ = out[True]
    np.testing.assert_array_equal(d_fg, f_fg)  # same positives, same targets
    np.testing.assert_array_equal(d_tgt, f_tgt)
    assert set(f_lab[f_labels == 1]) == set(f_fg)  # fixed: no positive overwritten
    assert set(d_lab[d_labels == 1]) <= set(d_fg)
    assert (f_labels == 0).sum() == 256 - len(f_fg)  # fixed: exactly num_bg distinct
    assert (d_labels == 0).sum() <= 256 - len(d_fg)


# --- literal dense port of Detectron's _get_rpn_blobs, for equality -----------------

def _detectron_rpn(all_anchors, foas, gt_boxes, im_h, im_w, train, rng, fix=False):
    t = train.RPN_STRADDLE_THRESH
    if t >= 0:
        inds_inside = np.where((all_anchors[:, 0] >= -t) & (all_anchors[:, 1] >= -t)
                               & (all_anchors[:, 2] < im_w + t)
                               & (all_anchors[:, 3] < im_h + t))[0]
    else:
        inds_inside = np.arange(all_anchors.shape[0])
    anchors = all_anchors[inds_inside]
    n = len(inds_inside)
    labels = np.full(n, -1, np.int32)
    if n == 0:  # Detectron crashes here; the port returns an all-ignore field
        inds_inside = np.zeros(0, np.int64)
        return _detectron_finish(all_anchors, foas, inds_inside, labels,
                                 np.zeros((0, 4), np.float32), np.zeros((0, 4), np.float32),
                                 np.zeros((0, 4), np.float32))
    o = bbox_overlaps(anchors, gt_boxes)
    a2g = o.argmax(axis=1)
    a2g_max = o[np.arange(n), a2g]
    g2a_max = o[o.argmax(axis=0), np.arange(o.shape[1])]
    best = (o == g2a_max) & (g2a_max > 0) if fix else o == g2a_max
    labels[np.where(best)[0]] = 1
    labels[a2g_max >= train.RPN_POSITIVE_OVERLAP] = 1
    num_fg = int(train.RPN_FG_FRACTION * train.RPN_BATCH_SIZE_PER_IM)
    fg = positives = np.where(labels == 1)[0]
    if len(fg) > num_fg:
        labels[rng.choice(fg, size=len(fg) - num_fg, replace=False)] = -1
    fg = np.where(labels == 1)[0]
    num_bg = train.RPN_BATCH_SIZE_PER_IM - np.sum(labels == 1)
    bg = np.where(a2g_max < train.RPN_NEGATIVE_OVERLAP)[0]
    if fix:  # the corrected semantics: without replacement, never a positive
        bg = np.setdiff1d(bg, positives)
        enable = rng.choice(bg, size=num_bg, replace=False) if len(bg) > num_bg else bg
    else:
        enable = bg[rng.randint(len(bg), size=num_bg)] if len(bg) > num_bg else bg
    labels[enable] = 0
    tg = np.zeros((n, 4), np.float32)
    tg[fg] = bbox_transform_targets(anchors[fg], gt_boxes[a2g[fg]], (1, 1, 1, 1))
    iw = np.zeros((n, 4), np.float32)
    iw[labels == 1] = 1
    ow = np.zeros((n, 4), np.float32)
    ne = np.sum(labels >= 0)
    ow[labels >= 0] = 1.0 / ne
    return _detectron_finish(all_anchors, foas, inds_inside, labels, tg, iw, ow)


def _detectron_finish(all_anchors, foas, inds_inside, labels, tg, iw, ow):
    total = all_anchors.shape[0]

    def unmap(d, fill):
        out = np.full((total,) + d.shape[1:], fill, d.dtype)
        out[inds_inside] = d
        return out

    labels, tg, iw, ow = unmap(labels, -1), unmap(tg, 0), unmap(iw, 0), unmap(ow, 0)
    res, start = [], 0
    for f in foas:
        s, a = f.field_size, f.num_cell_anchors
        end = start + s * s * a
        res.append((labels[start:end].reshape(1, s, s, a).transpose(0, 3, 1, 2),
                    *(x[start:end].reshape(1, s, s, 4 * a).transpose(0, 3, 1, 2)
                      for x in (tg, iw, ow))))
        start = end
    return res


@st.composite
def _scenes(draw):
    w, h = draw(st.integers(24, 150)), draw(st.integers(24, 150))
    g = draw(st.integers(1, 6))
    boxes = []
    for _ in range(g):
        x1 = draw(st.floats(0, w - 2, allow_nan=False))
        y1 = draw(st.floats(0, h - 2, allow_nan=False))
        boxes.append([x1, y1, draw(st.floats(x1 + 1, w - 1)), draw(st.floats(y1 + 1, h - 1))])
    crowd = draw(st.lists(st.booleans(), min_size=g, max_size=g))
    crowd[0] = False
    return (w, h, boxes, crowd, draw(st.sampled_from([1.0, 1.25, 0.8])),
            draw(st.sampled_from([0, -1, 8])), draw(st.booleans()), draw(st.integers(0, 99)),
            draw(st.sampled_from([8, 64, 256])), draw(st.booleans()))


@settings(deadline=None, max_examples=40)
@given(_scenes())
def test_matches_detectron_and_invariants(scene):
    w, h, boxes, crowd, scale, straddle, fpn, seed, batch, fix = scene
    cfg = _fpn_cfg(200, 32) if fpn else _tiny_cfg()
    if not fpn:
        cfg.merge_from_dict({"RPN.SIZES": (16, 32, 64), "RPN.ASPECT_RATIOS": (0.5, 1, 2),
                             "TRAIN.MAX_SIZE": 200})
    cfg.merge_from_dict({"TRAIN.RPN_STRADDLE_THRESH": straddle,
                         "TRAIN.RPN_BATCH_SIZE_PER_IM": batch})
    entries = [_entry(boxes, crowd=crowd, width=w, height=h),
               _entry(np.array(boxes)[::-1].copy(), crowd=crowd[::-1], width=h, height=w)]
    blobs: dict = {}
    assert rpn.add_rpn_blobs(blobs, [scale, scale], entries, cfg, np.random.RandomState(seed),
                             fix_rpn_quirks=fix)
    fields = rpn_fields(cfg)
    all_anchors = concat_fields(fields)
    ref_rng = np.random.RandomState(seed)
    names = rpn.get_rpn_blob_names(cfg)[2:]
    for i, e in enumerate(entries):
        gt = (e["boxes"][~e["is_crowd"]] * scale).astype(np.float32)
        im_h, im_w = np.round(e["height"] * scale), np.round(e["width"] * scale)
        ref = _detectron_rpn(all_anchors, fields, gt, im_h, im_w, cfg.TRAIN, ref_rng, fix)
        for li, level in enumerate(ref):
            for k, arr in enumerate(level):
                np.testing.assert_array_equal(blobs[names[4 * li + k]][i], arr[0])
        _check_invariants(blobs, names, i, fields, all_anchors, gt, im_h, im_w, cfg)
    # target_format="compact": the same draws, expanded on the device, are the same blobs
    compact: dict = {}
    rpn.add_rpn_blobs(compact, [scale, scale], entries, cfg, np.random.RandomState(seed),
                      fix_rpn_quirks=fix, compact=True)
    assert not any(k in compact for k in names)
    expanded = expand_targets({k: torch.from_numpy(compact[k]) for k in rpn.RPN_COMPACT_KEYS})
    assert list(expanded) == names
    for k in names:
        assert expanded[k].numpy().dtype == blobs[k].dtype
        np.testing.assert_array_equal(expanded[k].numpy(), blobs[k], err_msg=k)


def _check_invariants(blobs, names, i, fields, all_anchors, gt, im_h, im_w, cfg):
    """Detectron semantics (tested invariants) for image ``i``."""
    flat = []
    for li, f in enumerate(fields):
        lab, tgt, inw, outw = (blobs[n][i] for n in names[4 * li:4 * li + 4])
        a, s = f.num_cell_anchors, f.field_size
        assert lab.shape == (a, s, s) and tgt.shape == inw.shape == outw.shape == (4 * a, s, s)
        flat.append((lab.transpose(1, 2, 0).reshape(-1),
                     inw.transpose(1, 2, 0).reshape(-1, 4), outw.transpose(1, 2, 0).reshape(-1, 4)))
    lab = np.concatenate([x[0] for x in flat])
    inw = np.concatenate([x[1] for x in flat])
    outw = np.concatenate([x[2] for x in flat])
    assert (lab == 1).sum() <= 128 and (lab >= 0).sum() <= cfg.TRAIN.RPN_BATCH_SIZE_PER_IM
    t = cfg.TRAIN.RPN_STRADDLE_THRESH
    if t >= 0:
        outside = ~((all_anchors[:, 0] >= -t) & (all_anchors[:, 1] >= -t)
                    & (all_anchors[:, 2] < im_w + t) & (all_anchors[:, 3] < im_h + t))
        assert (lab[outside] == -1).all()
    np.testing.assert_array_equal(inw, np.repeat((lab == 1)[:, None], 4, 1).astype(np.float32))
    n_ex = (lab >= 0).sum()
    expect = np.where(lab >= 0, np.float32(1.0 / max(n_ex, 1)), 0)[:, None]
    np.testing.assert_array_equal(outw, np.repeat(expect, 4, 1).astype(np.float32))
    iou = bbox_overlaps(all_anchors, gt).max(axis=1)
    high = iou >= cfg.TRAIN.RPN_POSITIVE_OVERLAP
    if t >= 0:
        high &= ~outside
    assert (lab[high] != 0).all()


@pytest.mark.parametrize("kind", ["generator", "randomstate"])
def test_fix_mode_property_on_both_generators(kind):
    cfg = _fpn_cfg(200, 32)
    r = np.random.RandomState(1)
    for trial in range(5):
        xy = r.uniform(0, 120, (4, 2))
        wh = r.uniform(3, 80, (4, 2))
        e = _entry(np.concatenate([xy, np.minimum(xy + wh, 149)], 1), width=150, height=150)
        g = np.random.default_rng(trial) if kind == "generator" else np.random.RandomState(trial)
        blobs: dict = {}
        rpn.add_rpn_blobs(blobs, [1.0], [e], cfg, g, fix_rpn_quirks=True)
        lab = np.concatenate([blobs[f"rpn_labels_int32_wide_fpn{lv}"].ravel()
                              for lv in range(2, 7)])
        n_pos = (lab == 1).sum()
        assert 1 <= n_pos <= 128 and (lab == 0).sum() == 256 - n_pos


def test_alloc_places_the_wide_blobs():
    made = []

    def alloc(shape, dtype):
        made.append((shape, dtype))
        return np.zeros(shape, dtype)

    cfg = _tiny_cfg()
    a: dict = {}
    b: dict = {}
    e = [_entry([[8, 8, 39, 39], [30, 30, 50, 50]])]
    rpn.add_rpn_blobs(a, [1.0], e, cfg, np.random.RandomState(0), alloc=alloc)
    rpn.add_rpn_blobs(b, [1.0], e, cfg, np.random.RandomState(0))
    assert made == [((1, 1, 4, 4), np.int32)] + [((1, 4, 4, 4), np.float32)] * 3
    for k in b:
        np.testing.assert_array_equal(a[k], b[k])
