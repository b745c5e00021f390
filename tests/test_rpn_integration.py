"""RPN and RetinaNet families end to end: real (demo) roidb entries, decoded images,
``get_minibatch``, the ``roidb`` blob and ``proposal_labels`` on it (Detectron semantics: blob
names; RPN targets; end-to-end training)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lit_roidata.catalog import Catalog
from lit_roidata.config import get_cfg
from lit_roidata.demo.data import register_demo_datasets
from lit_roidata.minibatch import get_minibatch, get_minibatch_blob_names, proposal_labels
from lit_roidata.minibatch.model_type import flags_for_model_type
from lit_roidata.minibatch.roidb_blob import deserialize_roidb
from lit_roidata.roidb.build import combined_roidb_for_training


@pytest.fixture(scope="module")
def roidb(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    demo = register_demo_datasets(tmp / "demo", Catalog(), num_images={
        "demo_train_a": 6, "demo_train_b": 2, "demo_val": 1})
    cfg = _cfg("mask_rcnn_fpn")
    return combined_roidb_for_training(demo.train_datasets[:1], (), cfg, str(tmp / "cache"),
                                       catalog=demo.catalog, progress=False)


def _cfg(model_type, **extra):
    cfg = get_cfg()
    cfg.merge_from_dict(flags_for_model_type(model_type))
    cfg.merge_from_dict({"MODEL.NUM_CLASSES": 5, "TRAIN.SCALES": (200,),
                         "TRAIN.MAX_SIZE": 333, **extra})
    return cfg


def _check_dtypes(blobs):
    for k, v in blobs.items():
        assert v.dtype in (np.float32, np.int32), k  # Detectron semantics: tested invariants


def test_e2e_mask_rcnn_fpn_minibatch_and_second_stage(roidb):
    cfg = _cfg("mask_rcnn_fpn")
    entries = [roidb[0], roidb[len(roidb) - 1]]  # an original and a flipped entry
    assert entries[1]["flipped"]
    blobs, valid = get_minibatch(entries, cfg, np.random.default_rng(0))
    assert valid and list(blobs) == get_minibatch_blob_names(cfg)
    _check_dtypes(blobs)
    for lvl, f in zip(range(2, 7), (88, 44, 22, 11, 6)):  # F = ceil(352 / 2**lvl)
        assert blobs[f"rpn_labels_int32_wide_fpn{lvl}"].shape == (2, 3, f, f)
        assert blobs[f"rpn_bbox_targets_wide_fpn{lvl}"].shape == (2, 12, f, f)
    pos = sum((blobs[f"rpn_labels_int32_wide_fpn{lvl}"] == 1).sum() for lvl in range(2, 7))
    assert pos > 0
    back = deserialize_roidb(blobs["roidb"])
    for e, b in zip(entries, back):
        np.testing.assert_array_equal(b["boxes"], e["boxes"])
        np.testing.assert_array_equal(b["gt_classes"], e["gt_classes"])
        assert b["segms"] == [list(map(list, s)) if isinstance(s, list) else s
                              for s in e["segms"]]
    r = np.random.RandomState(0)
    xy = r.uniform(0, 250, (400, 2))
    rois = np.concatenate([r.randint(0, 2, (400, 1)), xy, xy + r.uniform(4, 120, (400, 2))], 1)
    rois = torch.from_numpy(rois.astype(np.float32))
    scores = torch.from_numpy(r.rand(400).astype(np.float32))
    im_scales = torch.from_numpy(blobs["im_info"][:, 2])
    a = proposal_labels(rois, torch.from_numpy(blobs["roidb"]), im_scales, cfg,
                        np.random.default_rng(5), scores=scores)
    b = proposal_labels(rois, entries, im_scales, cfg, np.random.default_rng(5), scores=scores)
    assert list(a) == get_minibatch_blob_names(_cfg("mask_rcnn_proposals_fpn"))[1:]
    for k in a:
        assert a[k].dtype in (torch.float32, torch.int32)
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert (a["labels_int32"] > 0).any()


def test_retinanet_minibatch(roidb):
    cfg = _cfg("retinanet", **{"FPN.RPN_MIN_LEVEL": 3, "FPN.RPN_MAX_LEVEL": 7,
                               "FPN.COARSEST_STRIDE": 128})
    entries = [roidb[1], roidb[2]]
    blobs, valid = get_minibatch(entries, cfg, np.random.default_rng(0))
    assert valid and list(blobs) == get_minibatch_blob_names(cfg)
    _check_dtypes(blobs)
    n, _, h, w = blobs["data"].shape
    assert h % 128 == 0 and w % 128 == 0
    fg = 0
    for lvl in range(3, 8):
        cls = blobs[f"retnet_cls_labels_fpn{lvl}"]
        assert cls.shape == (n, 9, h // 2 ** lvl, w // 2 ** lvl)
        locs = blobs[f"retnet_roi_fg_bbox_locs_fpn{lvl}"]
        assert len(locs) == len(blobs[f"retnet_roi_bbox_targets_fpn{lvl}"])
        fg += len(locs)
    assert blobs["retnet_fg_num"].shape == (1,) and blobs["retnet_fg_num"][0] >= fg + n


def test_rpn_single_level_faster_rcnn(roidb):
    cfg = _cfg("faster_rcnn")
    blobs, _ = get_minibatch([roidb[3]], cfg, np.random.RandomState(3))
    assert list(blobs) == get_minibatch_blob_names(cfg)
    assert blobs["rpn_labels_int32_wide"].shape == (1, 12, 22, 22)  # 352 / 16
    lab = blobs["rpn_labels_int32_wide"]
    assert 0 < (lab == 1).sum() <= 128 and (lab >= 0).sum() <= 256
