"""RetinaNet targets (Detectron semantics: RetinaNet targets; tested invariants): hand-checked
counts, and equality with a
literal dense port of Detectron's ``add_retinanet_blobs``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.boxes import bbox_overlaps, bbox_transform_targets
from lit_roidata.config import get_cfg
from lit_roidata.minibatch import retinanet
from lit_roidata.minibatch.anchors import concat_fields, retinanet_fields
from lit_roidata.minibatch.device import expand_targets


def _entry(boxes, classes, crowd=None, width=64, height=64):
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    n = len(boxes)
    return {"id": 5, "image": "/x/5.jpg", "width": width, "height": height, "boxes": boxes,
            "gt_classes": np.asarray(classes, np.int32),
            "is_crowd": np.asarray(crowd if crowd is not None else [False] * n, bool)}


def _cfg(levels=(3, 4), spo=1, ratios=(1.0,), coarsest=16, max_size=64, classes=5,
         class_specific=False):
    cfg = get_cfg()
    cfg.merge_from_dict({"RETINANET.RETINANET_ON": True, "FPN.FPN_ON": True,
                         "FPN.RPN_MIN_LEVEL": levels[0], "FPN.RPN_MAX_LEVEL": levels[1],
                         "FPN.COARSEST_STRIDE": coarsest, "TRAIN.MAX_SIZE": max_size,
                         "RETINANET.SCALES_PER_OCTAVE": spo, "RETINANET.ASPECT_RATIOS": ratios,
                         "MODEL.NUM_CLASSES": classes,
                         "RETINANET.CLASS_SPECIFIC_BBOX": class_specific})
    return cfg


def _data(n, h, w):
    return np.zeros((n, 3, h, w), np.float32)


def test_hand_checked_counts_and_locs():
    # Level 3: one 32x32 anchor per 8-px cell, [-12,-12,19,19] + 8k. The gt equals the
    # anchor of cell (y=2, x=2); its 4 neighbours have IoU 768/1280 = 0.6 >= 0.5, the
    # diagonal ones 576/1472 < 0.4 (negative); level-4 anchors (64 px) reach 0.25 at most.
    cfg = _cfg(classes=5, class_specific=True)
    blobs = {"data": _data(1, 64, 64)}
    gt = [[4, 4, 35, 35]]
    assert retinanet.add_retinanet_blobs(blobs, [1.0], [_entry(gt, [3])], cfg)
    assert list(blobs)[1:4] == ["im_info", "retnet_fg_num", "retnet_bg_num"]
    cls3, cls4 = blobs["retnet_cls_labels_fpn3"], blobs["retnet_cls_labels_fpn4"]
    assert cls3.shape == (1, 1, 8, 8) and cls4.shape == (1, 1, 4, 4) and cls3.dtype == np.int32
    pos = [(1, 2), (2, 1), (2, 2), (2, 3), (3, 2)]
    assert (cls3 == 3).sum() == 5 and all(cls3[0, 0, y, x] == 3 for y, x in pos)
    assert (cls4 > 0).sum() == 0
    anchors = concat_fields(retinanet_fields(cfg))
    iou = bbox_overlaps(anchors, np.array(gt, np.float32))[:, 0]
    num_bg = int((iou < 0.4).sum())
    assert (cls3 == 0).sum() + (cls4 == 0).sum() == num_bg
    assert blobs["retnet_fg_num"].tolist() == [6.0]  # 5 positives + 1
    assert blobs["retnet_bg_num"].tolist() == [(num_bg + 1) * 4 + 6 * 3]
    # class-specific: column 1 = 4 * (class - 1) + loc_stride * anchor_ind (0 here)
    np.testing.assert_array_equal(blobs["retnet_roi_fg_bbox_locs_fpn3"],
                                  [[0, 8, y, x] for y, x in pos])
    np.testing.assert_allclose(blobs["retnet_roi_bbox_targets_fpn3"],
                               [[0, .25, 0, 0], [.25, 0, 0, 0], [0, 0, 0, 0], [-.25, 0, 0, 0],
                                [0, -.25, 0, 0]], atol=1e-7)
    assert blobs["retnet_roi_fg_bbox_locs_fpn4"].shape == (0, 4)
    np.testing.assert_array_equal(blobs["im_info"], [[64, 64, 1]])


def test_channel_offsets_two_images_class_agnostic():
    # 2 octaves x 2 aspects: anchor_ind = octave * 2 + aspect; loc_stride 4 (agnostic).
    cfg = _cfg(levels=(3, 3), spo=2, ratios=(1.0, 2.0), coarsest=8, max_size=64)
    gts = [[4, 4, 35, 35], [10, 3, 40, 50]]
    entries = [_entry(gts, [1, 2]), _entry(gts[::-1], [2, 1])]
    blobs = {"data": _data(2, 64, 64)}
    retinanet.add_retinanet_blobs(blobs, [1.0, 1.0], entries, cfg)
    locs = blobs["retnet_roi_fg_bbox_locs_fpn3"]
    cls = blobs["retnet_cls_labels_fpn3"]
    assert cls.shape == (2, 4, 8, 8)
    assert len(locs) == (cls > 0).sum() == len(blobs["retnet_roi_bbox_targets_fpn3"])
    for img, ch, y, x in locs.astype(int):
        a = ch // 4
        assert ch % 4 == 0 and 0 <= a < 4 and cls[img, a, y, x] > 0
    assert (np.diff(locs[:, 0]) >= 0).all()  # image-major


def test_requires_fpn_and_gt():
    cfg = _cfg()
    cfg.FPN.FPN_ON = False
    with pytest.raises(ValueError, match="FPN.FPN_ON"):
        retinanet.add_retinanet_blobs({"data": _data(1, 64, 64)}, [1.0],
                                      [_entry([[0, 0, 9, 9]], [1])], cfg)
    with pytest.raises(ValueError, match="no non-crowd gt"):
        retinanet.add_retinanet_blobs({"data": _data(1, 64, 64)}, [1.0],
                                      [_entry([[0, 0, 9, 9]], [1], crowd=[True])], _cfg())


def test_class_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="NUM_CLASSES"):
        retinanet.add_retinanet_blobs({"data": _data(1, 64, 64)}, [1.0],
                                      [_entry([[4, 4, 35, 35]], [7])],
                                      _cfg(classes=5, class_specific=True))


# --- literal dense port of Detectron's retinanet.py -----------------------------------

def _detectron_retinanet(cfg, entries, im_scales, pad_w, pad_h):
    foas = retinanet_fields(cfg)
    all_anchors = concat_fields(foas)
    blobs = {"retnet_fg_num": 0.0, "retnet_bg_num": 0.0}
    lists: dict = {}
    C = cfg.MODEL.NUM_CLASSES
    for im_i, entry in enumerate(entries):
        scale = im_scales[im_i]
        gt_inds = np.where((entry["gt_classes"] > 0) & (entry["is_crowd"] == 0))[0]
        gt_boxes = (entry["boxes"][gt_inds, :] * scale).astype(np.float32)
        gt_classes = entry["gt_classes"][gt_inds]
        n = all_anchors.shape[0]
        labels = np.full(n, -1, np.float32)
        o = bbox_overlaps(all_anchors, gt_boxes)
        a2g = o.argmax(axis=1)
        a2g_max = o[np.arange(n), a2g]
        g2a_max = o[o.argmax(axis=0), np.arange(o.shape[1])]
        best = np.where(o == g2a_max)[0]
        labels[best] = gt_classes[a2g[best]]
        inds = a2g_max >= cfg.RETINANET.POSITIVE_OVERLAP
        labels[inds] = gt_classes[a2g[inds]]
        fg = np.where(labels >= 1)[0]
        bg = np.where(a2g_max < cfg.RETINANET.NEGATIVE_OVERLAP)[0]
        labels[bg] = 0
        tg = np.zeros((n, 4), np.float32)
        tg[fg] = bbox_transform_targets(all_anchors[fg], gt_boxes[a2g[fg]], (1, 1, 1, 1))
        start = 0
        for foa in foas:
            F = foa.field_size
            end = start + F * F
            lab = labels[start:end].reshape(1, 1, F, F)
            t = tg[start:end].reshape(1, F, F, 4).transpose(0, 3, 1, 2)
            start = end
            w, h = int(pad_w / foa.stride), int(pad_h / foa.stride)
            _, _, y, x = np.where(lab > 0)
            rt = np.zeros((len(y), 4))
            rl = np.zeros((len(y), 4))
            for i in range(len(y)):
                lb = lab[0, 0, y[i], x[i]] - 1
                if not cfg.RETINANET.CLASS_SPECIFIC_BBOX:
                    lb = 0
                rt[i] = t[0, :, y[i], x[i]]
                rl[i] = [0, lb, y[i], x[i]]
            level = int(np.log2(foa.stride))
            rl[:, 0] = im_i
            loc_stride = 4 * ((C - 1) if cfg.RETINANET.CLASS_SPECIFIC_BBOX else 1)
            rl[:, 1] = rl[:, 1] * 4 + loc_stride * (
                foa.octave * len(cfg.RETINANET.ASPECT_RATIOS) + foa.aspect)
            for k, v in (("retnet_cls_labels", lab[:, :, 0:h, 0:w].astype(np.int32)),
                         ("retnet_roi_bbox_targets", rt.astype(np.float32)),
                         ("retnet_roi_fg_bbox_locs", rl.astype(np.float32))):
                lists.setdefault(f"{k}_fpn{level}", []).append(v)
        fg_num = np.array([len(fg) + 1.0], np.float32)
        blobs["retnet_fg_num"] += fg_num
        blobs["retnet_bg_num"] += np.array([len(bg) + 1.0]) * (C - 1) + fg_num * (C - 2)
    blobs["retnet_fg_num"] = blobs["retnet_fg_num"].astype(np.float32)
    blobs["retnet_bg_num"] = blobs["retnet_bg_num"].astype(np.float32)
    N = len(entries)
    for k, v in lists.items():
        A = len(v) // N
        if "cls_labels" in k:
            blobs[k] = np.concatenate([np.concatenate(v[i:i + A], 1) for i in range(0, len(v), A)])
        else:
            blobs[k] = np.concatenate(v)
    return blobs


@st.composite
def _scenes(draw):
    g = draw(st.integers(1, 5))
    w, h = draw(st.integers(20, 120)), draw(st.integers(20, 120))
    boxes, classes = [], []
    for _ in range(g):
        x1, y1 = draw(st.floats(0, w - 3)), draw(st.floats(0, h - 3))
        boxes.append([x1, y1, draw(st.floats(x1 + 1, w - 1)), draw(st.floats(y1 + 1, h - 1))])
        classes.append(draw(st.integers(1, 4)))
    crowd = [False] + draw(st.lists(st.booleans(), min_size=g - 1, max_size=g - 1))
    return (w, h, boxes, classes, crowd, draw(st.sampled_from([1.0, 1.5, 0.75])),
            draw(st.booleans()))


@settings(deadline=None, max_examples=40)
@given(_scenes())
def test_matches_detectron_and_invariants(scene):
    w, h, boxes, classes, crowd, scale, specific = scene
    cfg = _cfg(levels=(3, 5), spo=2, ratios=(1.0, 2.0, 0.5), coarsest=32, max_size=192,
               classes=5, class_specific=specific)
    entries = [_entry(boxes, classes, crowd, w, h),
               _entry(np.array(boxes)[::-1].copy(), classes[::-1], crowd[::-1], w, h)]
    pad = int(np.ceil(max(w, h) * scale / 32) * 32)
    blobs = {"data": _data(2, pad, pad)}
    retinanet.add_retinanet_blobs(blobs, [scale, scale], entries, cfg)
    ref = _detectron_retinanet(cfg, entries, [scale, scale], pad, pad)
    for k, v in ref.items():
        assert blobs[k].dtype == v.dtype, k
        np.testing.assert_array_equal(blobs[k], v, err_msg=k)
    # target_format="compact": sparse class labels, expanded on the device
    compact = {"data": _data(2, pad, pad)}
    retinanet.add_retinanet_blobs(compact, [scale, scale], entries, cfg, compact=True)
    expanded = expand_targets({k: torch.from_numpy(v) for k, v in compact.items()})
    assert list(expanded) == list(blobs)
    for k, v in ref.items():
        assert expanded[k].numpy().dtype == v.dtype, k
        np.testing.assert_array_equal(expanded[k].numpy(), v, err_msg=k)
    # Detectron semantics: tested invariants
    fg = 0
    for lvl in (3, 4, 5):
        cls = blobs[f"retnet_cls_labels_fpn{lvl}"]
        assert cls.shape == (2, 6, pad // 2 ** lvl, pad // 2 ** lvl)
        assert set(np.unique(cls)) <= {-1, 0, 1, 2, 3, 4}
        assert (len(blobs[f"retnet_roi_bbox_targets_fpn{lvl}"])
                == len(blobs[f"retnet_roi_fg_bbox_locs_fpn{lvl}"]))
    anchors = concat_fields(retinanet_fields(cfg))
    for e in entries:
        gt = (e["boxes"][~e["is_crowd"]] * scale).astype(np.float32)
        o = bbox_overlaps(anchors, gt)
        fg += ((o == o.max(0)).any(1) | (o.max(1) >= 0.5)).sum() + 1
    assert blobs["retnet_fg_num"][0] == fg
