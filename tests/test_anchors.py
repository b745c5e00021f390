"""Anchors and fields of anchors (Detectron semantics: minibatch primitives, Detectron quirk Q29
(docs/detectron_quirks.md))."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.config import get_cfg
from lit_roidata.minibatch.anchors import (
    concat_fields, field_size, generate_anchors, get_field_of_anchors, level_offsets,
    retinanet_fields, rpn_fields)


def test_worked_example_fpn_level2():
    np.testing.assert_array_equal(generate_anchors(4, (32,), (0.5, 1, 2)),
                                  [[-22, -10, 25, 13], [-14, -14, 17, 17], [-10, -22, 13, 25]])


def test_classic_stride16_anchors_ratio_major():
    # The well-known py-faster-rcnn / Detectron anchors (sizes 128, 256, 512).
    a = generate_anchors(16, (128, 256, 512), (0.5, 1, 2))
    np.testing.assert_array_equal(a, [
        [-84, -40, 99, 55], [-176, -88, 191, 103], [-360, -184, 375, 199],
        [-56, -56, 71, 71], [-120, -120, 135, 135], [-248, -248, 263, 263],
        [-36, -80, 51, 95], [-80, -168, 95, 183], [-168, -344, 183, 359]])


def test_round_half_to_even():
    # stride 16, ratio 0.5: w = round(sqrt(512)) = 23, h = round(11.5) = 12 (not 13).
    a = generate_anchors(16, (16,), (0.5,))[0]
    assert a[2] - a[0] + 1 == 23 and a[3] - a[1] + 1 == 12


@settings(deadline=None, max_examples=50)
@given(st.sampled_from([4, 8, 16, 32, 64, 128]),
       st.lists(st.sampled_from([16.0, 32.0, 40.3, 64.0, 128.0, 512.0]), min_size=1, max_size=3),
       st.lists(st.sampled_from([0.5, 1.0, 2.0, 1.5, 0.25]), min_size=1, max_size=3))
def test_generate_anchors_properties(stride, sizes, ratios):
    a = generate_anchors(stride, sizes, ratios)
    assert a.shape == (len(sizes) * len(ratios), 4)
    c = (stride - 1) / 2
    np.testing.assert_allclose((a[:, 0] + a[:, 2]) / 2, c, atol=1e-9)
    np.testing.assert_allclose((a[:, 1] + a[:, 3]) / 2, c, atol=1e-9)
    for ri, r in enumerate(ratios):
        w_r = np.round(np.sqrt(stride * stride / r))
        h_r = np.round(w_r * r)
        for si, s in enumerate(sizes):  # ratio-major, size-minor
            row = a[ri * len(sizes) + si]
            np.testing.assert_allclose(row[2] - row[0] + 1, w_r * s / stride, rtol=1e-12)
            np.testing.assert_allclose(row[3] - row[1] + 1, h_r * s / stride, rtol=1e-12)


@pytest.mark.parametrize("stride,expected", [(4, 336), (8, 168), (16, 84), (32, 42), (64, 21)])
def test_field_sizes_max1333(stride, expected):
    assert field_size(stride, 32, 1333) == expected


def test_field_size_non_fpn_uses_coarsest_stride_q29():
    cfg = get_cfg()  # MAX_SIZE 1000, RPN.STRIDE 16, COARSEST 32 -> fpn_max 1024
    assert rpn_fields(cfg)[0].field_size == 64
    cfg.FPN.COARSEST_STRIDE = 128  # FPN is off, yet the field grows: 1024 -> 1024/16 = 64
    cfg.TRAIN.MAX_SIZE = 1025  # 1152 / 16 = 72 (with COARSEST 32 it would be 66)
    assert rpn_fields(cfg)[0].field_size == 72


def test_field_enumeration_y_x_a():
    f = get_field_of_anchors(8, (32, 64), (0.5, 1, 2), coarsest_stride=32, max_size=40)
    cell = generate_anchors(8, (32, 64), (0.5, 1, 2))
    A, F = f.num_cell_anchors, f.field_size
    assert (A, F) == (6, 8) and f.field_of_anchors.shape == (F * F * A, 4)
    assert f.field_of_anchors.dtype == np.float32
    for y, x, a in [(0, 0, 0), (0, 1, 2), (3, 5, 5), (7, 7, 1)]:
        np.testing.assert_array_equal(f.field_of_anchors[(y * F + x) * A + a],
                                      (cell[a] + [x * 8, y * 8, x * 8, y * 8]).astype(np.float32))


def test_memoised_and_read_only():
    kw = dict(coarsest_stride=32, max_size=1333)
    f1 = get_field_of_anchors(16, (32,), (1,), **kw)
    f2 = get_field_of_anchors(16.0, [32.0], [1.0], **kw)
    assert f1.field_of_anchors is f2.field_of_anchors
    with pytest.raises(ValueError):
        f1.field_of_anchors[0, 0] = 5
    assert get_field_of_anchors(16, (32,), (1,), coarsest_stride=32,
                                max_size=800).field_of_anchors is not f1.field_of_anchors


def test_fpn_rpn_fields_and_concat():
    cfg = get_cfg()
    cfg.merge_from_dict({"FPN.FPN_ON": True, "FPN.MULTILEVEL_RPN": True, "TRAIN.MAX_SIZE": 1333})
    fields = rpn_fields(cfg)
    assert [f.field_size for f in fields] == [336, 168, 84, 42, 21]
    assert [f.num_cell_anchors for f in fields] == [3] * 5
    np.testing.assert_array_equal(fields[0].field_of_anchors[:3],
                                  [[-22, -10, 25, 13], [-14, -14, 17, 17], [-10, -22, 13, 25]])
    sizes = [f.field_of_anchors[1, 2] - f.field_of_anchors[1, 0] + 1 for f in fields]
    assert sizes == [32, 64, 128, 256, 512]  # square anchor of each level
    allf = concat_fields(fields)
    assert allf is concat_fields(rpn_fields(cfg))
    off = level_offsets(fields)
    assert off[-1] == allf.shape[0] == 3 * (336**2 + 168**2 + 84**2 + 42**2 + 21**2)
    np.testing.assert_array_equal(allf[off[2]:off[3]], fields[2].field_of_anchors)


def test_retinanet_fields_order():
    cfg = get_cfg()
    cfg.merge_from_dict({"FPN.FPN_ON": True, "RETINANET.RETINANET_ON": True,
                         "FPN.RPN_MIN_LEVEL": 3, "FPN.RPN_MAX_LEVEL": 7,
                         "FPN.COARSEST_STRIDE": 128, "TRAIN.MAX_SIZE": 1333,
                         "RETINANET.ASPECT_RATIOS": (1.0, 2.0, 0.5)})
    fields = retinanet_fields(cfg)
    assert len(fields) == 5 * 3 * 3
    f = fields[4]  # level 3, octave 1, aspect 1 (ratio 2.0)
    assert (f.stride, f.octave, f.aspect, f.num_cell_anchors) == (8.0, 1, 1, 1)
    np.testing.assert_array_equal(
        f.field_of_anchors[:1], generate_anchors(8, (8 * 2 ** (1 / 3) * 4,), (2.0,)).astype(
            np.float32))
    assert fields[-1].field_size == field_size(128, 128, 1333) == 11


@settings(deadline=None, max_examples=25)
@given(st.integers(1, 1400), st.integers(1, 1400), st.sampled_from([-1.0, 0.0, 0.5, 3.0, 40.0]),
       st.booleans())
def test_inside_mask_equals_the_straddle_test_on_every_anchor(im_h, im_w, t, fpn):
    """The per-shape rectangles give exactly ``x1 >= -t, y1 >= -t, x2 < W + t, y2 < H + t``
    evaluated on every anchor (all anchors when ``t < 0``)."""
    from lit_roidata.minibatch.anchors import _inside_mask, concat_fields, inside_mask, rpn_fields

    cfg = get_cfg()
    cfg.merge_from_dict({"FPN.FPN_ON": fpn, "FPN.MULTILEVEL_RPN": fpn})
    fields = rpn_fields(cfg)
    a = concat_fields(fields)
    _inside_mask.cache_clear()
    got = inside_mask(fields, float(im_h), float(im_w), t)
    want = (np.ones(len(a), bool) if t < 0 else
            (a[:, 0] >= -t) & (a[:, 1] >= -t) & (a[:, 2] < im_w + t) & (a[:, 3] < im_h + t))
    assert got.dtype == bool and np.array_equal(got, want)


@settings(deadline=None, max_examples=15)
@given(st.integers(20, 300), st.integers(20, 300), st.sampled_from([-1.0, 0.0, 8.0]),
       st.lists(st.tuples(st.floats(0, 250), st.floats(0, 250), st.floats(1, 120),
                          st.floats(1, 120)), min_size=1, max_size=4))
def test_anchor_gt_overlaps_keeps_every_nonzero_iou(im_h, im_w, t, boxes):
    from lit_roidata.boxes import bbox_overlaps
    from lit_roidata.minibatch.anchors import anchor_gt_overlaps, inside_mask

    fields = rpn_fields(get_cfg())
    a = concat_fields(fields)
    gt = np.array([[x, y, x + w, y + h] for x, y, w, h in boxes], np.float32)
    inside = inside_mask(fields, im_h, im_w, t)
    cand, got = anchor_gt_overlaps(fields, a, inside, gt)
    dense = bbox_overlaps(a, gt)
    dense[~inside] = 0
    want = np.flatnonzero(dense.max(axis=1) > 0)
    assert set(want) <= set(cand) and inside[cand].all()
    assert np.array_equal(got, dense[cand])
