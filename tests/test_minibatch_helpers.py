"""Shared builders for the minibatch tests: roidb-style entries as plain dicts.

The entries follow docs/architecture.md ("A roidb entry") and are labelled the way the roidb builder
labels them (Detectron semantics: proposals; bounding-box regression targets), so the minibatch code
sees realistic input.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cv2
import numpy as np

from lit_roidata.boxes import bbox_overlaps, bbox_transform_targets
from lit_roidata.config import get_cfg


def label_entry(entry: dict[str, Any], *, bbox_thresh: float = 0.5,
                weights=(10.0, 10.0, 5.0, 5.0)) -> dict[str, Any]:
    """Fill max_overlaps/max_classes/box_to_gt_ind_map/bbox_targets from boxes + gt."""
    boxes = entry["boxes"]
    gt_classes = entry["gt_classes"]
    is_crowd = entry["is_crowd"]
    n_gt = int((gt_classes > 0).sum())
    R = boxes.shape[0]
    max_overlaps = np.zeros(R, np.float32)
    max_classes = np.zeros(R, np.int64)
    b2g = -np.ones(R, np.int32)
    if n_gt:
        ov = bbox_overlaps(boxes, boxes[:n_gt])
        arg = ov.argmax(1)
        mx = ov.max(1)
        pos = mx > 0
        max_overlaps[pos] = mx[pos]
        max_classes[pos] = gt_classes[arg[pos]]
        b2g[pos] = arg[pos]
    gt_rows = np.arange(n_gt)
    max_overlaps[gt_rows] = np.where(is_crowd[:n_gt], -1.0, 1.0)
    max_classes[gt_rows] = np.where(is_crowd[:n_gt], 0, gt_classes[:n_gt])
    b2g[gt_rows] = gt_rows
    targets = np.zeros((R, 5), np.float32)
    good = np.where((gt_classes > 0) & ~is_crowd)[0]
    if good.size:
        ex = np.where(max_overlaps >= bbox_thresh)[0]
        ov = bbox_overlaps(boxes[ex], boxes[good])
        g = good[ov.argmax(1)]
        targets[ex, 0] = max_classes[ex]
        targets[ex, 1:] = bbox_transform_targets(boxes[ex], boxes[g], weights)
    entry.update(max_overlaps=max_overlaps, max_classes=max_classes, box_to_gt_ind_map=b2g,
                 bbox_targets=targets)
    return entry


def make_entry(rng: np.random.Generator, *, width: int = 64, height: int = 48,
               num_gt: int = 3, num_props: int = 40, num_classes: int = 5,
               crowd: bool = False, keypoints: int = 0, image: str = "/nonexistent.jpg",
               image_id: int = 1, flipped: bool = False) -> dict[str, Any]:
    """A labelled roidb entry with random gt boxes, square polygons and proposals."""
    gts = []
    for _ in range(num_gt):
        w = rng.integers(4, max(5, width // 2))
        h = rng.integers(4, max(5, height // 2))
        x1 = rng.integers(0, width - w)
        y1 = rng.integers(0, height - h)
        gts.append([x1, y1, x1 + w - 1, y1 + h - 1])
    gt = np.array(gts, np.float32).reshape(-1, 4)
    props = []
    for _ in range(num_props):
        if gts and rng.random() < 0.5:  # jitter a gt box so some proposals are fg
            b = gt[rng.integers(len(gt))] + rng.normal(0, 2, 4)
        else:
            x1, y1 = rng.uniform(0, width - 4), rng.uniform(0, height - 4)
            b = np.array([x1, y1, x1 + rng.uniform(3, width / 2), y1 + rng.uniform(3, height / 2)])
        b = np.clip(np.round(b), 0, [width - 1, height - 1, width - 1, height - 1])
        if b[2] - b[0] >= 2 and b[3] - b[1] >= 2:
            props.append(b)
    prop = np.array(props, np.float32).reshape(-1, 4)
    boxes = np.vstack([gt, prop]).astype(np.float32)
    R = boxes.shape[0]
    gt_classes = np.zeros(R, np.int32)
    gt_classes[:num_gt] = rng.integers(1, num_classes, num_gt)
    is_crowd = np.zeros(R, bool)
    if crowd and num_gt:
        is_crowd[num_gt - 1] = True
    segms = [[[float(b[0]), float(b[1]), float(b[2]) + 1, float(b[1]), float(b[2]) + 1,
               float(b[3]) + 1, float(b[0]), float(b[3]) + 1]] for b in gt]
    entry: dict[str, Any] = dict(
        image=image, id=image_id, width=width, height=height, flipped=flipped, boxes=boxes,
        gt_classes=gt_classes, is_crowd=is_crowd, seg_areas=np.zeros(R, np.float32),
        segms=segms, dataset="test_ds", has_visible_keypoints=keypoints > 0)
    if keypoints:
        kp = np.zeros((num_gt, 3, keypoints), np.int32)
        for i, b in enumerate(gt):
            kp[i, 0] = rng.integers(int(b[0]), int(b[2]) + 1, keypoints)
            kp[i, 1] = rng.integers(int(b[1]), int(b[3]) + 1, keypoints)
            kp[i, 2] = rng.integers(0, 3, keypoints)
        entry["gt_keypoints"] = kp
    return label_entry(entry)


def write_image(path: Path, width: int, height: int, seed: int = 0) -> np.ndarray:
    """Write a smooth random BGR image (PNG, lossless) and return its pixels."""
    r = np.random.default_rng(seed)
    small = r.integers(0, 256, (max(2, height // 8), max(2, width // 8), 3), dtype=np.uint8)
    im = cv2.resize(small, (width, height), interpolation=cv2.INTER_CUBIC)
    cv2.imwrite(str(path), im)
    return im


def image_roidb(root: Path, n: int = 6, seed: int = 0) -> list[dict]:
    """``n`` labelled entries backed by PNGs written under ``root`` (landscape and portrait
    alternately, every third entry flipped); images already there are reused."""
    r = np.random.default_rng(seed)
    out = []
    for i in range(n):
        w, h = (64, 48) if i % 2 == 0 else (48, 64)
        p = root / f"im{i}.png"
        if not p.exists():
            write_image(p, w, h, seed=i)
        out.append(make_entry(r, width=w, height=h, image=str(p), image_id=100 + i,
                              flipped=bool(i % 3 == 2)))
    return out


def small_cfg(**overrides: Any):
    cfg = get_cfg()
    base = {"MODEL.NUM_CLASSES": 5, "TRAIN.SCALES": (40, 56), "TRAIN.MAX_SIZE": 90,
            "TRAIN.BATCH_SIZE_PER_IM": 16, "TRAIN.IMS_PER_BATCH": 2}
    base.update(overrides)
    cfg.merge_from_dict(base)
    return cfg


def test_label_entry_prefix_rows_are_gt():
    e = make_entry(np.random.default_rng(0), crowd=True)
    assert (e["max_overlaps"][:2] == 1).all() and e["max_overlaps"][2] == -1
    assert (e["box_to_gt_ind_map"][:3] == np.arange(3)).all()
