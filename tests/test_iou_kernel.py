"""The one IoU kernel per backend (``boxes.iou_kernel`` / ``iou_kernel_torch``) against a
scalar transcription of Detectron's Cython ``bbox_overlaps``, bit for bit, through every
adapter that calls it (dense, row-wise, blocked proposal merge, sparse anchors, torch)."""

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.boxes import (
    bbox_overlaps,
    bbox_overlaps_pairs,
    bbox_overlaps_torch,
    iou_kernel,
)
from lit_roidata.roidb.proposals import _block_iou, _merge, _merge_blocks


def _cython_iou(boxes: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Detectron's ``utils/cython_bbox.pyx`` loop, in Python floats (IEEE double)."""
    out = np.zeros((boxes.shape[0], query.shape[0]), np.float32)
    for k in range(query.shape[0]):
        qx1, qy1, qx2, qy2 = (float(v) for v in query[k])
        box_area = (qx2 - qx1 + 1) * (qy2 - qy1 + 1)
        for n in range(boxes.shape[0]):
            bx1, by1, bx2, by2 = (float(v) for v in boxes[n])
            iw = min(bx2, qx2) - max(bx1, qx1) + 1
            if iw > 0:
                ih = min(by2, qy2) - max(by1, qy1) + 1
                if ih > 0:
                    ua = (bx2 - bx1 + 1) * (by2 - by1 + 1) + box_area - iw * ih
                    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                        out[n, k] = np.float32(np.float64(iw * ih) / np.float64(ua))
    return out


def _boxes(n_max=9, degenerate=False):
    coord = st.floats(0, 60, allow_nan=False, width=32)
    lo = -3 if degenerate else 0
    size = st.floats(lo, 40, allow_nan=False, width=32)
    box = st.tuples(coord, coord, size, size).map(
        lambda t: [t[0], t[1], t[0] + t[2], t[1] + t[3]])
    return st.lists(box, min_size=0, max_size=n_max).map(
        lambda b: np.array(b, dtype=np.float32).reshape(-1, 4))


def _same(got: np.ndarray, ref: np.ndarray) -> None:
    """Bitwise equality (NaN patterns included)."""
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_array_equal(got.view(np.int32), ref.view(np.int32))


def test_kernel_by_hand():
    a = np.array([[0, 0, 9, 9]], np.float64)   # 10 x 10
    b = np.array([[5, 5, 14, 14], [10, 0, 19, 9], [0, 0, 9, 9]], np.float64)
    got = bbox_overlaps(a, b)
    np.testing.assert_array_equal(got, np.float32([[25 / 175, 0.0, 1.0]]))


@settings(max_examples=60, deadline=None)
@given(_boxes(degenerate=True), _boxes(degenerate=True))
def test_every_adapter_is_detectrons_arithmetic(a, b):
    ref = _cython_iou(a, b)
    _same(bbox_overlaps(a, b), ref)
    _same(bbox_overlaps_torch(torch.from_numpy(a), torch.from_numpy(b)).numpy(), ref)
    if len(a) and len(b):
        _same(_block_iou(a[None].astype(np.float64), b[None].astype(np.float64))[0], ref)
        n = min(len(a), len(b))
        _same(bbox_overlaps_pairs(a[:n], b[:n]), ref[np.arange(n), np.arange(n)])


@settings(max_examples=60, deadline=None)
@given(_boxes(), _boxes())
def test_buffered_positive_path_equals_general_path(a, b):
    if not (len(a) and len(b)):
        return
    a64, b64 = a.astype(np.float64)[:, None, :], b.astype(np.float64)[None, :, :]
    args = [a64[..., c] for c in range(4)] + [
        (a64[..., 2] - a64[..., 0] + 1) * (a64[..., 3] - a64[..., 1] + 1)]
    args += [b64[..., c] for c in range(4)] + [
        (b64[..., 2] - b64[..., 0] + 1) * (b64[..., 3] - b64[..., 1] + 1)]
    shape = (len(a), len(b))
    out = np.full(shape, np.nan, np.float32)
    work = tuple(np.full(shape, np.nan) for _ in range(3))
    got = iou_kernel(*args, out=out, work=work, positive_areas=True)
    assert got is out
    _same(got, iou_kernel(*args))
    _same(got, _cython_iou(a, b))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(_boxes(), _boxes(n_max=4)), min_size=1, max_size=4))
def test_blocked_merge_matches_dense_argmax(images):
    """The running-max merge (kernel per gt slot) and the argmax fallback agree with the
    dense matrix: maximum, first maximal gt, class."""
    boxes = [p for p, _ in images]
    gts = [g for _, g in images]
    b = np.concatenate(boxes).astype(np.float32)
    img = np.concatenate([np.full(len(p), i) for i, p in enumerate(boxes)]).astype(np.int64)
    gt_off = np.r_[0, np.cumsum([len(g) for g in gts])].astype(np.int64)
    gt_boxes = np.concatenate(gts).astype(np.float32)
    gt_classes = np.arange(1, len(gt_boxes) + 1, dtype=np.int32)
    for merge in (_merge, _merge_blocks):
        mo, mc, gmap = merge(b, img, gt_off, gt_boxes, gt_classes)
        for i, (p, g) in enumerate(images):
            sl = img == i
            if not (len(p) and len(g)):
                assert (mo[sl] == 0).all() and (gmap[sl] == -1).all()
                continue
            ov = _cython_iou(p, g)
            best, arg = ov.max(1), ov.argmax(1)
            hit = best > 0
            _same(mo[sl], np.where(hit, best, 0).astype(np.float32))
            np.testing.assert_array_equal(gmap[sl], np.where(hit, arg, -1))
            np.testing.assert_array_equal(mc[sl], np.where(hit, gt_classes[gt_off[i] + arg], 0))
