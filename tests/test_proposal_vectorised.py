"""The vectorised proposal rules (whole chunks of images at once) against a per-image
oracle written as Detectron does it, image by image, on random inputs with empty
images, zero proposals, all-duplicate proposals, crowd boxes, degenerate boxes and
boxes exactly on the image boundary."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.boxes import bbox_overlaps
from lit_roidata.roidb import proposals as P
from lit_roidata.roidb.proposal_files import ProposalSource

SET = settings(deadline=None, max_examples=60)


@st.composite
def datasets(draw):
    """A gt table and a proposal source with one record per image (shuffled order)."""
    n = draw(st.integers(1, 7))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = np.sort(rng.choice(np.arange(1, 40), n, replace=False)).astype(np.int64)
    widths = rng.integers(1, 60, n)
    heights = rng.integers(1, 60, n)
    ng = rng.integers(0, 5, n)
    gt_off = np.zeros(n + 1, np.int64)
    np.cumsum(ng, out=gt_off[1:])
    g = int(gt_off[-1])
    img_of_gt = np.repeat(np.arange(n), ng)
    gb = np.empty((g, 4), np.float32)
    gb[:, 0] = rng.uniform(0, 1, g) * (widths[img_of_gt] - 1)
    gb[:, 1] = rng.uniform(0, 1, g) * (heights[img_of_gt] - 1)
    gb[:, 2] = np.minimum(widths[img_of_gt] - 1, gb[:, 0] + rng.integers(0, 30, g))
    gb[:, 3] = np.minimum(heights[img_of_gt] - 1, gb[:, 1] + rng.integers(0, 30, g))
    if draw(st.booleans()):  # repeated gt boxes in an image: IoU ties, argmax keeps the first
        two = np.flatnonzero(ng >= 2)
        gb[gt_off[two] + 1] = gb[gt_off[two]]
    classes = rng.integers(1, 6, g).astype(np.int32)
    crowd = rng.random(g) < 0.3
    kind = draw(st.sampled_from(["random", "duplicates", "boundary", "integer", "wide"]))
    boxes = []
    for i in range(n):
        p = int(rng.integers(0, 25)) if draw(st.booleans()) else 0
        b = rng.uniform(-15, 75, (p, 4))
        b[:, 2:] = b[:, :2] + rng.uniform(-3, 40, (p, 2))  # some degenerate (x2 < x1)
        if kind == "duplicates" and p:
            b[:] = b[0]  # all duplicates
        elif kind == "boundary" and p:
            b[::2, 0], b[::2, 2] = 0.0, widths[i] - 1.0  # exactly on the boundary
            b[1::3, 1], b[1::3, 3] = 0.0, heights[i] - 1.0
        elif kind == "integer":
            b = np.round(b)
            if p > 1:
                b[1::2] = b[0::2][:b[1::2].shape[0]] + 0.3  # equal after rounding
        elif kind == "wide" and p:
            b[:, [0, 2]] = np.sort(b[:, [0, 2]], 1)
            b[:, [1, 3]] = np.sort(b[:, [1, 3]], 1)
        boxes.append(b.astype(draw(st.sampled_from([np.float32, np.float64]))
                              if i == 0 else np.float32))
    order = rng.permutation(n)
    rec = [boxes[j] for j in order]
    dt = rec[0].dtype if all(r.dtype == rec[0].dtype for r in rec) else None
    counts = np.array([r.shape[0] for r in rec], np.int64)
    flat = np.concatenate(rec).astype(dt) if dt is not None and counts.sum() else None
    off = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=off[1:])
    src = ProposalSource("mem.pkl", ids[order], counts, lambda k: rec[k],
                         flat=flat, flat_off=off if flat is not None else None)
    gt = dict(image_ids=ids, widths=widths, heights=heights, gt_off=gt_off, gt_boxes=gb,
              gt_classes=classes, gt_is_crowd=crowd)
    return src, gt, boxes


def _oracle(boxes_per_img, gt, min_size, limit, crowd_thresh):
    """Detectron's per-image code (roidb proposal merge + crowd filter)."""
    from pycocotools import mask as mask_util

    outs = []
    for i, b in enumerate(boxes_per_img):
        b = np.array(b, copy=True)
        w1, h1 = gt["widths"][i] - 1, gt["heights"][i] - 1
        b[:, [0, 2]] = np.minimum(np.asarray(w1, b.dtype), np.maximum(0, b[:, [0, 2]]))
        b[:, [1, 3]] = np.minimum(np.asarray(h1, b.dtype), np.maximum(0, b[:, [1, 3]]))
        hashes = np.round(b).dot(np.array([1, 1e3, 1e6, 1e9]))
        _, first = np.unique(hashes, return_index=True)
        b = b[np.sort(first)]
        w = b[:, 2] - b[:, 0] + 1
        h = b[:, 3] - b[:, 1] + 1
        b = b[(w > min_size) & (h > min_size)]
        if limit > 0:
            b = b[:limit]
        b = b.astype(np.float32)
        rows = np.arange(gt["gt_off"][i], gt["gt_off"][i + 1])
        mo = np.zeros(len(b), np.float32)
        mc = np.zeros(len(b), np.int32)
        gm = np.full(len(b), -1, np.int32)
        if rows.size and len(b):
            ov = bbox_overlaps(b, gt["gt_boxes"][rows])
            arg = ov.argmax(axis=1)
            best = ov.max(axis=1)
            pos = best > 0
            mo[pos], gm[pos] = best[pos], arg[pos]
            mc[pos] = gt["gt_classes"][rows][arg[pos]]
        crows = rows[gt["gt_is_crowd"][rows]]
        if crowd_thresh > 0 and crows.size and len(b):
            def xywh(x):
                return np.hstack((x[:, 0:2], x[:, 2:4] - x[:, 0:2] + 1)).astype(np.float32)
            iou = mask_util.iou(xywh(b).astype(np.float64),
                                xywh(gt["gt_boxes"][crows]).astype(np.float64),
                                [1] * crows.size)
            bad = iou.max(axis=1) > crowd_thresh
            mo[bad], mc[bad] = -1.0, 0
        outs.append((b, mo, mc, gm))
    return outs


