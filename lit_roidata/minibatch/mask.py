"""Mask R-CNN targets for the sampled RoIs of one image (Detectron semantics: mask targets).

Faithful to Detectron for polygons: each fg RoI takes the gt whose polygon *bounding box*
has the highest IoU (ties to the first), rasterised by pycocotools at ``M x M`` relative to
the RoI with ``w = max(x2 - x1, 1)`` (no +1, Detectron quirk Q25). Where Detectron crashes
(Q24) a non-crowd gt with no usable polygon is matched through its gt box and gets an all
``-1`` target, and a non-crowd RLE is sampled at the centres of the ``M x M`` grid.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping, Sequence

import cv2
import numpy as np
import pycocotools.mask as mask_util

from lit_roidata.boxes import bbox_overlaps
from lit_roidata.minibatch.fpn import rois_blob

__all__ = ["polys_to_boxes", "add_mask_rcnn_blobs", "expand_class_specific_masks",
           "rasterize_segms_in_boxes", "segm_as_rle", "segm_polygons", "rle_counts",
           "decode_rle_into"]


def segm_as_rle(segm: Any, height: int, width: int) -> dict | None:
    """A compressed RLE dict for an RLE segm (dict, or Detectron quirk Q12's
    (docs/detectron_quirks.md) one-element list), else None."""
    if isinstance(segm, list) and len(segm) == 1 and isinstance(segm[0], Mapping):
        segm = segm[0]
    if not isinstance(segm, Mapping):
        return None
    rle = dict(segm)
    if isinstance(rle.get("counts"), list):
        h, w = rle.get("size", (height, width))
        return mask_util.frPyObjects(rle, int(h), int(w))
    if isinstance(rle.get("counts"), str):
        rle["counts"] = rle["counts"].encode("ascii")
    return rle


def segm_polygons(segm: Any) -> list[np.ndarray]:
    """Polygon parts with >= 3 points as float32 arrays (Detectron's polygon dtype)."""
    if not isinstance(segm, list) or (segm and isinstance(segm[0], Mapping)):
        return []
    return [np.asarray(p, dtype=np.float32) for p in segm if len(p) >= 6]


def rle_counts(counts: bytes | str) -> np.ndarray:
    """The run lengths (int64) of a pycocotools compressed RLE string.

    Vectorised inverse of pycocotools' ``rleToString``: 5-bit groups (+48), bit 0x20
    continues a count, bit 0x10 of its last group is the sign, and from the 4th count
    on each count is stored as the difference to the count two before it.
    """
    if isinstance(counts, str):
        counts = counts.encode("ascii")
    a = np.frombuffer(counts, dtype=np.uint8) - np.uint8(48)
    ends = np.flatnonzero(a < 32)  # the last group of each count (no continuation bit)
    n = ends.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.intp)
    a = a[:ends[-1] + 1]
    first = np.repeat(starts, ends - starts + 1)  # each group's first position, at every group
    shift = (np.arange(a.size) - first) * 5
    vals = np.add.reduceat((a & 31).astype(np.int64) << shift, starts)
    neg = (a[ends] & 16) != 0
    if neg.any():  # sign-extend from the last group
        vals[neg] |= np.int64(-1) << (shift[ends[neg]] + 5)
    if n > 3:  # undo the differences: counts 3, 5, ... and 4, 6, ... are running sums
        vals[3::2] = np.cumsum(vals[1::2])[1:]
        vals[4::2] = np.cumsum(vals[2::2])[1:]
    return vals


def decode_rle_into(counts: bytes | str, out: np.ndarray) -> None:
    """Write the mask of a compressed RLE into ``out`` (``(h, w)`` uint8, already zeros).

    Same values as ``pycocotools.mask.decode`` without its full-image temporary and
    transposed copy: only the image columns between the first and the last foreground
    pixel are expanded (column-major, as RLE runs are) and transposed into ``out``.
    """
    h = out.shape[0]
    ends = np.cumsum(rle_counts(counts))
    n_fg = ends.size // 2
    st, en = ends[0:2 * n_fg:2], ends[1::2]  # foreground runs [st, en) in column-major order
    nz = en > st
    if not nz.any():
        return
    st, en = st[nz], en[nz]
    x0, x1 = int(st[0]) // h, (int(en[-1]) - 1) // h + 1
    # bg, fg, bg, ..., fg, bg from the column x0 to the column x1
    runs = np.diff(np.concatenate(([x0 * h], np.stack([st, en], 1).ravel(), [x1 * h])))
    values = (np.arange(runs.size) % 2).astype(np.uint8)
    cols = np.repeat(values, runs).reshape(x1 - x0, h)  # (columns, rows)
    dst = out[:, x0:x1]
    res = cv2.transpose(cols, dst)
    if not np.shares_memory(res, dst):  # OpenCV could not write in place
        dst[...] = res


