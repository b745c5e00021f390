"""A plain, per-entry port of Detectron's roidb code (list of dicts): a test oracle.

This is Detectron's ``json_dataset.py`` / ``roidb.py`` logic line by line (pycocotools
``COCO``, Python loops per image and per object). It serves as the oracle of the
equivalence tests and as the benchmark baseline for the columnar builder, so it shares
no code with what it checks: IoU, regression targets, proposal-file reading and RLE
flipping are written here again, per entry, from Detectron's definitions. One deliberate
difference from Detectron: RLE segms are flipped as the package flips them (Detectron
crashes on compressed RLE and wraps uncompressed ones in a list, Detectron quirk Q12 in
docs/detectron_quirks.md).

It is slow and memory-hungry by design (that is what it measures); do not use it to
train.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import pickle
import warnings
from typing import Optional, Sequence

import numpy as np
import scipy.sparse

from lit_roidata.roidb.info import COCO_KEYPOINT_FLIP_MAP

__all__ = ["ReferenceDataset", "reference_combined_roidb"]


class ReferenceDataset:
    """Detectron's ``JsonDataset`` (Detectron semantics: datasets and catalog) on top of
    ``pycocotools.COCO``."""

    def __init__(self, name: str, image_dir: str, ann_file: str, image_prefix: str = "") -> None:
        from pycocotools.coco import COCO

        with contextlib.redirect_stdout(io.StringIO()):
            self.COCO = COCO(ann_file)
        self.name = name
        self.image_directory = image_dir
        self.image_prefix = image_prefix
        cat_ids = self.COCO.getCatIds()
        names = [c["name"] for c in self.COCO.loadCats(cat_ids)]
        self.classes = ["__background__"] + names
        self.num_classes = len(self.classes)
        self.json_category_id_to_contiguous_id = {v: i + 1 for i, v in enumerate(cat_ids)}
        self.keypoints = None
        self.keypoint_flip_map = None
        cat_map = dict(zip(names, cat_ids))
        if "person" in cat_map:
            info = self.COCO.loadCats([cat_map["person"]])[0]
            if info.get("keypoints"):
                self.keypoints = list(info["keypoints"])
                self.num_keypoints = len(self.keypoints)
                self.keypoint_flip_map = {l: r for l, r in COCO_KEYPOINT_FLIP_MAP.items()
                                          if l in self.keypoints and r in self.keypoints}

    def get_roidb(self, *, gt: bool = True, proposal_file: Optional[str] = None,
                  min_proposal_size: int = 2, proposal_limit: int = -1,
                  crowd_filter_thresh: float = 0, gt_min_area: float = -1) -> list[dict]:
        """Detectron's ``get_roidb`` (Detectron semantics: roidb building)."""
        image_ids = sorted(self.COCO.getImgIds())
        roidb = copy.deepcopy(self.COCO.loadImgs(image_ids))
        for entry in roidb:
            self._prep(entry)
        if gt:
            for entry in roidb:
                self._add_gt(entry, gt_min_area)
        if proposal_file is not None:
            self._add_proposals(roidb, proposal_file, min_proposal_size, proposal_limit,
                                crowd_filter_thresh)
        for entry in roidb:
            ov = entry["gt_overlaps"].toarray()
            entry["max_classes"] = ov.argmax(axis=1) if ov.shape[0] else np.zeros(0, np.int64)
            entry["max_overlaps"] = ov.max(axis=1) if ov.shape[0] else np.zeros(0, np.float32)
        return roidb

    def _prep(self, entry: dict) -> None:
        entry["dataset"] = self
        entry["image"] = os.path.join(self.image_directory, self.image_prefix + entry["file_name"])
        entry["flipped"] = False
        entry["has_visible_keypoints"] = False
        entry["boxes"] = np.empty((0, 4), dtype=np.float32)
        entry["segms"] = []
        entry["gt_classes"] = np.empty((0), dtype=np.int32)
        entry["seg_areas"] = np.empty((0), dtype=np.float32)
        entry["gt_overlaps"] = scipy.sparse.csr_matrix(
            np.empty((0, self.num_classes), dtype=np.float32))
        entry["is_crowd"] = np.empty((0), dtype=bool)
        entry["box_to_gt_ind_map"] = np.empty((0), dtype=np.int32)
        if self.keypoints is not None:
            entry["gt_keypoints"] = np.empty((0, 3, self.num_keypoints), dtype=np.int32)
        for k in ("date_captured", "url", "license", "file_name"):
            entry.pop(k, None)

    def _add_gt(self, entry: dict, gt_min_area: float) -> None:
        objs = self.COCO.loadAnns(self.COCO.getAnnIds(imgIds=entry["id"], iscrowd=None))
        valid, segms = [], []
        width, height = entry["width"], entry["height"]
        for obj in objs:
            if isinstance(obj["segmentation"], list):
                obj["segmentation"] = [p for p in obj["segmentation"] if len(p) >= 6]
            if obj["area"] < gt_min_area:
                continue
            if "ignore" in obj and obj["ignore"] == 1:
                continue
            x1, y1 = obj["bbox"][0], obj["bbox"][1]
            x2 = x1 + np.maximum(0.0, obj["bbox"][2] - 1.0)
            y2 = y1 + np.maximum(0.0, obj["bbox"][3] - 1.0)
            x1 = np.minimum(width - 1.0, np.maximum(0.0, x1))
            y1 = np.minimum(height - 1.0, np.maximum(0.0, y1))
            x2 = np.minimum(width - 1.0, np.maximum(0.0, x2))
            y2 = np.minimum(height - 1.0, np.maximum(0.0, y2))
            if obj["area"] > 0 and x2 > x1 and y2 > y1:
                obj["clean_bbox"] = [x1, y1, x2, y2]
                valid.append(obj)
                segms.append(obj["segmentation"])
        n = len(valid)
        boxes = np.zeros((n, 4), dtype=np.float32)
        gt_classes = np.zeros((n), dtype=np.int32)
        gt_overlaps = np.zeros((n, self.num_classes), dtype=np.float32)
        seg_areas = np.zeros((n), dtype=np.float32)
        is_crowd = np.zeros((n), dtype=bool)
        box_to_gt = np.zeros((n), dtype=np.int32)
        if self.keypoints is not None:
            gt_kps = np.zeros((n, 3, self.num_keypoints), dtype=np.int32)
        vis = False
        for ix, obj in enumerate(valid):
            cls = self.json_category_id_to_contiguous_id[obj["category_id"]]
            boxes[ix, :] = obj["clean_bbox"]
            gt_classes[ix] = cls
            seg_areas[ix] = obj["area"]
            is_crowd[ix] = obj.get("iscrowd", 0)
            box_to_gt[ix] = ix
            if self.keypoints is not None:
                kp = np.array(obj["keypoints"])
                gt_kps[ix, 0, :] = kp[0::3]
                gt_kps[ix, 1, :] = kp[1::3]
                gt_kps[ix, 2, :] = kp[2::3]
                if np.sum(gt_kps[ix, 2, :]) > 0:
                    vis = True
            if obj.get("iscrowd", 0):
                gt_overlaps[ix, :] = -1.0
            else:
                gt_overlaps[ix, cls] = 1.0
        entry["boxes"] = np.append(entry["boxes"], boxes, axis=0)
        entry["segms"].extend(segms)
        entry["gt_classes"] = np.append(entry["gt_classes"], gt_classes)
        entry["seg_areas"] = np.append(entry["seg_areas"], seg_areas)
        entry["gt_overlaps"] = scipy.sparse.csr_matrix(
            np.append(entry["gt_overlaps"].toarray(), gt_overlaps, axis=0))
        entry["is_crowd"] = np.append(entry["is_crowd"], is_crowd)
        entry["box_to_gt_ind_map"] = np.append(entry["box_to_gt_ind_map"], box_to_gt)
        if self.keypoints is not None:
            entry["gt_keypoints"] = np.append(entry["gt_keypoints"], gt_kps, axis=0)
            entry["has_visible_keypoints"] = vis

    def _add_proposals(self, roidb, proposal_file, min_size, top_k, crowd_thresh) -> None:
        props = _load_proposals(proposal_file)
        key = "indexes" if "indexes" in props else "ids"
        roidb_ids = {e["id"] for e in roidb}
        keep = [i for i, x in enumerate(props[key]) if x in roidb_ids]
        ids = [props[key][i] for i in keep]
        boxes_all = [props["boxes"][i] for i in keep]
        order = np.argsort(ids, kind="stable")
        box_list = []
        for i, entry in enumerate(roidb):
            j = order[i]
            assert entry["id"] == ids[j]
            boxes = np.array(boxes_all[j]).reshape(-1, 4)
            boxes[:, [0, 2]] = np.minimum(entry["width"] - 1.0, np.maximum(0.0, boxes[:, [0, 2]]))
            boxes[:, [1, 3]] = np.minimum(entry["height"] - 1.0,
                                          np.maximum(0.0, boxes[:, [1, 3]]))
            hashes = np.round(boxes).dot(np.array([1, 1e3, 1e6, 1e9]))
            _, index = np.unique(hashes, return_index=True)
            boxes = boxes[np.sort(index), :]
            w = boxes[:, 2] - boxes[:, 0] + 1
            h = boxes[:, 3] - boxes[:, 1] + 1
            boxes = boxes[(w > min_size) & (h > min_size), :]
            if top_k > 0:
                boxes = boxes[:top_k, :]
            box_list.append(boxes)
        for entry, boxes in zip(roidb, box_list):
            _merge(entry, boxes)
        if crowd_thresh > 0:
            for entry in roidb:
                _filter_crowd(entry, crowd_thresh)


