"""Second-stage labels (lit_roidata.minibatch.second_stage; Detectron semantics: end-to-end
training): merge semantics vs a literal Detectron port, and the same blobs as the loader's
precomputed-proposal path for the same proposals and seed."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import scipy.sparse
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata import minibatch
from lit_roidata.boxes import bbox_overlaps
from lit_roidata.config import get_cfg
from lit_roidata.minibatch.fast_rcnn import add_fast_rcnn_blobs
from lit_roidata.minibatch.model_type import flags_for_model_type
from lit_roidata.minibatch.second_stage import (collect_top_proposals, merge_proposals,
                                                proposal_labels)
from lit_roidata.minibatch.roidb_blob import serialize_roidb
from lit_roidata.roidb.targets import compute_bbox_targets

C = 5  # NUM_CLASSES
K = 3  # keypoints


def _gt_entry(boxes, classes, crowd, width=120, height=100, image_id=1, keypoints=False):
    boxes = np.asarray(boxes, np.float32).reshape(-1, 4)
    g = len(boxes)
    classes = np.asarray(classes, np.int32)
    crowd = np.asarray(crowd, bool)
    ov = np.zeros((g, C), np.float32)
    ov[np.arange(g), classes] = 1
    ov[crowd] = -1
    e = {"id": image_id, "image": f"/x/{image_id}.jpg", "width": width, "height": height,
         "flipped": False, "boxes": boxes, "gt_classes": classes, "is_crowd": crowd,
         "seg_areas": np.ones(g, np.float32), "box_to_gt_ind_map": np.arange(g, dtype=np.int32),
         "gt_overlaps": scipy.sparse.csr_matrix(ov), "max_overlaps": ov.max(1),
         "max_classes": ov.argmax(1),
         "segms": [[[x1, y1, x2, y1, x2, y2, x1, y2]] for x1, y1, x2, y2 in boxes.tolist()]}
    if keypoints:
        kp = np.zeros((g, 3, K), np.int32)
        kp[:, 0] = ((boxes[:, 0] + boxes[:, 2]) / 2).astype(np.int32)[:, None] + np.arange(K)
        kp[:, 1] = ((boxes[:, 1] + boxes[:, 3]) / 2).astype(np.int32)[:, None]
        kp[:, 2] = 2
        e["gt_keypoints"] = kp
        e["has_visible_keypoints"] = True
    return e


def _detectron_add_proposals(entries, rois, scales, cfg):
    """json_dataset.add_proposals(crowd_thresh=0) + add_bbox_regression_targets, literally."""
    out = []
    for i, src in enumerate(entries):
        e = {k: v for k, v in src.items()}
        boxes = rois[rois[:, 0] == i, 1:].astype(np.float32) * np.float32(1.0 / scales[i])
        n = len(boxes)
        gt_overlaps = np.zeros((n, e["gt_overlaps"].shape[1]), np.float32)
        box_to_gt = -np.ones(n, np.int32)
        gt_inds = np.where(e["gt_classes"] > 0)[0]
        if len(gt_inds) and n:
            o = bbox_overlaps(boxes, e["boxes"][gt_inds])
            am, mx = o.argmax(1), o.max(1)
            hit = np.where(mx > 0)[0]
            gt_overlaps[hit, e["gt_classes"][gt_inds][am[hit]]] = mx[hit]
            box_to_gt[hit] = gt_inds[am[hit]]
        e["boxes"] = np.append(e["boxes"], boxes, axis=0)
        e["gt_classes"] = np.append(e["gt_classes"], np.zeros(n, np.int32))
        e["seg_areas"] = np.append(e["seg_areas"], np.zeros(n, np.float32))
        e["is_crowd"] = np.append(e["is_crowd"], np.zeros(n, bool))
        e["box_to_gt_ind_map"] = np.append(e["box_to_gt_ind_map"], box_to_gt)
        dense = np.append(e["gt_overlaps"].toarray(), gt_overlaps, axis=0)
        e["gt_overlaps"] = scipy.sparse.csr_matrix(dense)
        e["max_overlaps"], e["max_classes"] = dense.max(1), dense.argmax(1)
        e["bbox_targets"] = compute_bbox_targets(
            e["boxes"], e["max_overlaps"], e["max_classes"], e["gt_classes"], e["is_crowd"],
            bbox_thresh=cfg.TRAIN.BBOX_THRESH, cls_agnostic=cfg.MODEL.CLS_AGNOSTIC_BBOX_REG,
            weights=cfg.MODEL.BBOX_REG_WEIGHTS)
        out.append(e)
    return out


def _cfg(mask=True, keypoints=False, fpn=True, agnostic=False):
    cfg = get_cfg()
    cfg.merge_from_dict({"MODEL.NUM_CLASSES": C, "MODEL.FASTER_RCNN": True,
                         "MODEL.MASK_ON": mask, "MODEL.KEYPOINTS_ON": keypoints,
                         "MODEL.CLS_AGNOSTIC_BBOX_REG": agnostic,
                         "FPN.FPN_ON": fpn, "FPN.MULTILEVEL_ROIS": fpn,
                         "FPN.MULTILEVEL_RPN": fpn, "TRAIN.BATCH_SIZE_PER_IM": 32,
                         "MRCNN.RESOLUTION": 7, "KRCNN.NUM_KEYPOINTS": K,
                         "KRCNN.HEATMAP_SIZE": 8,
                         "KRCNN.MIN_KEYPOINT_COUNT_FOR_VALID_MINIBATCH": 0})
    return cfg


def _assert_blobs_equal(a, b):
    assert list(a) == list(b)
    for k in a:
        x = a[k].cpu().numpy() if isinstance(a[k], torch.Tensor) else a[k]
        assert x.dtype == b[k].dtype and x.shape == b[k].shape, k
        if k == "bbox_targets":  # float64 log in torch vs NumPy: equal after float32 rounding
            np.testing.assert_allclose(x, b[k], rtol=1e-6, atol=1e-7, err_msg=k)
        else:
            np.testing.assert_array_equal(x, b[k], err_msg=k)


@st.composite
def _scenes(draw):
    entries, rois = [], []
    for i in range(draw(st.integers(1, 3))):
        g = draw(st.integers(0, 4))
        boxes, classes = [], []
        for _ in range(g):
            x1, y1 = draw(st.integers(0, 90)), draw(st.integers(0, 70))
            boxes.append([x1, y1, x1 + draw(st.integers(2, 29)), y1 + draw(st.integers(2, 29))])
            classes.append(draw(st.integers(1, C - 1)))
        crowd = draw(st.lists(st.booleans(), min_size=g, max_size=g))
        entries.append(_gt_entry(boxes, classes, crowd, image_id=i + 1, keypoints=True))
        for _ in range(draw(st.integers(0, 30))):
            x1, y1 = draw(st.floats(0, 150)), draw(st.floats(0, 120))
            rois.append([i, x1, y1, x1 + draw(st.floats(0, 60)), y1 + draw(st.floats(0, 60))])
    scales = [draw(st.sampled_from([1.0, 1.3, 0.7])) for _ in entries]
    flags = draw(st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()))
    return entries, np.array(rois, np.float32).reshape(-1, 5), scales, flags, draw(
        st.integers(0, 999))


@settings(deadline=None, max_examples=40)
@given(_scenes())
def test_same_blobs_as_loader_path(scene):
    entries, rois, scales, (mask, kps, fpn, agnostic), seed = scene
    cfg = _cfg(mask=mask, keypoints=kps, fpn=fpn, agnostic=agnostic)
    if mask and any((e["gt_classes"] > 0).sum() == 0 for e in entries):
        cfg.MODEL.MASK_ON = False  # Detectron's mask code needs a polygon per image
    merged_ref = _detectron_add_proposals(entries, rois, scales, cfg)
    merged = merge_proposals(torch.from_numpy(rois), entries, scales, cfg)
    for m, r in zip(merged, merged_ref):
        for k in ("boxes", "gt_classes", "is_crowd", "seg_areas", "box_to_gt_ind_map",
                  "max_overlaps", "max_classes"):
            np.testing.assert_array_equal(m[k], r[k], err_msg=k)
        np.testing.assert_allclose(m["bbox_targets"], r["bbox_targets"], rtol=1e-6, atol=1e-7)
    loader: dict = {}
    add_fast_rcnn_blobs(loader, scales, merged_ref, cfg, np.random.RandomState(seed))
    e2e = proposal_labels(rois, entries, scales, cfg, np.random.RandomState(seed))
    _assert_blobs_equal(e2e, loader)
    g_loader: dict = {}
    add_fast_rcnn_blobs(g_loader, scales, merged_ref, cfg, np.random.default_rng(seed))
    g_e2e = proposal_labels(torch.from_numpy(rois), entries, torch.tensor(scales), cfg,
                            np.random.default_rng(seed))
    assert all(isinstance(v, torch.Tensor) for v in g_e2e.values())
    _assert_blobs_equal(g_e2e, g_loader)


def test_same_blobs_as_get_minibatch_with_images(tmp_path):
    """The loader path proper: proposals stored in the entries, images decoded, scales drawn."""
    cfg = _cfg(mask=True, keypoints=False, fpn=True)
    cfg.merge_from_dict({"TRAIN.SCALES": (160,), "TRAIN.MAX_SIZE": 300})
    entries = [_gt_entry([[10, 10, 60, 50], [30, 5, 90, 70], [0, 0, 100, 90]], [1, 3, 2],
                         [False, False, True], image_id=1),
               _gt_entry([[5, 20, 40, 80]], [4], [False], width=90, height=110, image_id=2)]
    for e in entries:
        path = tmp_path / f"{e['id']}.jpg"
        cv2.imwrite(str(path), np.full((e["height"], e["width"], 3), 128, np.uint8))
        e["image"] = str(path)
    scales = minibatch.build_minibatch(entries, cfg, np.random.RandomState(0)).image.im_scales
    r = np.random.RandomState(9)
    xy = r.uniform(0, 150, (300, 2))
    rois = np.concatenate([r.randint(0, 2, (300, 1)), xy, xy + r.uniform(4, 90, (300, 2))], 1)
    rois = rois.astype(np.float32)
    with_props = _detectron_add_proposals(entries, rois, scales, cfg)
    two_stage = cfg.clone()  # the same model trained from precomputed proposals
    two_stage.merge_from_dict(flags_for_model_type("mask_rcnn_proposals_fpn"))
    loader_blobs, valid = minibatch.get_minibatch(with_props, two_stage,
                                                  np.random.RandomState(42))
    assert list(loader_blobs)[1:] == list(minibatch.names.get_fast_rcnn_blob_names(cfg))
    rng = np.random.RandomState(42)
    rng.randint(0, len(cfg.TRAIN.SCALES), size=len(entries))  # the image blob's scale draw
    e2e = proposal_labels(rois, entries, scales, cfg, rng)
    _assert_blobs_equal(e2e, {k: loader_blobs[k] for k in e2e})


def test_roidb_blob_input_equals_entries():
    cfg = _cfg(mask=True)
    entries = [_gt_entry([[10, 10, 60, 50], [0, 0, 100, 90]], [1, 2], [False, True])]
    rois = np.array([[0, 12, 12, 58, 52], [0, 1, 1, 99, 89], [0, 70, 60, 110, 95]], np.float32)
    blob = torch.from_numpy(serialize_roidb(entries))
    a = proposal_labels(torch.from_numpy(rois), blob, torch.tensor([1.0]), cfg,
                        np.random.default_rng(0))
    b = proposal_labels(rois, entries, [1.0], cfg, np.random.default_rng(0))
    _assert_blobs_equal(a, b)


def test_no_crowd_filter_and_crowd_class_q8():
    # Detectron quirk Q8 (docs/detectron_quirks.md): a proposal on the crowd box becomes fg of the
    # crowd's class (crowd_thresh 0), while
    # its regression target goes to the best non-crowd gt.
    cfg = _cfg(mask=False, fpn=False)
    entries = [_gt_entry([[10, 10, 30, 30], [50, 50, 90, 90]], [1, 3], [False, True])]
    rois = np.array([[0, 50, 50, 90, 90], [0, 200, 200, 210, 210]], np.float32)
    m = merge_proposals(torch.from_numpy(rois), entries, [1.0], cfg)[0]
    np.testing.assert_array_equal(m["max_classes"], [1, 0, 3, 0])
    np.testing.assert_array_equal(m["max_overlaps"], [1, -1, 1, 0])
    np.testing.assert_array_equal(m["box_to_gt_ind_map"], [0, 1, 1, -1])
    assert m["bbox_targets"][2, 0] == 3 and m["bbox_targets"][1, 0] == 0


def test_fpn_top_n_over_the_whole_minibatch_q26():
    cfg = _cfg(mask=False)
    cfg.TRAIN.RPN_POST_NMS_TOP_N = 4
    entries = [_gt_entry([[10, 10, 60, 50]], [1], [False], image_id=i) for i in (1, 2)]
    rois = np.array([[i % 2, 5 + i, 5, 40 + i, 40] for i in range(10)], np.float32)
    scores = np.array([0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.4, 0.95, 0.0, 0.5], np.float32)
    merged = merge_proposals(collect_top_proposals(
        torch.from_numpy(rois), scores, 4), entries, [1.0, 1.0], cfg)
    # top 4: rows 7 (0.95), 1, 3, 5 (all image 1): image 0 gets none
    assert len(merged[0]["boxes"]) == 1 and len(merged[1]["boxes"]) == 5
    np.testing.assert_array_equal(merged[1]["boxes"][1:], rois[[7, 1, 3, 5], 1:])
    a = proposal_labels(rois, entries, [1.0, 1.0], cfg, np.random.RandomState(0), scores=scores)
    assert (a["rois"][:, 0] == 0).sum() == 1  # image 0: its gt row only
    cfg.FPN.MULTILEVEL_RPN = False  # single level: scores are not used here
    b = proposal_labels(rois, entries, [1.0, 1.0], cfg, np.random.RandomState(0), scores=scores)
    assert len(b["rois"]) == 12


def test_input_errors():
    cfg = _cfg()
    e = [_gt_entry([[10, 10, 60, 50]], [1], [False])]
    with pytest.raises(ValueError, match=r"\(N, 5\)"):
        proposal_labels(np.zeros((3, 4), np.float32), e, [1.0], cfg, np.random.RandomState(0))
    with pytest.raises(ValueError, match="batch_idx"):
        proposal_labels(np.array([[1, 0, 0, 5, 5]], np.float32), e, [1.0], cfg,
                        np.random.RandomState(0))
    with pytest.raises(ValueError, match="scales"):
        proposal_labels(np.zeros((0, 5), np.float32), e, [1.0, 2.0], cfg,
                        np.random.RandomState(0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    cfg = _cfg(mask=True, keypoints=True)
    entries = [_gt_entry([[10, 10, 60, 50], [30, 5, 90, 70], [0, 0, 100, 90]], [1, 3, 2],
                         [False, False, True], keypoints=True),
               _gt_entry([[5, 20, 40, 80]], [4], [False], image_id=2, keypoints=True)]
    r = np.random.RandomState(3)
    xy = r.uniform(0, 100, (500, 2))
    rois = np.concatenate([r.randint(0, 2, (500, 1)), xy, xy + r.uniform(2, 60, (500, 2))], 1)
    rois = torch.from_numpy(rois.astype(np.float32))
    scores = torch.rand(500, generator=torch.Generator().manual_seed(0))
    cpu = proposal_labels(rois, entries, [1.2, 0.9], cfg, np.random.RandomState(1), scores=scores)
    gpu = proposal_labels(rois.cuda(), entries, torch.tensor([1.2, 0.9]).cuda(), cfg,
                          np.random.RandomState(1), scores=scores.cuda())
    assert all(v.device.type == "cuda" for v in gpu.values())
    _assert_blobs_equal({k: v.cpu() for k, v in gpu.items()}, {k: v.numpy() for k, v in cpu.items()})