def polys_to_boxes(polys: Sequence[Sequence[Sequence[float]]]) -> np.ndarray:
    """Tight ``[min x, min y, max x, max y]`` over all parts of each polygon (no +1)."""
    out = np.zeros((len(polys), 4), dtype=np.float32)
    for i, poly in enumerate(polys):
        xs = np.concatenate([np.asarray(p, dtype=np.float64)[0::2] for p in poly])
        ys = np.concatenate([np.asarray(p, dtype=np.float64)[1::2] for p in poly])
        out[i] = (xs.min(), ys.min(), xs.max(), ys.max())
    return out


def _rasterize_rle(rle: dict, box: np.ndarray, M: int) -> np.ndarray:
    """Sample a decoded RLE at the centres of the ``M x M`` grid over ``box``."""
    full = mask_util.decode(rle)
    centres = (np.arange(M, dtype=np.float64) + 0.5) / M
    xs, ys = (np.floor(box[k] + centres * max(float(box[k + 2] - box[k]), 1.0)).astype(np.int64)
              for k in (0, 1))
    inside = ((ys[:, None] >= 0) & (ys[:, None] < full.shape[0])
              & (xs[None, :] >= 0) & (xs[None, :] < full.shape[1]))
    grid = full[np.clip(ys, 0, full.shape[0] - 1)[:, None],
                np.clip(xs, 0, full.shape[1] - 1)[None, :]]
    return ((grid > 0) & inside).reshape(-1)