def _load_proposals(path: str) -> dict:
    """Detectron's ``pickle.load`` of a proposal file; a columnar ``.npz`` (``ids``,
    ``counts``, ``boxes``) is split into the same per-image lists."""
    if path.endswith(".npz"):
        with np.load(path) as z:
            ids, counts, boxes = z["ids"], z["counts"], z["boxes"]
        ends = np.cumsum(counts)
        return {"ids": [int(i) for i in ids],
                "boxes": [boxes[e - c:e] for c, e in zip(counts, ends)]}
    with open(path, "rb") as fh:
        return pickle.load(fh, encoding="latin1")


def bbox_overlaps(boxes: np.ndarray, query_boxes: np.ndarray) -> np.ndarray:
    """Detectron's ``bbox_overlaps`` (IoU with the +1 pixel convention), ``(N, K)``.

    For each pair: ``iw = min(x2) - max(x1) + 1``, ``ih = min(y2) - max(y1) + 1``; the
    IoU is 0 unless both are > 0, else ``iw * ih / (area + query_area - iw * ih)``,
    evaluated in double precision and stored as float32.
    """
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 1, 4)
    q = np.asarray(query_boxes, dtype=np.float64).reshape(1, -1, 4)
    iw = np.minimum(b[..., 2], q[..., 2]) - np.maximum(b[..., 0], q[..., 0]) + 1
    ih = np.minimum(b[..., 3], q[..., 3]) - np.maximum(b[..., 1], q[..., 1]) + 1
    box_area = (b[..., 2] - b[..., 0] + 1) * (b[..., 3] - b[..., 1] + 1)
    query_area = (q[..., 2] - q[..., 0] + 1) * (q[..., 3] - q[..., 1] + 1)
    overlap = (iw > 0) & (ih > 0)
    inter = np.where(overlap, iw * ih, 0.0)
    union = np.where(overlap, box_area + query_area - inter, 1.0)
    return np.where(overlap, inter / union, 0.0).astype(np.float32)


