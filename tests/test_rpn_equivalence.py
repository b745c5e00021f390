"""The RPN labelling (rectangles, tight IoU candidates, negatives by rank/select) against
main's implementation before the rewrite (``tests/oracle_rpn.py``), draw for draw.

Every output of ``label_anchors`` and of ``add_rpn_blobs`` (wide and compact) must be
bit-identical, and the generator must be left in the same state, on many random scenes:
real-size FPN fields and tiny single-level ones, boxes on the image border, degenerate
and huge boxes, flipped entries, crowd boxes, both generator kinds, both quirk modes,
straddle margins (none, 0, positive) and unusual thresholds.
"""

from __future__ import annotations

import numpy as np
import oracle_anchors
import oracle_rpn
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_roidata.boxes import bbox_overlaps
from lit_roidata.config import get_cfg
from lit_roidata.minibatch import rpn
from lit_roidata.minibatch.anchors import (
    concat_fields, inside_anchors, inside_mask, rpn_fields, rpn_overlaps)


def _cfg(kind: str, max_size: int):
    cfg = get_cfg()
    if kind == "fpn":
        cfg.merge_from_dict({"MODEL.FASTER_RCNN": True, "FPN.FPN_ON": True,
                             "FPN.MULTILEVEL_RPN": True, "FPN.COARSEST_STRIDE": 32,
                             "TRAIN.MAX_SIZE": max_size})
    else:  # single level, several sizes and ratios (A = 9), or one non-integer size
        sizes = (16, 32, 64) if kind == "c4" else (22.6,)
        ratios = (0.5, 1, 2) if kind == "c4" else (0.7,)
        cfg.merge_from_dict({"MODEL.FASTER_RCNN": True, "RPN.STRIDE": 16, "RPN.SIZES": sizes,
                             "RPN.ASPECT_RATIOS": ratios, "TRAIN.MAX_SIZE": max_size})
    return cfg


@st.composite
def _boxes(draw, w: int, h: int):
    g = draw(st.integers(1, 12))
    out = []
    for _ in range(g):
        kind = draw(st.sampled_from(["any", "any", "border", "tiny", "huge", "degenerate"]))
        if kind == "huge":
            out.append([0, 0, w - 1, h - 1])
            continue
        x1 = draw(st.floats(0, w - 1, allow_nan=False))
        y1 = draw(st.floats(0, h - 1, allow_nan=False))
        if kind == "tiny":
            out.append([x1, y1, x1 + draw(st.sampled_from([0.0, 0.5, 1.0])), y1])
        elif kind == "degenerate":  # width or height <= 0 in the +1 convention
            out.append([x1, y1, x1 - draw(st.sampled_from([1.0, 2.5])), y1 + 3])
        elif kind == "border":
            out.append([draw(st.sampled_from([0.0, x1])), draw(st.sampled_from([0.0, y1])),
                        w - 1, draw(st.sampled_from([h - 1, min(y1 + 40, h - 1)]))])
        else:
            out.append([x1, y1, draw(st.floats(x1, w - 1)), draw(st.floats(y1, h - 1))])
    return np.asarray(out, np.float32).reshape(-1, 4)


@st.composite
def _scenes(draw):
    kind = draw(st.sampled_from(["fpn", "fpn", "c4", "odd"]))
    max_size = draw(st.sampled_from([64, 200, 1333] if kind == "fpn" else [64, 200, 600]))
    w = draw(st.integers(8, max_size))
    h = draw(st.integers(8, max_size))
    gt = draw(_boxes(w, h))
    if draw(st.booleans()):  # a flipped entry's boxes
        gt = np.stack([w - 1 - gt[:, 2], gt[:, 1], w - 1 - gt[:, 0], gt[:, 3]], 1)
    return dict(kind=kind, max_size=max_size, w=w, h=h, gt=gt,
                straddle=draw(st.sampled_from([0, -1, 8, 0.5])),
                batch=draw(st.sampled_from([4, 64, 256, 512])),
                pos=draw(st.sampled_from([0.7, 0.7, 0.5, 0.3, 0.9999])),
                neg=draw(st.sampled_from([0.3, 0.3, 0.1, 0.5, 0.7])),
                fix=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
                legacy=draw(st.booleans()))


def _train(sc):
    cfg = _cfg(sc["kind"], sc["max_size"])
    cfg.merge_from_dict({"TRAIN.RPN_STRADDLE_THRESH": sc["straddle"],
                         "TRAIN.RPN_BATCH_SIZE_PER_IM": sc["batch"],
                         "TRAIN.RPN_POSITIVE_OVERLAP": sc["pos"],
                         "TRAIN.RPN_NEGATIVE_OVERLAP": sc["neg"]})
    return cfg