@SET
@given(data=datasets(), min_size=st.sampled_from([2, 0, -2]), limit=st.sampled_from([-1, 3]),
       crowd=st.sampled_from([0.0, 0.7]), chunk=st.sampled_from([1, 7, 2_000_000]),
       block=st.sampled_from([1, 5, 1 << 15]))
def test_vectorised_table_equals_per_image_oracle(data, min_size, limit, crowd,
                                                  chunk, block):
    src, gt, boxes = data
    with pytest.MonkeyPatch.context() as mp:  # reset after each example
        mp.setattr(P, "_CHUNK_BOXES", chunk)
        mp.setattr(P, "_IOU_BLOCK", block)
        t = P.build_proposal_table(src, **gt, min_proposal_size=min_size, proposal_limit=limit,
                                   crowd_filter_thresh=crowd)
    ref = _oracle(boxes, gt, min_size, limit, crowd)
    for i, (b, mo, mc, gm) in enumerate(ref):
        s = slice(t.off[i], t.off[i + 1])
        np.testing.assert_array_equal(t.boxes[s], b, err_msg=f"boxes of image {i}")
        np.testing.assert_array_equal(t.max_overlaps[s], mo, err_msg=f"max_overlaps {i}")
        np.testing.assert_array_equal(t.max_classes[s], mc, err_msg=f"max_classes {i}")
        np.testing.assert_array_equal(t.gt_map[s], gm, err_msg=f"gt_map {i}")
    assert t.counts["proposals_kept"] == sum(len(r[0]) for r in ref)
    assert isinstance(t.counts, Counter)


@SET
@given(data=datasets(), block=st.sampled_from([1, 3, 1 << 15]))
def test_slot_merge_equals_argmax_blocks(data, block):
    """The running-maximum merge equals the (images, P, G) block + argmax merge."""
    src, gt, boxes = data
    b = np.concatenate([np.asarray(x, np.float32) for x in boxes])
    b[:, 2:] = np.maximum(b[:, 2:], b[:, :2])  # positive areas: the fast path
    img = np.repeat(np.arange(len(boxes)), [len(x) for x in boxes])
    args = (b, img, gt["gt_off"], gt["gt_boxes"], gt["gt_classes"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(P, "_IOU_BLOCK", block)
        fast = P._merge(*args)
    for x, y in zip(fast, P._merge_blocks(*args)):
        np.testing.assert_array_equal(x, y)