def rasterize_segms_in_boxes(segms: Sequence[Any], boxes: np.ndarray, M: int, height: int,
                             width: int) -> np.ndarray:
    """``(n, M*M)`` int32 binary masks of ``segms[i]`` inside ``boxes[i]``; -1 rows where
    the segm is empty (no usable polygon and not RLE).

    Polygon vertices of all boxes are normalised in one vectorised step (float32, as
    Detectron) and rasterised by a single pycocotools call; RLE segms are sampled at
    the grid centres.
    """
    boxes = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    masks = np.zeros((len(segms), M * M), dtype=np.int32)
    poly_rows: list[int] = []
    row_parts: list[list[np.ndarray]] = []
    cache: dict[int, list[np.ndarray]] = {}  # a gt's segm is shared by many RoIs
    for i, segm in enumerate(segms):
        if (parts := cache.get(id(segm))) is None:
            parts = cache[id(segm)] = segm_polygons(segm)
        if parts:
            poly_rows.append(i)
            row_parts.append(parts)
            continue
        rle = segm_as_rle(segm, height, width)
        # Detectron quirk Q24 (docs/detectron_quirks.md): -1 = ignore
        masks[i] = -1 if rle is None else _rasterize_rle(rle, boxes[i], M)
    if not poly_rows:
        return masks
    parts_all = [p for parts in row_parts for p in parts]
    coords = np.concatenate(parts_all)
    rows = np.asarray(poly_rows)
    parts_per_row = [len(parts) for parts in row_parts]
    # one owner per vertex
    owner = np.repeat(rows, [sum(len(p) for p in parts) // 2 for parts in row_parts])
    for k in (0, 1):  # x, then y: relative to the box, M / width (height), at least 1
        extent = np.maximum(boxes[:, k + 2] - boxes[:, k], 1)
        coords[k::2] = (coords[k::2] - boxes[owner, k]) * M / extent[owner]
    parts_all = np.split(coords.astype(np.float64), np.cumsum([len(p) for p in parts_all])[:-1])
    decoded = mask_util.decode(mask_util.frPyObjects(parts_all, M, M))  # (M, M, parts), F order
    by_part = decoded.transpose(2, 1, 0).reshape(len(parts_all), M * M)  # C order [part, x, y]
    # the union of each row's parts (consecutive, at least one per row)
    union = np.maximum.reduceat(by_part, np.r_[0, np.cumsum(parts_per_row)[:-1]], axis=0)
    masks[rows] = union.reshape(len(rows), M, M).transpose(0, 2, 1).reshape(len(rows), M * M)
    return masks


def expand_class_specific_masks(masks: np.ndarray, class_labels: np.ndarray, num_classes: int,
                                *, alloc: Any = None) -> np.ndarray:
    """``(n, C*M*M)`` filled with -1, the mask copied into slot ``cls`` when ``cls > 0``.

    ``alloc(shape, dtype)`` may place the (large) result, e.g. in shared memory.
    """
    n, m2 = masks.shape
    cls = np.asarray(class_labels).astype(np.int64).reshape(-1)
    if cls.size and cls.max() >= num_classes:
        raise ValueError(f"mask target class {int(cls.max())} is >= MODEL.NUM_CLASSES "
                         f"({num_classes}); set MODEL.NUM_CLASSES to the dataset's class "
                         "count plus one (background)")
    out = (alloc or np.empty)((n, num_classes, m2), np.dtype(np.int32))
    out.fill(-1)
    rows = np.flatnonzero(cls > 0)
    out[rows, cls[rows]] = masks[rows]
    return out.reshape(n, num_classes * m2)


def add_mask_rcnn_blobs(blobs: MutableMapping[str, Any], sampled_boxes: np.ndarray,
                        entry: Mapping[str, Any], im_scale: float, batch_idx: int,
                        cfg: Any, *, expand: bool = True) -> None:
    """Add ``mask_rois``, ``roi_has_mask_int32``, ``masks_int32`` for one image.

    With ``expand=False`` the class-specific expansion is left to the caller:
    ``masks_int32`` stays ``(n, M*M)`` and ``_mask_class_labels`` holds the classes
    (:func:`~lit_roidata.minibatch.fast_rcnn.add_fast_rcnn_blobs` expands the whole
    minibatch at once into one array, saving a copy of the largest blob).

    Args:
        blobs: the image's Fast R-CNN blobs (``labels_int32`` is read).
        sampled_boxes: the sampled RoIs in original image coordinates.
        entry: the roidb entry (``gt_classes``, ``is_crowd``, ``segms``, ``boxes``).
        im_scale: the image's scale; batch_idx: its position in the minibatch.
        cfg: ``MRCNN.RESOLUTION``, ``MRCNN.CLS_SPECIFIC_MASK``, ``MODEL.NUM_CLASSES``.
    """
    M, height, width = int(cfg.MRCNN.RESOLUTION), int(entry["height"]), int(entry["width"])
    labels = blobs["labels_int32"]
    gt_classes = np.asarray(entry["gt_classes"])
    is_crowd = np.asarray(entry["is_crowd"]).astype(bool)
    n_gt = len(entry["segms"])
    gt_rows = np.where((gt_classes[:n_gt] > 0) & ~is_crowd[:n_gt])[0]
    fg_inds = np.where(labels > 0)[0]
    roi_has_mask = labels.copy()
    roi_has_mask[roi_has_mask > 0] = 1
    # without a fg RoI: one bg RoI (class 0) with an all -1 target
    take = fg_inds if fg_inds.size else np.where(labels == 0)[0][:1]
    roi_has_mask[take] = 1
    class_labels = labels[take]
    rois_fg = sampled_boxes[take].reshape((-1, 4)).astype(np.float32, copy=False)
    if fg_inds.size and gt_rows.size:
        segms = [entry["segms"][i] for i in gt_rows]
        # the segm's box; without a usable segm, the gt box (Detectron quirk Q24)
        match_boxes = np.asarray(entry["boxes"], dtype=np.float32)[gt_rows]
        for j, segm in enumerate(segms):
            if parts := segm_polygons(segm):
                match_boxes[j] = polys_to_boxes([parts])[0]
            elif (rle := segm_as_rle(segm, height, width)) is not None:
                x, y, w, h = mask_util.toBbox(rle)
                match_boxes[j] = (x, y, x + w, y + h)
        best = np.argmax(bbox_overlaps(rois_fg, match_boxes), axis=1)
        masks = rasterize_segms_in_boxes([segms[b] for b in best], rois_fg, M, height, width)
    else:  # or fg only through crowd boxes (Detectron quirk Q8, docs/detectron_quirks.md)
        masks = np.full((take.size, M * M), -1, dtype=np.int32)
    if cfg.MRCNN.CLS_SPECIFIC_MASK and expand:
        masks = expand_class_specific_masks(masks, class_labels, int(cfg.MODEL.NUM_CLASSES))
    elif cfg.MRCNN.CLS_SPECIFIC_MASK:
        blobs["_mask_class_labels"] = np.asarray(class_labels, dtype=np.int64)
    blobs["mask_rois"] = rois_blob(rois_fg * im_scale, batch_idx)
    blobs["roi_has_mask_int32"] = roi_has_mask.astype(np.int32, copy=False)
    blobs["masks_int32"] = masks