def bbox_transform_targets(ex_rois: np.ndarray, gt_rois: np.ndarray,
                           weights: Sequence[float]) -> np.ndarray:
    """Detectron's ``bbox_transform_inv``: targets ``(dx, dy, dw, dh)`` that move each
    ``ex_rois`` box onto its ``gt_rois`` box (``w = x2 - x1 + 1``, ``cx = x1 + 0.5 w``),
    evaluated in double precision and stored as float32."""
    ex = np.asarray(ex_rois, dtype=np.float64)
    gt = np.asarray(gt_rois, dtype=np.float64)
    wx, wy, ww, wh = weights
    ex_widths = ex[:, 2] - ex[:, 0] + 1.0
    ex_heights = ex[:, 3] - ex[:, 1] + 1.0
    ex_ctr_x = ex[:, 0] + 0.5 * ex_widths
    ex_ctr_y = ex[:, 1] + 0.5 * ex_heights
    gt_widths = gt[:, 2] - gt[:, 0] + 1.0
    gt_heights = gt[:, 3] - gt[:, 1] + 1.0
    gt_ctr_x = gt[:, 0] + 0.5 * gt_widths
    gt_ctr_y = gt[:, 1] + 0.5 * gt_heights
    targets_dx = wx * (gt_ctr_x - ex_ctr_x) / ex_widths
    targets_dy = wy * (gt_ctr_y - ex_ctr_y) / ex_heights
    targets_dw = ww * np.log(gt_widths / ex_widths)
    targets_dh = wh * np.log(gt_heights / ex_heights)
    return np.vstack((targets_dx, targets_dy, targets_dw, targets_dh)).transpose().astype(
        np.float32)


