"""Fast R-CNN from proposals: the faster sampling / RoI blob / FPN code gives the same
blobs bit for bit as the previous implementation (``tests/oracles/minibatch.py``).

Whole minibatches are compared on random labelled entries (no proposals, no gt,
crowd-only, all-fg, all-bg thresholds, masks, keypoints), on a real columnar roidb
(flipped entries, proposal files), in both RNG kinds and both ``mask_format``s.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oracles import minibatch as oracle
from lit_roidata.config import get_cfg
from lit_roidata.minibatch import fast_rcnn, fpn, keypoints, mask
from lit_roidata.minibatch.fast_rcnn import add_fast_rcnn_blobs, fg_rois_per_image
from lit_roidata.minibatch.fpn import add_multilevel_roi_blobs, rois_blob
from lit_roidata.roidb import combined_roidb_for_training
from roidb_fixtures import make_coco, make_proposals, write_dataset
from test_minibatch_helpers import make_entry, small_cfg


def _same_bits(a, b) -> bool:
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 0
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@contextlib.contextmanager
def previous_implementation(monkeypatch):
    """The module functions replaced by their previous versions."""
    with monkeypatch.context() as mp:
        mp.setattr(fast_rcnn, "sample_rois", oracle.sample_rois)
        mp.setattr(fast_rcnn, "rois_blob", oracle.rois_blob)
        mp.setattr(mask, "rois_blob", oracle.rois_blob)
        mp.setattr(keypoints, "rois_blob", oracle.rois_blob)
        mp.setattr(fpn, "add_multilevel_roi_blobs", oracle.add_multilevel_roi_blobs)
        yield


def _compare(monkeypatch, entries, scales, cfg, make_rng, compact):
    new: dict = {}
    old: dict = {}
    rng_new, rng_old = make_rng(), make_rng()
    v_new = add_fast_rcnn_blobs(new, scales, entries, cfg, rng_new, compact_masks=compact)
    with previous_implementation(monkeypatch):
        v_old = add_fast_rcnn_blobs(old, scales, entries, cfg, rng_old, compact_masks=compact)
    assert v_new == v_old
    assert list(new) == list(old)
    for name in new:
        assert _same_bits(new[name], old[name]), name
    # the generators drew the same numbers: their next draws agree
    if isinstance(rng_new, np.random.RandomState):
        assert rng_new.randint(1 << 30) == rng_old.randint(1 << 30)
    else:
        assert rng_new.integers(1 << 30) == rng_old.integers(1 << 30)


def test_rois_blob_equals_previous():
    r = np.random.default_rng(0)
    for dtype in (np.float32, np.float64, np.int64, np.int32):
        for n in (0, 1, 7):
            boxes = (r.uniform(-3, 2**25, (n, 4)) if dtype in (np.float32, np.float64)
                     else r.integers(-3, 2**26, (n, 4))).astype(dtype)
            for b in (0, 3, np.int64(2), 1.0):
                assert _same_bits(rois_blob(boxes, b), oracle.rois_blob(boxes, b))
    strided = r.uniform(0, 100, (9, 8)).astype(np.float32)[::2, ::2]
    assert _same_bits(rois_blob(strided, 1), oracle.rois_blob(strided, 1))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 200), st.integers(0, 6), st.integers(-1, 4),
       st.sampled_from(["levels", "nan", "outside", "fractional", "float32", "int"]))
def test_multilevel_roi_blobs_equal_previous(seed, n, lo, span, kind):
    r = np.random.default_rng(seed)
    hi = lo + span
    lvls = r.integers(lo - 1 if kind == "outside" else lo, hi + 2 if kind == "outside"
                      else max(hi, lo) + 1, n).astype(np.float64)
    if kind == "nan" and n:
        lvls[r.random(n) < 0.2] = np.nan
    if kind == "fractional" and n:
        lvls[r.random(n) < 0.2] += 0.5
    if kind == "float32":
        lvls = lvls.astype(np.float32)
    if kind == "int":
        lvls = lvls.astype(np.int64)
    rois = r.uniform(0, 500, (n, 5)).astype(np.float32)
    new: dict = {}
    old: dict = {}
    add_multilevel_roi_blobs(new, "rois", rois, lvls, lo, hi)
    oracle.add_multilevel_roi_blobs(old, "rois", rois, lvls, lo, hi)
    assert list(new) == list(old)
    for k in new:
        assert _same_bits(new[k], old[k]), k


def test_fg_quota_equals_previous():
    for per_im in (1, 2, 3, 4, 5, 6, 7, 8, 16, 64, 128, 512):
        for frac in (0.0, 0.1, 0.125, 0.25, 1 / 3, 0.375, 0.5, 0.625, 0.75, 0.9, 1.0):
            cfg = small_cfg(**{"TRAIN.BATCH_SIZE_PER_IM": per_im, "TRAIN.FG_FRACTION": frac})
            assert fg_rois_per_image(cfg) == oracle.fg_rois_per_image(cfg)


# monkeypatch is entered and left inside each example (previous_implementation)
@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.sampled_from([4, 16, 64]),
       st.sampled_from(["default", "all_fg", "all_bg", "bg_lo", "no_bg"]),
       st.sampled_from(["none", "mask", "keypoints"]), st.booleans(), st.booleans(),
       st.booleans(), st.booleans(), st.booleans())
def test_minibatch_equals_previous_on_random_entries(monkeypatch, seed, n_images, per_im,
                                                     thresholds, heads, fpn_on, cls_agnostic,
                                                     use_rs, compact, flipped):
    r = np.random.default_rng(seed)
    over = {"TRAIN.BATCH_SIZE_PER_IM": per_im, "MODEL.CLS_AGNOSTIC_BBOX_REG": cls_agnostic,
            "FPN.FPN_ON": fpn_on, "FPN.MULTILEVEL_ROIS": fpn_on,
            "MODEL.MASK_ON": heads == "mask", "MODEL.KEYPOINTS_ON": heads == "keypoints"}
    if heads == "keypoints":
        over.update({"KRCNN.NUM_KEYPOINTS": 3, "KRCNN.HEATMAP_SIZE": 8})
    over.update({"all_fg": {"TRAIN.FG_THRESH": 0.0},
                 "all_bg": {"TRAIN.FG_THRESH": 1.5},
                 "bg_lo": {"TRAIN.BG_THRESH_LO": 0.1, "TRAIN.BG_THRESH_HI": 0.6},
                 "no_bg": {"TRAIN.BG_THRESH_HI": 0.0}}.get(thresholds, {}))
    cfg = small_cfg(**over)
    entries = []
    for i in range(n_images):
        kind = r.integers(0, 4)  # 0: no gt, 1: no proposals, 2: crowd-only gt, 3: mixed
        e = make_entry(r, num_gt=0 if kind == 0 else int(r.integers(1, 4)),
                       num_props=0 if kind == 1 else int(r.integers(0, 80)),
                       crowd=kind in (2, 3) and bool(r.integers(2)), image_id=i,
                       keypoints=3 if heads == "keypoints" else 0, flipped=flipped)
        if kind == 2:  # every gt crowd
            e["is_crowd"][:int((e["gt_classes"] > 0).sum())] = True
        entries.append(e)
    if cls_agnostic:
        for e in entries:
            e["bbox_targets"][:, 0] = (e["bbox_targets"][:, 0] > 0)
    scales = [float(s) for s in r.uniform(0.5, 2.0, n_images)]

    def make_rng():
        return np.random.RandomState(seed) if use_rs else np.random.default_rng(seed)

    _compare(monkeypatch, entries, scales, cfg, make_rng, compact)


def _roidb(tmp, seed, per_image):
    cfg = get_cfg()
    cfg.merge_from_dict({"TRAIN.USE_FLIPPED": True, "MODEL.NUM_CLASSES": 4})
    data = make_coco(seed, n_images=8)
    catalog = write_dataset(str(tmp), "d", data)
    props = make_proposals(seed, data, str(tmp / "p.pkl"), per_image=per_image)
    return combined_roidb_for_training(["d"], [props], cfg, str(tmp / "cache"),
                                       catalog=catalog, trust_pickle=True, progress=False)


@pytest.mark.parametrize("rng_kind", ["block", "detectron"])
@pytest.mark.parametrize("mask_on,compact", [(False, False), (True, False), (True, True)])
def test_minibatch_equals_previous_on_columnar_roidb(tmp_path, monkeypatch, rng_kind, mask_on,
                                                     compact):
    db = _roidb(tmp_path, 5, per_image=200)
    cfg = get_cfg()
    cfg.merge_from_dict({"MODEL.NUM_CLASSES": 4, "MODEL.MASK_ON": mask_on, "FPN.FPN_ON": True,
                         "FPN.MULTILEVEL_ROIS": True})
    assert any(db[i]["flipped"] for i in range(len(db)))
    for k in range(0, len(db) - 1, 2):
        def make_rng():
            return (np.random.RandomState(k) if rng_kind == "detectron"
                    else np.random.default_rng(k))

        _compare(monkeypatch, [db[k], db[k + 1]], [0.75, 1.6], cfg, make_rng, compact)
