"""Box primitives (Detectron semantics: minibatch primitives; bounding-box regression targets):
hand-checked cases and property tests."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.boxes import (
    bbox_overlaps,
    bbox_overlaps_torch,
    bbox_transform_inv,
    bbox_transform_inv_torch,
    bbox_transform_targets,
    bbox_transform_targets_torch,
    clip_boxes,
    flip_boxes,
)


def _boxes(n_max=12):
    coord = st.floats(0, 500, allow_nan=False, width=32)
    box = st.tuples(coord, coord, st.floats(0, 200, width=32), st.floats(0, 200, width=32)).map(
        lambda t: [t[0], t[1], t[0] + t[2], t[1] + t[3]])
    return st.lists(box, min_size=0, max_size=n_max).map(
        lambda b: np.array(b, dtype=np.float32).reshape(-1, 4))


def test_iou_plus_one_convention_by_hand():
    a = np.array([[0, 0, 9, 9]], np.float32)          # 10 x 10 = 100
    b = np.array([[5, 5, 14, 14], [10, 10, 20, 20], [0, 0, 9, 9]], np.float32)
    # overlap 5x5 = 25, union 175; touching at x=10 does not overlap; identical -> 1
    np.testing.assert_allclose(bbox_overlaps(a, b), [[25 / 175, 0.0, 1.0]], rtol=1e-6)
    # a single-pixel box overlaps itself: width x2-x1+1 = 1
    p = np.array([[3, 3, 3, 3]], np.float32)
    assert bbox_overlaps(p, p)[0, 0] == 1.0


def test_iou_empty_inputs():
    assert bbox_overlaps(np.zeros((0, 4)), np.zeros((3, 4))).shape == (0, 3)
    assert bbox_overlaps_torch(torch.zeros(2, 4), torch.zeros(0, 4)).shape == (2, 0)


@settings(deadline=None, max_examples=50)
@given(_boxes(), _boxes())
def test_iou_torch_matches_numpy_and_is_bounded(a, b):
    ref = bbox_overlaps(a, b)
    got = bbox_overlaps_torch(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    assert ((ref >= 0) & (ref <= 1)).all()
    np.testing.assert_allclose(bbox_overlaps(b, a), ref.T, rtol=1e-6)


@settings(deadline=None, max_examples=50)
@given(_boxes(), st.sampled_from([(1.0, 1.0, 1.0, 1.0), (10.0, 10.0, 5.0, 5.0)]))
def test_targets_decode_back_to_gt(gt, weights):
    ex = gt[::-1].copy() if len(gt) else gt
    t = bbox_transform_targets(ex, gt, weights)
    np.testing.assert_allclose(
        t, bbox_transform_targets_torch(torch.from_numpy(ex), torch.from_numpy(gt), weights),
        rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(bbox_transform_inv(ex, t, weights), gt, rtol=1e-4, atol=1e-2)


def test_targets_by_hand():
    ex = np.array([[0, 0, 9, 9]], np.float32)       # w = h = 10, centre 5
    gt = np.array([[10, 0, 29, 9]], np.float32)     # w = 20, centre x 20
    t = bbox_transform_targets(ex, gt, (10.0, 10.0, 5.0, 5.0))
    np.testing.assert_allclose(t, [[10 * 15 / 10, 0.0, 5 * np.log(2.0), 0.0]], rtol=1e-6)


@settings(deadline=None, max_examples=50)
@given(_boxes(), st.integers(501, 800))
def test_flip_is_an_involution(boxes, width):
    np.testing.assert_allclose(flip_boxes(flip_boxes(boxes, width), width), boxes, atol=1e-3)


def test_clip_by_hand():
    b = np.array([[-5, -1, 700, 30]], np.float32)
    np.testing.assert_array_equal(clip_boxes(b, height=20, width=640), [[0, 0, 639, 19]])


def test_decode_torch_by_hand():
    anchor = torch.tensor([[0.0, 0.0, 15.0, 15.0]])  # w = h = 16, centre (8, 8)
    # dx 0.5 -> centre x 16, dy -0.25 -> centre y 4, dw log 2 -> w 32, dh 0 -> h 16
    d = torch.tensor([[0.5, -0.25, float(np.log(2.0)), 0.0]])
    expect = [[0.0, -4.0, 31.0, 11.0]]
    np.testing.assert_allclose(bbox_transform_inv_torch(anchor, d), expect, atol=1e-5)
    np.testing.assert_allclose(  # the weights divide the deltas first
        bbox_transform_inv_torch(anchor, d * torch.tensor([10.0, 10.0, 5.0, 5.0]),
                                 (10.0, 10.0, 5.0, 5.0)), expect, atol=1e-5)
    # BBOX_XFORM_CLIP caps the growth at 1000/16 times: w = 1000 about centre 8
    big = torch.tensor([[0.0, 0.0, 10.0, 10.0]])
    got = bbox_transform_inv_torch(anchor, big, clip=float(np.log(1000.0 / 16.0)))
    np.testing.assert_allclose(got, [[-492.0, -492.0, 507.0, 507.0]], atol=1e-3)


@settings(deadline=None, max_examples=50)
@given(_boxes(), st.sampled_from([(1.0, 1.0, 1.0, 1.0), (10.0, 10.0, 5.0, 5.0)]),
       st.integers(0, 2**31 - 1))
def test_decode_torch_matches_numpy(boxes, weights, seed):
    d = np.random.default_rng(seed).normal(size=boxes.shape).astype(np.float32)
    got = bbox_transform_inv_torch(torch.from_numpy(boxes), torch.from_numpy(d).double(),
                                   weights).numpy()
    np.testing.assert_allclose(got, bbox_transform_inv(boxes, d, weights), rtol=1e-9, atol=1e-6)
