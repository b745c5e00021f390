"""Unit/property tests of the vectorised building blocks against Detectron's formulas."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from lit_roidata.boxes import bbox_overlaps
from lit_roidata.roidb.filters import segment_any
from lit_roidata.roidb.proposals import _block_iou, iof_pairs, unique_box_keep
from lit_roidata.roidb.segms import (SegmColumns, decode_segms, mask_to_uncompressed_counts,
                                     offsets, rle_columns)

SET = settings(deadline=None, max_examples=50)


def boxes_strategy(max_n=30, hi=2000.0):
    coords = st.floats(0, hi, width=32, allow_nan=False)
    return hnp.arrays(np.float32, st.tuples(st.integers(0, max_n), st.just(4)), elements=coords)


def _xyxy(b):
    b = np.array(b, np.float32)
    b[:, 2] = np.maximum(b[:, 0], b[:, 2])
    b[:, 3] = np.maximum(b[:, 1], b[:, 3])
    return b


@SET
@given(boxes=boxes_strategy(), groups=st.integers(1, 4), scale=st.sampled_from([1.0, 1e6]))
def test_unique_box_keep_matches_detectron(boxes, groups, scale):
    """Per group, Detectron's ``np.unique(hashes, return_index=True)`` then sort (Detectron
    semantics: proposals)."""
    boxes = _xyxy(boxes * np.float32(scale))
    g = np.sort(np.arange(boxes.shape[0]) % groups)
    keep = unique_box_keep(boxes, g)
    expected = np.zeros(boxes.shape[0], bool)
    for k in range(groups):
        idx = np.flatnonzero(g == k)
        hashes = np.round(boxes[idx]).dot(np.array([1, 1e3, 1e6, 1e9]))
        _, first = np.unique(hashes, return_index=True)
        expected[idx[np.sort(first)]] = True
    np.testing.assert_array_equal(keep, expected)


def test_unique_box_keep_hash_collision_q13():
    # equal hashes (Detectron quirk Q13,
    # docs/detectron_quirks.md)
    b = np.array([[1000, 0, 5, 5], [0, 1, 5, 5]], np.float32)
    np.testing.assert_array_equal(unique_box_keep(b, np.zeros(2, int)), [True, False])


@SET
@given(p=boxes_strategy(40, 100.0), g=boxes_strategy(6, 100.0))
def test_block_iou_equals_bbox_overlaps(p, g):
    p, g = _xyxy(p), _xyxy(g)
    if g.shape[0] == 0:
        return
    # two "images" in one padded block: the same proposals against gt and reversed gt
    pp = np.stack([p, p]).astype(np.float64)
    gg = np.stack([g, g[::-1]]).astype(np.float64)
    out = _block_iou(pp, gg)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out[0], bbox_overlaps(p, g))
    np.testing.assert_array_equal(out[1], bbox_overlaps(p, g[::-1]))


@SET
@given(p=boxes_strategy(20, 100.0), c=boxes_strategy(4, 100.0))
def test_iof_equals_pycocotools(p, c):
    from pycocotools import mask as mask_util

    p, c = _xyxy(p), _xyxy(c)
    if p.shape[0] == 0 or c.shape[0] == 0:
        return

    def xywh(b):
        return np.hstack((b[:, 0:2], b[:, 2:4] - b[:, 0:2] + 1))

    ref = mask_util.iou(xywh(p), xywh(c), [1] * c.shape[0])
    pi, ci = np.meshgrid(np.arange(p.shape[0]), np.arange(c.shape[0]), indexing="ij")
    ours = iof_pairs(p[pi.ravel()], c[ci.ravel()]).reshape(p.shape[0], c.shape[0])
    np.testing.assert_array_equal(ours, ref)


@SET
@given(flags=hnp.arrays(bool, st.integers(0, 30)), cuts=st.lists(st.integers(0, 30), max_size=6))
def test_segment_any(flags, cuts):
    off = np.array(sorted({0, flags.size, *[min(c, flags.size) for c in cuts]}))
    got = segment_any(flags, off)
    np.testing.assert_array_equal(got, [flags[a:b].any() for a, b in zip(off[:-1], off[1:])])


@SET
@given(polys=st.lists(st.lists(st.lists(st.floats(0, 50, allow_nan=False), min_size=0,
                                        max_size=10), max_size=3), max_size=5),
       width=st.integers(51, 100))
def test_polygon_round_trip_and_flip(polys, width):
    kept = [[p for p in s if len(p) >= 6] for s in polys]
    flat = [p for s in kept for p in s]
    kind, rle_idx = np.zeros(len(kept), np.int8), np.full(len(kept), -1, np.int32)
    cols = SegmColumns(kind=kind, poly_off=offsets([len(s) for s in kept]),
                       coord_off=offsets([len(p) for p in flat]),
                       coords=np.array([c for p in flat for c in p], np.float64),
                       rle_idx=rle_idx, **rle_columns([], [], kind, rle_idx))
    assert decode_segms(cols, 0, len(polys)) == kept
    flipped = decode_segms(cols, 0, len(polys), flipped=True, width=width)
    for fs, ks in zip(flipped, kept):
        for fp, kp in zip(fs, ks):
            exp = np.array(kp, np.float64)
            exp[0::2] = width - exp[0::2] - 1
            assert fp == exp.tolist()


@SET
@given(mask=hnp.arrays(np.uint8, st.tuples(st.integers(1, 8), st.integers(1, 8)),
                       elements=st.integers(0, 1)))
def test_uncompressed_counts_match_pycocotools(mask):
    from pycocotools import mask as mask_util

    counts = mask_to_uncompressed_counts(mask)
    h, w = mask.shape
    rle = mask_util.frPyObjects({"size": [h, w], "counts": counts}, h, w)
    np.testing.assert_array_equal(mask_util.decode(rle), mask)
