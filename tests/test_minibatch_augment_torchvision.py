"""torchvision-style targets (conventions) and the optional albumentations pipeline."""

from __future__ import annotations

import albumentations as A
import numpy as np
import pytest
import torch
from torchvision import tv_tensors

from lit_roidata.dataset import RoIBlockDataset
from lit_roidata.sampler import Block
from lit_roidata.minibatch.augment import Augmentation
from lit_roidata.minibatch.core import build_minibatch
from lit_roidata.minibatch.torchvision_format import build_torchvision_batch
from test_minibatch_helpers import make_entry, small_cfg, write_image


def _entries(tmp_path, n=2, keypoints=0):
    r = np.random.default_rng(4)
    out = []
    for i in range(n):
        p = tmp_path / f"t{i}.png"
        write_image(p, 64, 48, seed=i)
        out.append(make_entry(r, image=str(p), image_id=i, crowd=i == 1, keypoints=keypoints,
                              num_gt=3))
    return out


def test_torchvision_targets_conventions(tmp_path):
    cfg = small_cfg(**{"MODEL.MASK_ON": True, "MODEL.KEYPOINTS_ON": True,
                       "KRCNN.NUM_KEYPOINTS": 3, "KRCNN.HEATMAP_SIZE": 8})
    entries = _entries(tmp_path, keypoints=3)
    images, targets = build_torchvision_batch(entries, cfg, np.random.RandomState(1))
    ref = build_minibatch(entries, cfg, np.random.RandomState(1), pixel_format="uint8")
    for i, (im, t, e) in enumerate(zip(images, targets, entries)):
        s = ref.image.im_scales[i]
        h, w = ref.image.image_sizes[i]
        assert isinstance(im, tv_tensors.Image) and im.dtype == torch.uint8
        # RGB, unpadded, same pixels as the BGR blob
        assert torch.equal(im, torch.from_numpy(ref.blobs["data"][i, ::-1, :h, :w].copy()))
        keep = np.flatnonzero((e["gt_classes"] > 0) & ~e["is_crowd"])
        b = e["boxes"][keep]
        want = np.stack([b[:, 0] * s, b[:, 1] * s, (b[:, 2] + 1) * s, (b[:, 3] + 1) * s], 1)
        assert isinstance(t["boxes"], tv_tensors.BoundingBoxes)
        assert tuple(t["boxes"].canvas_size) == (h, w)
        assert np.allclose(t["boxes"].numpy(), want, atol=1e-4)
        assert t["labels"].dtype == torch.int64
        assert t["labels"].tolist() == e["gt_classes"][keep].tolist()
        assert t["image_id"] == e["id"] and t["scale"] == s
        assert len(t["crowd_boxes"]) == int(e["is_crowd"].sum())
        assert "proposals" in t and len(t["proposals"]) == int((e["gt_classes"] == 0).sum())
        m = t["masks"]
        assert m.shape == (len(keep), h, w) and m.dtype == torch.uint8
        for j in range(len(keep)):  # square polygons: the mask fills its box
            x1, y1, x2, y2 = want[j]
            inner = m[j, int(np.ceil(y1)) + 1:int(y2) - 1, int(np.ceil(x1)) + 1:int(x2) - 1]
            assert inner.numel() == 0 or bool(inner.all())
            assert int(m[j].sum()) <= (x2 - x1 + 2) * (y2 - y1 + 2)
        kp = t["keypoints"]
        g = e["gt_keypoints"][keep]
        vis = g[:, 2, :] > 0
        assert kp.shape == (len(keep), 3, 3)
        assert np.allclose(kp[..., 0].numpy()[vis], ((g[:, 0, :] + 0.5) * s)[vis])
        assert (kp[..., :2].numpy()[~vis] == 0).all()


def _same_entry(a, b, keys=("boxes", "max_overlaps", "max_classes", "box_to_gt_ind_map",
                            "gt_classes", "is_crowd")):
    for k in keys:
        assert np.array_equal(np.asarray(a[k]), np.asarray(b[k])), k
    assert np.allclose(a["bbox_targets"], b["bbox_targets"], atol=1e-5)