def _rng(sc):
    return (np.random.RandomState(sc["seed"]) if sc["legacy"]
            else np.random.default_rng(sc["seed"]))


@settings(deadline=None, max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(_scenes())
def test_label_anchors_matches_main(sc):
    cfg = _train(sc)
    fields = rpn_fields(cfg)
    anchors = concat_fields(fields)
    r_new, r_old = _rng(sc), _rng(sc)
    args = (anchors, fields, sc["gt"], float(sc["h"]), float(sc["w"]), cfg.TRAIN)
    new = rpn.label_anchors(*args, r_new, fix_rpn_quirks=sc["fix"])
    old = oracle_rpn.label_anchors(*args, r_old, fix_rpn_quirks=sc["fix"])
    for a, b in zip(new, old):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    assert r_new.random() == r_old.random()  # the same draws were made


@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("legacy", [False, True])
def test_add_rpn_blobs_matches_main_on_a_batch(compact, legacy):
    cfg = _cfg("fpn", 1333)
    r = np.random.RandomState(3)
    entries = []
    for i in range(4):
        w, h = int(r.randint(300, 1000)), int(r.randint(300, 1000))
        xy = r.uniform(0, [w - 2, h - 2], (6, 2))
        boxes = np.concatenate([xy, np.minimum(xy + r.uniform(1, 400, (6, 2)), [w - 1, h - 1])],
                               1).astype(np.float32)
        entries.append({"id": i, "image": f"/x/{i}.jpg", "width": w, "height": h,
                        "boxes": boxes, "gt_classes": np.ones(6, np.int32),
                        "is_crowd": np.arange(6) == 5, "flipped": bool(i % 2)})
    scales = [800 / min(e["width"], e["height"]) for e in entries]
    mk = np.random.RandomState if legacy else np.random.default_rng
    new: dict = {}
    old: dict = {}
    rpn.add_rpn_blobs(new, scales, entries, cfg, mk(9), compact=compact)
    oracle_rpn.add_rpn_blobs(old, scales, entries, cfg, mk(9), compact=compact)
    assert list(new) == list(old)
    for k in new:
        assert new[k].dtype == old[k].dtype
        np.testing.assert_array_equal(new[k], old[k], err_msg=k)


@settings(deadline=None, max_examples=120)
@given(_scenes(), st.data())
def test_inside_rectangles_rank_and_select(sc, data):
    cfg = _train(sc)
    fields = rpn_fields(cfg)
    t = float(sc["straddle"])
    mask = inside_mask(fields, float(sc["h"]), float(sc["w"]), t)
    ins = inside_anchors(fields, float(sc["h"]), float(sc["w"]), t)
    listed = np.flatnonzero(mask)
    assert ins.count == len(listed)
    if not len(listed):
        return
    pos = np.asarray(data.draw(st.lists(st.integers(0, len(listed) - 1), min_size=1,
                                        max_size=50)), np.int64)
    pos = np.concatenate([pos, [0, len(listed) - 1]])
    np.testing.assert_array_equal(ins.select(pos), listed[pos])
    np.testing.assert_array_equal(ins.rank(listed[pos]), pos)


@settings(deadline=None, max_examples=80)
@given(_scenes())
def test_rpn_overlaps_keeps_every_entry_that_matters(sc):
    """Against the old candidate set: the same IoU wherever it reaches ``below`` or is a
    gt's best, and the same best IoU per gt."""
    cfg = _train(sc)
    fields = rpn_fields(cfg)
    anchors = concat_fields(fields)
    h, w, t = float(sc["h"]), float(sc["w"]), float(sc["straddle"])
    below = min(sc["pos"], sc["neg"])
    mask = inside_mask(fields, h, w, t)
    c_old, o_old = oracle_anchors.anchor_gt_overlaps(fields, anchors, mask, sc["gt"], below)
    c_new, o_new = rpn_overlaps(fields, anchors, inside_anchors(fields, h, w, t), sc["gt"], below)
    assert mask[c_new].all()
    if len(c_old):
        np.testing.assert_array_equal(o_new.max(axis=0, initial=0), o_old.max(axis=0))
    dense_old = dict(zip(c_old.tolist(), o_old))
    dense_new = dict(zip(c_new.tolist(), o_new))
    g2a = o_old.max(axis=0) if len(c_old) else np.zeros(len(sc["gt"]), np.float32)
    for i, row in dense_old.items():
        keep = (row >= np.float32(below)) | ((row == g2a) & (g2a > 0))
        if keep.any():
            np.testing.assert_array_equal(dense_new[i][keep], row[keep])
    if len(c_new):  # every computed entry is the dense matrix's
        nz = o_new > 0
        np.testing.assert_array_equal(o_new[nz], bbox_overlaps(anchors[c_new], sc["gt"])[nz])