def flip_rle(rle: dict) -> dict:
    """An RLE segm mirrored left-right, in the representation it came in (uncompressed
    counts list, compressed ``str`` or ``bytes``)."""
    from pycocotools import mask as mask_util

    h, w = (int(v) for v in rle["size"])
    counts = rle["counts"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if isinstance(counts, list):
            mask = mask_util.decode(mask_util.frPyObjects(rle, h, w))
        else:
            raw = counts.encode("ascii") if isinstance(counts, str) else counts
            mask = mask_util.decode({"size": [h, w], "counts": raw})
    mirrored = np.asfortranarray(mask[:, ::-1])
    if isinstance(counts, list):
        return {"size": [h, w], "counts": _uncompressed_counts(mirrored)}
    enc = mask_util.encode(mirrored)["counts"]
    return {"size": [h, w], "counts": enc.decode("ascii") if isinstance(counts, str) else enc}


def _uncompressed_counts(mask: np.ndarray) -> list[int]:
    """COCO's uncompressed RLE: run lengths of the column-major pixels, zeros first."""
    pixels = mask.ravel(order="F")
    runs: list[int] = []
    value, length = 0, 0
    starts = np.flatnonzero(np.r_[True, pixels[1:] != pixels[:-1]]) if pixels.size else []
    for i, start in enumerate(starts):  # one step per run, not per pixel
        end = starts[i + 1] if i + 1 < len(starts) else pixels.size
        if pixels[start] != value:  # the first run is of zeros, possibly empty
            runs.append(length)
            value, length = pixels[start], 0
        length += int(end - start)
    if pixels.size:
        runs.append(length)
    return runs


def _merge(entry: dict, boxes: np.ndarray) -> None:
    n = boxes.shape[0]
    gt_overlaps = np.zeros((n, entry["gt_overlaps"].shape[1]), dtype=np.float32)
    box_to_gt = -np.ones((n), dtype=np.int32)
    gt_inds = np.where(entry["gt_classes"] > 0)[0]
    if len(gt_inds) > 0 and n:
        ov = bbox_overlaps(boxes.astype(np.float32, copy=False),
                           entry["boxes"][gt_inds, :].astype(np.float32, copy=False))
        argmaxes = ov.argmax(axis=1)
        maxes = ov.max(axis=1)
        idx = np.where(maxes > 0)[0]
        gt_overlaps[idx, entry["gt_classes"][gt_inds][argmaxes[idx]]] = maxes[idx]
        box_to_gt[idx] = gt_inds[argmaxes[idx]]
    entry["boxes"] = np.append(entry["boxes"], boxes.astype(np.float32, copy=False), axis=0)
    entry["gt_classes"] = np.append(entry["gt_classes"], np.zeros((n), dtype=np.int32))
    entry["seg_areas"] = np.append(entry["seg_areas"], np.zeros((n), dtype=np.float32))
    entry["gt_overlaps"] = scipy.sparse.csr_matrix(
        np.append(entry["gt_overlaps"].toarray(), gt_overlaps, axis=0))
    entry["is_crowd"] = np.append(entry["is_crowd"], np.zeros((n), dtype=bool))
    entry["box_to_gt_ind_map"] = np.append(entry["box_to_gt_ind_map"], box_to_gt)


def _filter_crowd(entry: dict, thresh: float) -> None:
    from pycocotools import mask as mask_util

    ov = entry["gt_overlaps"].toarray()
    crowd = np.where(entry["is_crowd"] == 1)[0]
    non_gt = np.where(entry["gt_classes"] == 0)[0]
    if len(crowd) == 0 or len(non_gt) == 0:
        return

    def xywh(b: np.ndarray) -> np.ndarray:
        return np.hstack((b[:, 0:2], b[:, 2:4] - b[:, 0:2] + 1))

    ious = mask_util.iou(xywh(entry["boxes"][non_gt, :]), xywh(entry["boxes"][crowd, :]),
                         [1] * len(crowd))
    bad = np.where(ious.max(axis=1) > thresh)[0]
    ov[non_gt[bad], :] = -1
    entry["gt_overlaps"] = scipy.sparse.csr_matrix(ov)


def _flip_poly(poly: list, width: int) -> list:
    flipped = np.array(poly, dtype=np.float64)
    flipped[0::2] = width - np.array(poly[0::2], dtype=np.float64) - 1
    return flipped.tolist()


def _compute_targets(entry: dict, cfg) -> np.ndarray:
    """Detectron's ``_compute_targets`` (Detectron semantics: bounding-box regression targets), per
    entry."""
    rois, overlaps, labels = entry["boxes"], entry["max_overlaps"], entry["max_classes"]
    gt_inds = np.where((entry["gt_classes"] > 0) & (entry["is_crowd"] == 0))[0]
    targets = np.zeros((rois.shape[0], 5), dtype=np.float32)
    if len(gt_inds) == 0:
        return targets
    ex_inds = np.where(overlaps >= cfg.TRAIN.BBOX_THRESH)[0]
    ex_gt = bbox_overlaps(rois[ex_inds, :], rois[gt_inds, :])
    assign = ex_gt.argmax(axis=1) if ex_inds.size else np.zeros(0, np.int64)
    targets[ex_inds, 0] = 1 if cfg.MODEL.CLS_AGNOSTIC_BBOX_REG else labels[ex_inds]
    if ex_inds.size:
        targets[ex_inds, 1:] = bbox_transform_targets(rois[ex_inds, :], rois[gt_inds[assign], :],
                                                      cfg.MODEL.BBOX_REG_WEIGHTS)
    return targets


def _flipped(entry: dict, ds: ReferenceDataset) -> dict:
    width = entry["width"]
    boxes = entry["boxes"].copy()
    oldx1, oldx2 = boxes[:, 0].copy(), boxes[:, 2].copy()
    boxes[:, 0] = width - oldx2 - 1
    boxes[:, 2] = width - oldx1 - 1
    out = {k: v for k, v in entry.items() if k not in ("boxes", "segms", "gt_keypoints",
                                                        "flipped")}
    out["boxes"] = boxes
    segms = []
    for s in entry["segms"]:
        segms.append([_flip_poly(p, width) for p in s] if isinstance(s, list) else flip_rle(s))
    out["segms"] = segms
    if ds.keypoints is not None:
        kps = entry["gt_keypoints"]
        flipped = kps.copy()
        for lkp, rkp in ds.keypoint_flip_map.items():
            lid, rid = ds.keypoints.index(lkp), ds.keypoints.index(rkp)
            flipped[:, :, lid] = kps[:, :, rid]
            flipped[:, :, rid] = kps[:, :, lid]
        flipped[:, 0, :] = width - flipped[:, 0, :] - 1
        inds = np.where(flipped[:, 2, :] == 0)
        flipped[inds[0], 0, inds[1]] = 0
        out["gt_keypoints"] = flipped
    out["flipped"] = True
    return out


def reference_combined_roidb(datasets: Sequence[ReferenceDataset],
                             proposal_files: Sequence[Optional[str]], cfg) -> list[dict]:
    """Detectron's ``combined_roidb_for_training`` (Detectron semantics: roidb building) as a list
    of dicts."""
    t = cfg.TRAIN
    out: list[dict] = []
    for ds, pf in zip(datasets, proposal_files):
        roidb = ds.get_roidb(gt=True, proposal_file=pf, proposal_limit=t.PROPOSAL_LIMIT,
                             crowd_filter_thresh=t.CROWD_FILTER_THRESH,
                             gt_min_area=t.GT_MIN_AREA)
        if t.USE_FLIPPED:
            roidb.extend([_flipped(e, ds) for e in roidb])
        out.extend(roidb)

    def valid(e: dict) -> bool:
        mo = e["max_overlaps"]
        ok = bool(((mo >= t.FG_THRESH) | ((mo < t.BG_THRESH_HI) & (mo >= t.BG_THRESH_LO))).any())
        if cfg.MODEL.KEYPOINTS_ON:
            ok = ok and e["has_visible_keypoints"]
        return ok

    out = [e for e in out if valid(e)]
    for e in out:
        e["bbox_targets"] = _compute_targets(e, cfg)
    return out