def test_identity_pipeline_keeps_entry(tmp_path):
    cfg = small_cfg()
    e = _entries(tmp_path, n=2)[1]  # has a crowd gt
    aug = Augmentation([A.NoOp()], cfg)
    im = np.zeros((48, 64, 3), np.uint8)
    out_im, out = aug.apply(im, e, seed=0)
    assert out_im.shape == im.shape
    _same_entry(out, e)
    assert out["segms"] == e["segms"]


def test_crop_moves_geometry_consistently(tmp_path):
    cfg = small_cfg(**{"MODEL.KEYPOINTS_ON": True, "KRCNN.NUM_KEYPOINTS": 3,
                       "KRCNN.HEATMAP_SIZE": 8})
    e = _entries(tmp_path, n=1, keypoints=3)[0]
    im = write_image(tmp_path / "c.png", 64, 48, seed=9)
    aug = Augmentation([A.Crop(x_min=8, y_min=4, x_max=56, y_max=44)], cfg)
    out_im, out = aug.apply(im, e, seed=0)
    assert np.array_equal(out_im, im[4:44, 8:56])
    assert (out["width"], out["height"]) == (48, 40)
    kept = [i for i in range(len(e["boxes"]))
            if min(e["boxes"][i, 2] + 1, 56) > max(e["boxes"][i, 0], 8)
            and min(e["boxes"][i, 3] + 1, 44) > max(e["boxes"][i, 1], 4)]
    assert len(out["boxes"]) == len(kept)
    src = e["boxes"][kept]
    want = np.stack([np.maximum(src[:, 0], 8) - 8, np.maximum(src[:, 1], 4) - 4,
                     np.minimum(src[:, 2] + 1, 56) - 9, np.minimum(src[:, 3] + 1, 44) - 5], 1)
    assert np.allclose(out["boxes"], want, atol=1e-3)
    n_gt = int((out["gt_classes"] > 0).sum())
    assert (out["max_overlaps"][:n_gt] == 1).all() and (out["gt_classes"][n_gt:] == 0).all()
    assert len(out["segms"]) == n_gt == out["gt_keypoints"].shape[0]
    poly = np.array(out["segms"][0][0]).reshape(-1, 2)
    orig = np.array(e["segms"][kept[0]][0]).reshape(-1, 2)
    assert np.allclose(poly, orig - [8, 4], atol=1e-3)
    kp = out["gt_keypoints"]
    vis = kp[:, 2, :] > 0
    assert ((kp[:, 0, :][vis] >= 0) & (kp[:, 0, :][vis] <= 47)).all()


def test_augmented_blocks_are_valid_and_reproducible(tmp_path):
    cfg = small_cfg(**{"MODEL.MASK_ON": True, "MRCNN.RESOLUTION": 6})
    roidb = _entries(tmp_path, n=2)
    aug = Augmentation([A.Affine(scale=(0.8, 1.2), rotate=(-10, 10), p=1),
                        A.RandomBrightnessContrast(p=1)], cfg)
    blk = Block([0, 1], seed=2, pass_index=0, block_index=5)
    a = RoIBlockDataset(roidb, cfg, augment=aug).__getitems__(blk)
    b = RoIBlockDataset(roidb, cfg, augment=aug).__getitems__(blk)
    for k in a:
        if k != "_meta":
            assert torch.equal(a[k], b[k]), k
    plain = RoIBlockDataset(roidb, cfg).__getitems__(blk)
    assert not torch.equal(a["data"], plain["data"])
    assert np.array_equal(a["rois"][a["roi_has_mask_int32"] == 1], a["mask_rois"])


def test_flip_refused_for_keypoint_models():
    cfg = small_cfg(**{"MODEL.KEYPOINTS_ON": True, "KRCNN.NUM_KEYPOINTS": 3,
                       "KRCNN.HEATMAP_SIZE": 8})
    with pytest.raises(ValueError, match="USE_FLIPPED"):
        Augmentation([A.OneOf([A.HorizontalFlip(), A.NoOp()])], cfg)
