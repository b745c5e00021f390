"""The proposal table (filtered IoU merge, chunked processing) against the implementation
it replaced (``tests/oracles/proposals.py``), bit for bit, on random proposal sets:
ties, duplicates, boxes touching a gt edge within a pixel, zero and negative areas, huge
coordinates, images without gt, crowd gt, several chunk and block sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oracles import proposals as OLD
from lit_roidata.roidb import proposals as P
from lit_roidata.roidb.proposal_files import ProposalSource

SET = settings(deadline=None, max_examples=80)
# offsets from a gt edge that straddle Detectron's "+1" overlap boundary and the filter's
# 2-pixel margin
EDGE = np.array([-3.0, -2.0, -1.75, -1.5, -1.0 - 2**-20, -1.0, -1.0 + 2**-20, -0.5, 0.0,
                 0.5, 1.0, 2.0], np.float64)


@st.composite
def tables(draw):
    """A gt table and a proposal source (records shuffled), with adversarial boxes."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 9))
    scale = draw(st.sampled_from([60.0, 1000.0, 2.0**21, 2.0**22 + 8, 3e7]))
    ids = np.sort(rng.choice(np.arange(1, 100), n, replace=False)).astype(np.int64)
    widths = np.maximum(1, (rng.uniform(0.2, 1.0, n) * scale)).astype(np.int64)
    heights = np.maximum(1, (rng.uniform(0.2, 1.0, n) * scale)).astype(np.int64)
    ng = rng.integers(0, 6, n)
    ng[rng.random(n) < 0.2] = 0  # images without gt
    gt_off = np.zeros(n + 1, np.int64)
    np.cumsum(ng, out=gt_off[1:])
    g = int(gt_off[-1])
    im = np.repeat(np.arange(n), ng)
    gb = np.empty((g, 4), np.float64)
    gb[:, 0] = rng.uniform(0, 1, g) * (widths[im] - 1)
    gb[:, 1] = rng.uniform(0, 1, g) * (heights[im] - 1)
    gb[:, 2] = np.minimum(widths[im] - 1, gb[:, 0] + rng.uniform(0, 0.5, g) * widths[im])
    gb[:, 3] = np.minimum(heights[im] - 1, gb[:, 1] + rng.uniform(0, 0.5, g) * heights[im])
    if draw(st.booleans()):
        gb = np.round(gb)
    if draw(st.booleans()) and g:  # degenerate gt (zero or negative area): the dense path
        k = int(rng.integers(0, g))
        gb[k, 2] = gb[k, 0] - float(rng.choice([1.0, 1.5]))
    two = np.flatnonzero(ng >= 2)
    gb[gt_off[two] + 1] = gb[gt_off[two]]  # identical gt boxes: IoU ties
    gb = gb.astype(np.float32)
    classes = rng.integers(1, 9, g).astype(np.int32)
    crowd = rng.random(g) < 0.25
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    recs = []
    for i in range(n):
        p = int(rng.integers(0, 40))
        w, h = float(widths[i]), float(heights[i])
        b = np.empty((p, 4))
        b[:, 0] = rng.uniform(-0.1, 1.0, p) * w
        b[:, 1] = rng.uniform(-0.1, 1.0, p) * h
        b[:, 2] = b[:, 0] + rng.uniform(-0.05, 0.6, p) * w
        b[:, 3] = b[:, 1] + rng.uniform(-0.05, 0.6, p) * h
        rows = np.arange(gt_off[i], gt_off[i + 1])
        if rows.size and p:  # boxes whose edges sit next to a gt edge
            k = rng.integers(0, p, p // 2)
            gr = gb[rng.choice(rows, k.size)].astype(np.float64)
            side = rng.integers(0, 4, k.size)
            d = rng.choice(EDGE, k.size)
            b[k] = gr + rng.choice([0.0, 3.0, 17.0], (k.size, 4)) * [-1, -1, 1, 1]
            xs = side == 0  # proposal right of the gt: x1 = gt x2 + 1 + d
            b[k[xs], 0] = gr[xs, 2] - d[xs]
            b[k[side == 1], 2] = gr[side == 1, 0] + d[side == 1]  # left of it
            b[k[side == 2], 1] = gr[side == 2, 3] - d[side == 2]  # below
            b[k[side == 3], 3] = gr[side == 3, 1] + d[side == 3]  # above
            b[k] = np.where(np.isfinite(b[k]), b[k], 0)
        if p > 3 and rng.random() < 0.3:
            b[1:3] = b[0]  # duplicates
        recs.append(b.astype(dtype))
    order = rng.permutation(n)
    rec = [recs[j] for j in order]
    counts = np.array([r.shape[0] for r in rec], np.int64)
    off = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=off[1:])
    flat = np.concatenate(rec) if counts.sum() else None
    src = ProposalSource("mem.pkl", ids[order], counts, lambda k: rec[k], flat=flat,
                         flat_off=off if flat is not None else None)
    gt = dict(image_ids=ids, widths=widths, heights=heights, gt_off=gt_off, gt_boxes=gb,
              gt_classes=classes, gt_is_crowd=crowd)
    return src, gt


