"""FPN level distribution (Detectron semantics: FPN RoI levels; tested invariants) and Mask R-CNN
targets (Detectron semantics: mask targets, item 21)."""

from __future__ import annotations

import numpy as np
import pycocotools.mask as mask_util
import pytest
from hypothesis import given, settings, strategies as st

from lit_roidata.minibatch.fast_rcnn import add_fast_rcnn_blobs
from lit_roidata.minibatch.fpn import add_multilevel_roi_blobs, map_rois_to_fpn_levels
from lit_roidata.minibatch.mask import expand_class_specific_masks, rasterize_segms_in_boxes
from test_minibatch_helpers import make_entry, small_cfg


# ------------------------------------------------------------------------------- FPN
def test_fpn_level_hand_cases():
    sides = [224, 112, 448, 16, 1001, 111]  # sqrt(area) with the +1 convention
    rois = np.array([[0, 0, s - 1, s - 1] for s in sides], np.float32)
    lv = map_rois_to_fpn_levels(rois, 2, 5)
    assert lv.tolist() == [4, 3, 5, 2, 5, 2]
    blobs: dict = {}
    full = np.hstack([np.zeros((6, 1), np.float32), rois])
    add_multilevel_roi_blobs(blobs, "rois", full, lv, 2, 5)
    assert np.array_equal(blobs["rois_fpn2"], full[[3, 5]])
    assert np.array_equal(blobs["rois_fpn3"], full[[1]])
    assert np.array_equal(blobs["rois_fpn5"], full[[2, 4]])
    # stacked order is [3, 5 | 1 | 0 | 2, 4]; restore[i] = position of row i in it
    assert blobs["rois_idx_restore_int32"].tolist() == [3, 2, 4, 0, 5, 1]
    assert blobs["rois_idx_restore_int32"].dtype == np.int32


@settings(deadline=None, max_examples=50)
@given(st.lists(st.tuples(st.floats(0, 500), st.floats(0, 500), st.floats(0, 900),
                          st.floats(0, 900)), min_size=0, max_size=40),
       st.integers(1, 3), st.integers(3, 6))
def test_fpn_restore_and_levels(boxes, lo, hi):
    """Detectron semantics: tested invariants: concat(levels)[restore] == rois; each roi on its
    formula level."""
    b = np.array([[x, y, x + w, y + h] for x, y, w, h in boxes], np.float32).reshape(-1, 4)
    rois = np.hstack([np.zeros((len(b), 1), np.float32), b])
    lv = map_rois_to_fpn_levels(b, lo, hi)
    blobs: dict = {}
    add_multilevel_roi_blobs(blobs, "rois", rois, lv, lo, hi)
    stacked = np.vstack([blobs[f"rois_fpn{l}"] for l in range(lo, hi + 1)])
    assert np.array_equal(stacked[blobs["rois_idx_restore_int32"]], rois)
    area = (b[:, 2] - b[:, 0] + 1.0).astype(np.float64) * (b[:, 3] - b[:, 1] + 1.0)
    exact = 4 + np.log2(np.sqrt(area) / 224 + 1e-6)
    near_boundary = np.abs(exact - np.round(exact)) < 1e-4
    want = np.clip(np.floor(exact), lo, hi)
    assert np.all((lv == want) | near_boundary)
    for l in range(lo, hi + 1):  # each level blob keeps the original row order
        idx = np.flatnonzero(want == l)
        if not near_boundary.any():
            assert np.array_equal(blobs[f"rois_fpn{l}"], rois[idx])


# ------------------------------------------------------------------------------ masks
def _square(x0, y0, x1, y1):
    return [[x0, y0, x1, y0, x1, y1, x0, y1]]


def test_rasterise_known_polygon():
    """A square [2, 6) x [2, 6) in a 10x10 RoI frame covers pixel centres 2..5."""
    want = np.zeros((10, 10), np.int32)
    want[2:6, 2:6] = 1
    cases = [([0, 0, 10, 10], _square(2, 2, 6, 6)),      # identity frame
             ([0, 0, 20, 20], _square(4, 4, 12, 12)),     # scale 1/2 (w = x2 - x1, no +1)
             ([10, 10, 30, 30], _square(14, 14, 22, 22))]  # offset
    boxes = np.array([c[0] for c in cases], np.float32)
    masks = rasterize_segms_in_boxes([c[1] for c in cases], boxes, 10, 40, 40)
    for m in masks:
        assert np.array_equal(m.reshape(10, 10), want)


def test_batched_rasterisation_equals_pycocotools_per_roi():
    r = np.random.default_rng(1)
    segms = [[list(r.uniform(0, 30, 8)), list(r.uniform(0, 30, 6))], [list(r.uniform(0, 30, 10))]]
    boxes = np.array([[2, 3, 25, 20], [0, 0, 30, 30], [5, 5, 6, 5]], np.float32)  # last: w, h -> 1
    chosen = [segms[0], segms[1], segms[0]]
    got = rasterize_segms_in_boxes(chosen, boxes, 7, 40, 40)
    for i, (segm, b) in enumerate(zip(chosen, boxes)):
        w, h = max(b[2] - b[0], 1), max(b[3] - b[1], 1)
        parts = []
        for p in segm:
            p = np.array(p, np.float64)
            p[0::2] = (p[0::2] - b[0]) * 7 / w
            p[1::2] = (p[1::2] - b[1]) * 7 / h
            parts.append(p)
        ref = mask_util.decode(mask_util.merge(mask_util.frPyObjects(parts, 7, 7)))
        assert np.array_equal(got[i], ref.reshape(-1))


