"""Optional albumentations pipeline, applied per image before Detectron's scaling.

Off by default, so the blobs are exactly Detectron's. When on, each image of a block
goes through the pipeline after decoding (and after the roidb flip) and before the
scale of Detectron semantics: image blob; its geometry goes through the same transform:

* every box row (gt and proposals) as a ``pascal_voc`` box ``[x1, y1, x2+1, y2+1]``
  (continuous edges; converted back to Detectron's inclusive convention); rows the
  pipeline drops (cropped away, below ``min_visibility``) leave the entry;
* polygon vertices and keypoints (pixel centres ``x + 0.5``) as keypoints; keypoints
  that leave the image become invisible (``v = 0``); RLE segms as masks;
* then the entry is relabelled as the roidb builder labels it (Detectron semantics: proposals;
bounding-box regression targets):
  proposal overlaps with the surviving gt, ``max_classes``, ``box_to_gt_ind_map`` and
  ``bbox_targets``; crowd-filtered proposal rows (overlap -1) stay filtered.

Horizontal flips belong to ``TRAIN.USE_FLIPPED`` (keypoint left/right swap); a flip in
the pipeline is refused for keypoint models. Draws come from the block's generator
(a spawned child for ``numpy.random.Generator``), so augmented blocks stay
reproducible.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np
import pycocotools.mask as mask_util

from lit_roidata import rng as rng_mod
from lit_roidata._optional import require
from lit_roidata.boxes import bbox_overlaps
from lit_roidata.minibatch.mask import segm_as_rle, segm_polygons
from lit_roidata.roidb.targets import compute_bbox_targets

__all__ = ["Augmentation"]

_FLIPS = {"HorizontalFlip", "VerticalFlip", "D4", "Transpose", "RandomRotate90", "SquareSymmetry"}


def _walk(transforms: Iterable[Any]) -> Iterable[Any]:
    for t in transforms:
        yield t
        yield from _walk(getattr(t, "transforms", []) or [])


class Augmentation:
    """An albumentations pipeline that keeps a roidb entry consistent with its image.

    Args:
        transforms: albumentations transforms (a list or an ``A.Compose``).
        cfg: the Detectron config (``TRAIN.BBOX_THRESH``, ``MODEL.BBOX_REG_WEIGHTS``,
            ``MODEL.CLS_AGNOSTIC_BBOX_REG``, ``MODEL.KEYPOINTS_ON``).
        min_visibility: albumentations' box ``min_visibility``.

    Raises:
        ValueError: a flip/rotation-by-90 transform in a keypoint model's pipeline.

    Example::

        >>> import albumentations as A
        >>> aug = Augmentation([A.RandomBrightnessContrast(p=0.5)], cfg)
        >>> ds = RoIBlockDataset(roidb, cfg, augment=aug)
    """

    def __init__(self, transforms: Any, cfg: Any, *, min_visibility: float = 0.0) -> None:
        A = require("albumentations", "augment", "augmentation (Augmentation)")

        transforms = list(transforms.transforms if isinstance(transforms, A.Compose)
                          else transforms)
        if cfg.MODEL.KEYPOINTS_ON:
            if bad := sorted({type(t).__name__ for t in _walk(transforms)} & _FLIPS):
                raise ValueError(f"augmentation {bad} would mirror keypoints without swapping "
                                 "left/right; use TRAIN.USE_FLIPPED for flips")
        self.cfg = cfg
        self.compose = A.Compose(
            transforms, bbox_params=A.BboxParams(format="pascal_voc", label_fields=["row_ids"],
                                                 min_visibility=min_visibility, clip=True),
            keypoint_params=A.KeypointParams(format="xy", label_fields=["kp_ids"],
                                             remove_invisible=False), seed=0)

    def draw_seeds(self, n: int, rng: rng_mod.RNG) -> list[int]:
        """One seed per image, without disturbing a ``Generator``'s own stream."""
        if isinstance(rng, np.random.Generator):
            return [int(s) for s in rng.spawn(1)[0].integers(0, 2**31 - 1, size=n)]
        return [int(s) for s in rng_mod.randint(rng, 0, 2**31 - 1, size=n)]

    def apply(self, im: np.ndarray, entry: Mapping[str, Any], *, seed: int
              ) -> tuple[np.ndarray, dict[str, Any]]:
        """Transform one BGR image and its entry; returns the new image and entry copy."""
        h, w = im.shape[:2]
        boxes = np.asarray(entry["boxes"], dtype=np.float32).reshape(-1, 4)
        vo = np.clip(boxes + np.float32([0, 0, 1, 1]), 0, np.float32([w, h, w, h]))
        ok = (vo[:, 2] > vo[:, 0]) & (vo[:, 3] > vo[:, 1])
        n_gt = len(entry["segms"])
        pts: list[np.ndarray] = []  # polygon vertices, then keypoints (pixel centres)
        polys: list[list[int]] = []  # per gt row: number of vertices of each part
        for r in range(n_gt):
            parts = segm_polygons(entry["segms"][r])
            polys.append([len(p) // 2 for p in parts])
            pts.extend(p.reshape(-1, 2) for p in parts)
        if "gt_keypoints" in entry:
            kps = np.asarray(entry["gt_keypoints"])
            pts.extend(kps[r, :2, :].T.astype(np.float32) + 0.5 for r in range(kps.shape[0]))
        points = np.concatenate(pts).astype(np.float32) if pts else np.zeros((0, 2), np.float32)
        rle_rows = [r for r in range(n_gt) if not segm_polygons(entry["segms"][r])
                    and segm_as_rle(entry["segms"][r], h, w) is not None]
        masks = [mask_util.decode(segm_as_rle(entry["segms"][r], h, w)) for r in rle_rows]
        self.compose.set_random_seed(int(seed))
        out = self.compose(image=np.ascontiguousarray(im[:, :, ::-1]), bboxes=vo[ok],
                           row_ids=np.flatnonzero(ok), keypoints=points,
                           kp_ids=np.arange(len(points)), **({"masks": masks} if masks else {}))
        new_im = np.ascontiguousarray(out["image"][:, :, ::-1])
        h, w = new_im.shape[:2]
        kept = np.asarray(out["row_ids"], dtype=np.int64)
        order = np.argsort(kept, kind="stable")  # keep gt rows a prefix
        kept = kept[order]
        boxes = np.asarray(out["bboxes"], dtype=np.float32).reshape(-1, 4)[order]
        boxes[:, 2:] = np.maximum(boxes[:, 2:] - 1, boxes[:, :2])
        pts = np.asarray(out["keypoints"], dtype=np.float32).reshape(-1, 2)
        rle_masks = dict(zip(rle_rows, out.get("masks", [])))
        # the entry copy: the kept rows, their transformed segms and keypoints, relabelled
        gt_old = kept[kept < n_gt]
        counts = [nv for row in polys for nv in row]  # vertices per polygon part
        cursor = int(sum(counts))
        flat = iter(np.split(pts[:cursor], np.cumsum(counts, dtype=np.int64)[:-1]))
        new_polys = [[next(flat).reshape(-1).astype(float).tolist() for _ in row] for row in polys]
        segms = [mask_util.encode(np.asfortranarray(rle_masks[r].astype(np.uint8)))
                 if r in rle_masks else new_polys[r] if polys[r] else entry["segms"][r]
                 for r in gt_old]
        gt_classes = np.asarray(entry["gt_classes"])[kept]
        is_crowd = np.asarray(entry["is_crowd"]).astype(bool)[kept]
        new = dict(entry)
        new.update(width=w, height=h, boxes=boxes, gt_classes=gt_classes, is_crowd=is_crowd,
                   segms=segms)
        if "seg_areas" in entry:
            new["seg_areas"] = np.asarray(entry["seg_areas"])[kept]
        if "gt_keypoints" in entry:
            kps = np.asarray(entry["gt_keypoints"]).copy()
            if kps.size:  # (x, y) back to pixel indices; outside the image: invisible, 0
                kp = (pts[cursor:].reshape(kps.shape[0], kps.shape[2], 2) - 0.5).transpose(0, 2, 1)
                inside = (kp >= 0).all(axis=1) & (kp[:, 0] <= w - 1) & (kp[:, 1] <= h - 1)
                kps[:, 2, :] = np.where(inside, kps[:, 2, :], 0)
                kps[:, :2, :] = np.where(kps[:, 2:, :] == 0, 0, np.round(kp))
            new["gt_keypoints"] = kps = kps[gt_old]
            new["has_visible_keypoints"] = bool((kps[:, 2, :] > 0).any()) if kps.size else False
        # relabelled: proposal overlaps with the surviving gt rows (the first g rows)
        g, r = len(gt_old), len(kept)
        mo, mc, b2g = np.zeros(r, np.float32), np.zeros(r, np.int64), -np.ones(r, np.int32)
        if g:
            ov = bbox_overlaps(boxes[g:], boxes[:g])
            arg, mx = ov.argmax(1), ov.max(1)
            pos = mx > 0
            rows = np.flatnonzero(pos) + g
            mo[rows], mc[rows], b2g[rows] = mx[pos], gt_classes[arg[pos]], arg[pos]
            mo[:g] = np.where(is_crowd[:g], -1.0, 1.0)
            mc[:g] = np.where(is_crowd[:g], 0, gt_classes[:g])
            b2g[:g] = np.arange(g)
        # crowd-filtered proposals stay filtered
        filtered = np.flatnonzero(np.asarray(entry["max_overlaps"])[kept][g:] < 0) + g
        mo[filtered], mc[filtered] = -1.0, 0
        cfg = self.cfg
        new.update(max_overlaps=mo, max_classes=mc, box_to_gt_ind_map=b2g,
                   bbox_targets=compute_bbox_targets(
                       boxes, mo, mc, gt_classes, is_crowd, bbox_thresh=cfg.TRAIN.BBOX_THRESH,
                       cls_agnostic=cfg.MODEL.CLS_AGNOSTIC_BBOX_REG,
                       weights=tuple(cfg.MODEL.BBOX_REG_WEIGHTS)))
        new.pop("gt_overlaps", None)
        return new_im, new