def _build(mod, src, gt, chunk, block, **kw):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mod, "_CHUNK_BOXES", chunk)
        mp.setattr(mod, "_IOU_BLOCK", block)
        return mod.build_proposal_table(src, **gt, **kw)


@SET
@given(data=tables(), min_size=st.sampled_from([2, 0, -3]), limit=st.sampled_from([-1, 5]),
       crowd=st.sampled_from([0.0, 0.7, 0.2]), chunk=st.sampled_from([1, 30, 2_000_000]),
       block=st.sampled_from([1, 40, 1 << 16]))
def test_table_equals_previous_implementation(data, min_size, limit, crowd, chunk, block):
    src, gt = data
    kw = dict(min_proposal_size=min_size, proposal_limit=limit, crowd_filter_thresh=crowd)
    new = _build(P, src, gt, chunk, block, **kw)
    old = _build(OLD, src, gt, 2_000_000, 1 << 15, **kw)
    for f in ("off", "boxes", "max_overlaps", "max_classes", "gt_map"):
        x, y = getattr(new, f), getattr(old, f)
        assert x.dtype == y.dtype, f
        np.testing.assert_array_equal(x, y, err_msg=f)
        assert x.tobytes() == y.tobytes(), f  # bit-identical (signed zeros included)
    assert dict(new.counts) == dict(old.counts)


@SET
@given(data=tables(), block=st.sampled_from([1, 7, 1 << 16]))
def test_merge_equals_previous_merge(data, block):
    """The filtered merge alone, on positive-area proposals (its fast path)."""
    src, gt = data
    boxes = [np.asarray(src.boxes_of(k), np.float32) for k in np.argsort(src.ids)]
    b = np.concatenate(boxes) if boxes else np.zeros((0, 4), np.float32)
    b[:, 2:] = np.maximum(b[:, 2:], b[:, :2])
    img = np.repeat(np.arange(len(boxes)), [len(x) for x in boxes])
    args = (b, img, gt["gt_off"], gt["gt_boxes"], gt["gt_classes"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(P, "_IOU_BLOCK", block)
        new = P._merge(*args)
    for x, y in zip(new, OLD._merge(*args)):
        assert x.tobytes() == y.tobytes()


def test_touching_boxes_by_hand():
    """A proposal one pixel right of a gt box does not overlap it (iw = 0); half a pixel
    closer it does: iw = 19 - 19.5 + 1 = 0.5, inter 5, union 105 + 100 - 5."""
    gt = np.array([[10, 10, 19, 19]], np.float32)
    b = np.array([[20, 10, 29, 19], [19.5, 10, 29, 19], [19, 10, 29, 19]], np.float32)
    args = (b, np.zeros(3, np.int64), np.array([0, 1]), gt, np.array([3], np.int32))
    mo, mc, gm = P._merge(*args)
    np.testing.assert_array_equal(mo, np.float32([0, 5 / 200, 10 / 200]))
    np.testing.assert_array_equal(gm, [-1, 0, 0])
    np.testing.assert_array_equal(mc, [0, 3, 3])


@settings(deadline=None, max_examples=150)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 3000),
       scale=st.sampled_from([3.0, 900.0, 5000.0, 2.0**40, 1e300]),
       groups=st.integers(1, 5))
def test_unique_keep_equals_previous(seed, n, scale, groups):
    """Detectron's box hash de-duplication (collisions of Detectron quirk Q13 included)
    against the previous implementation, with many repeated keys."""
    rng = np.random.default_rng(seed)
    b = (rng.random((n, 4)) * scale).astype(np.float64 if scale > 1e38 else np.float32)
    k = rng.integers(0, n, n // 2)
    b[k] = b[rng.integers(0, n, k.size)]  # exact repeats
    b[rng.integers(0, n, n // 4)] += 0.3  # equal after rounding, sometimes
    g = np.sort(rng.integers(0, groups, n))
    np.testing.assert_array_equal(P.unique_box_keep(b, g), OLD.unique_box_keep(b, g))