def test_rle_segm_matches_polygon_for_rectangle_and_empty_is_ignored():
    full = np.zeros((32, 32), np.uint8)
    full[4:12, 4:12] = 1
    rle = mask_util.encode(np.asfortranarray(full))
    boxes = np.array([[4, 4, 12, 12]] * 3, np.float32)
    m = rasterize_segms_in_boxes([rle, _square(4, 4, 12, 12), []], boxes, 8, 32, 32)
    assert m[0].all() and np.array_equal(m[0], m[1])
    # Detectron quirk Q24 (docs/detectron_quirks.md): no usable polygon -> ignored target, no
    # crash
    assert (m[2] == -1).all()


def test_class_specific_expansion():
    masks = np.array([[1, 0, 1, 1], [-1, -1, -1, -1]], np.int32)
    out = expand_class_specific_masks(masks, np.array([2, 0]), 3)
    assert out.shape == (2, 12)
    assert np.array_equal(out[0], [-1] * 8 + [1, 0, 1, 1])
    assert (out[1] == -1).all()
    with pytest.raises(ValueError, match="NUM_CLASSES"):
        expand_class_specific_masks(masks, np.array([3, 0]), 3)


def test_bg_placeholder_when_no_fg():
    cfg = small_cfg(**{"MODEL.MASK_ON": True, "MRCNN.RESOLUTION": 4})
    e = make_entry(np.random.default_rng(0), num_gt=1, num_props=10)
    e["max_overlaps"][:] = 0.1  # nothing is fg
    blobs: dict = {}
    add_fast_rcnn_blobs(blobs, [1.5], [e], cfg, np.random.default_rng(0))
    assert (blobs["labels_int32"] == 0).all()
    assert blobs["roi_has_mask_int32"].tolist() == [1] + [0] * (len(blobs["labels_int32"]) - 1)
    assert np.array_equal(blobs["mask_rois"], blobs["rois"][:1])
    assert blobs["masks_int32"].shape == (1, 5 * 16) and (blobs["masks_int32"] == -1).all()


def test_empty_polygon_gt_q24_does_not_crash():
    cfg = small_cfg(**{"MODEL.MASK_ON": True, "MRCNN.RESOLUTION": 4})
    e = make_entry(np.random.default_rng(2), num_gt=2, num_props=20)
    e["segms"][0] = []  # all parts had < 6 coordinates
    blobs: dict = {}
    add_fast_rcnn_blobs(blobs, [1.0], [e], cfg, np.random.default_rng(0))
    assert set(np.unique(blobs["masks_int32"])) <= {-1, 0, 1}


@settings(deadline=None, max_examples=40)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.booleans(), st.booleans())
def test_mask_invariants(seed, n_images, cls_specific, fpn):
    """Detectron semantics: tested invariants (and item 20 for mask_rois) on random entries."""
    r = np.random.default_rng(seed)
    cfg = small_cfg(**{"MODEL.MASK_ON": True, "MRCNN.RESOLUTION": 6,
                       "MRCNN.CLS_SPECIFIC_MASK": cls_specific, "FPN.FPN_ON": fpn,
                       "FPN.MULTILEVEL_ROIS": fpn, "FPN.ROI_CANONICAL_SCALE": 16})
    entries = [make_entry(r, num_gt=int(r.integers(1, 4)), num_props=int(r.integers(0, 30)),
                          crowd=bool(r.integers(2))) for _ in range(n_images)]
    if r.integers(2):  # an image without any fg candidate
        entries[0]["max_overlaps"] = np.minimum(entries[0]["max_overlaps"], 0.3)
    blobs: dict = {}
    add_fast_rcnn_blobs(blobs, [1.0 + 0.5 * i for i in range(n_images)], entries, cfg,
                        np.random.default_rng(seed))
    rois, labels = blobs["rois"], blobs["labels_int32"]
    has = blobs["roi_has_mask_int32"]
    assert has.dtype == np.int32 and has.shape == labels.shape
    assert np.array_equal(rois[has == 1], blobs["mask_rois"])
    masks = blobs["masks_int32"]
    M2 = 36
    assert set(np.unique(masks)) <= {-1, 0, 1}
    mask_labels = labels[has == 1]
    for i, row in enumerate(masks):
        img = int(blobs["mask_rois"][i, 0])
        img_has_fg = (labels[rois[:, 0] == img] > 0).any()
        if mask_labels[i] == 0:  # the bg placeholder
            assert not img_has_fg and (row == -1).all()
        elif cls_specific:
            slots = row.reshape(cfg.MODEL.NUM_CLASSES, M2)
            nonneg = np.flatnonzero((slots >= 0).any(1))
            assert set(nonneg) <= {mask_labels[i]}
        else:
            assert row.shape == (M2,)
    for img in range(n_images):
        if (labels[rois[:, 0] == img] > 0).any() or (rois[:, 0] == img).any():
            assert (blobs["mask_rois"][:, 0] == img).any()
    if fpn:
        stacked = np.vstack([blobs[f"mask_rois_fpn{l}"] for l in range(2, 6)])
        assert np.array_equal(stacked[blobs["mask_rois_idx_restore_int32"]], blobs["mask_rois"])
