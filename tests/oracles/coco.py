"""Test oracle: ``lit_roidata.roidb.coco`` as it was before the cold-build speed-ups.

Kept verbatim (only this docstring differs) so that tests can compare the current
``table_from_raw`` (keypoint range check by reductions, keypoint table cast on
assignment, polygon coordinates gathered by a mask) with the previous one, bit for bit.
Tests only; not part of the package.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from lit_roidata.roidb.decode import SEG_MISSING, SEG_RLE, RawCoco, decode_coco
from lit_roidata.roidb.decode import decode_generic, read_json
from lit_roidata.roidb.info import DatasetInfo, RoIDBInputError, keypoint_flip_map
from lit_roidata.roidb.segms import POLY, SegmColumns, rle_columns, rle_string_counts
from lit_roidata.roidb.segms import take_ranges

__all__ = ["GtTable", "load_coco_json", "table_from_raw", "read_json",
           "dataset_info_from_categories", "keypoint_category_ids"]

logger = logging.getLogger(__name__)


@dataclass
class GtTable:
    """One dataset's images (sorted by id) and cleaned gt rows, as columns.

    Attributes:
        info: the dataset's :class:`DatasetInfo`.
        ids, widths, heights: per image, ascending id.
        file_names: per image, JSON ``file_name``.
        gt_off: int64 (n+1,) gt row range per image.
        boxes, classes, seg_areas, is_crowd: per gt row (Detectron semantics: ground-truth
        cleaning).
        segms: :class:`SegmColumns` per gt row.
        keypoints: int32 (G, 3, K) or ``None``; has_vis_kp: bool per image.
        counts: drop/keep counts by reason (for the build report).
    """

    info: DatasetInfo
    ids: np.ndarray
    widths: np.ndarray
    heights: np.ndarray
    file_names: list
    gt_off: np.ndarray
    boxes: np.ndarray
    classes: np.ndarray
    seg_areas: np.ndarray
    is_crowd: np.ndarray
    segms: SegmColumns
    keypoints: Optional[np.ndarray]
    has_vis_kp: np.ndarray
    counts: Counter
    image_lists: Optional[dict] = None  # LVIS only; COCO files have none


def dataset_info_from_categories(name: str, categories: Sequence[dict], *, source: str,
                                 class_order: Optional[Sequence[str]] = None) -> DatasetInfo:
    """Classes and id maps in the order of the JSON ``categories`` array (Detectron semantics:
    datasets and catalog).

    Args:
        class_order: if given (``category_policy="by_name"``), the shared class names
            (without background); categories map to their position in it by name.
    """
    try:
        cat_ids = [int(c["id"]) for c in categories]
        cat_names = [str(c["name"]) for c in categories]
    except (KeyError, TypeError, ValueError) as exc:
        raise RoIDBInputError(f"{source}: every entry of 'categories' needs an integer 'id' "
                              f"and a 'name' ({type(exc).__name__}: {exc})") from None
    dup = [k for k, v in Counter(cat_ids).items() if v > 1]
    if dup:
        raise RoIDBInputError(f"{source}: duplicate category ids {dup[:10]}; ids must be unique")
    if class_order is None:
        classes = ("__background__", *cat_names)
        j2c = {cid: i + 1 for i, cid in enumerate(cat_ids)}
    else:
        classes = ("__background__", *class_order)
        pos = {n: i + 1 for i, n in enumerate(class_order)}
        j2c = {cid: pos[n] for cid, n in zip(cat_ids, cat_names)}
    keypoints = None
    for c in categories:
        if c.get("name") == "person" and c.get("keypoints"):
            keypoints = tuple(str(k) for k in c["keypoints"])
    return DatasetInfo(
        name=name, classes=classes, json_category_id_to_contiguous_id=j2c,
        contiguous_category_id_to_json_id={v: k for k, v in j2c.items()},
        keypoints=keypoints,
        keypoint_flip_map=None if keypoints is None else keypoint_flip_map(keypoints))




def keypoint_category_ids(categories: Sequence[Any]) -> list[int]:
    """JSON ids of the categories whose keypoints the roidb reads (``person`` with keypoints)."""
    return [int(c["id"]) for c in categories if isinstance(c, dict)
            and c.get("name") == "person" and c.get("keypoints")]


def load_coco_json(path: str, *, name: str, gt_min_area: float = -1,
                   class_order: Optional[Sequence[str]] = None,
                   data: Optional[dict] = None, raw: Optional[RawCoco] = None,
                   keypoints_required: bool = False) -> GtTable:
    """Load one COCO annotation file into a :class:`GtTable` (Detectron semantics: datasets and
    catalog; ground-truth cleaning).

    Args:
        path: the annotation JSON.
        name: the dataset's catalog name.
        gt_min_area: ``TRAIN.GT_MIN_AREA``; objects with JSON ``area`` below it are dropped.
        class_order: shared class names for ``category_policy="by_name"``.
        data: the already parsed JSON (decoded with the generic decoder).
        raw: the already decoded columns (:func:`lit_roidata.roidb.decode.decode_coco`).
        keypoints_required: the model trains keypoints (``MODEL.KEYPOINTS_ON``): every
            annotation of the keypoint category must carry keypoints.

    Raises:
        RoIDBInputError: malformed JSON, duplicate ids, bad sizes, unknown category ids,
            malformed bboxes/segmentations/keypoints (see ``docs/roidb.md``).
    """
    if raw is None:
        raw = decode_generic(data, path) if data is not None else decode_coco(path)
    return table_from_raw(raw, name=name, gt_min_area=gt_min_area, class_order=class_order,
                          keypoints_required=keypoints_required)


def _fail(raw: RawCoco, rows: np.ndarray, problem: str, fix: str) -> None:
    """Raise the error for the first of ``rows`` (annotation positions) having ``problem``."""
    i = int(rows[0])
    more = f" ({rows.size} annotations have this problem)" if rows.size > 1 else ""
    raise RoIDBInputError(f"{raw.source}: {raw.ann_label(i)} {problem}{more}. {fix}")


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def table_from_raw(raw: RawCoco, *, name: str, gt_min_area: float = -1,
                   class_order: Optional[Sequence[str]] = None,
                   keypoints_required: bool = False) -> GtTable:
    """Validate and clean decoded columns into a :class:`GtTable` (see :func:`load_coco_json`)."""
    path = raw.source
    info = dataset_info_from_categories(name, raw.categories, source=path,
                                        class_order=class_order)
    order_img = np.argsort(raw.img_id, kind="stable")
    ids = raw.img_id[order_img]
    dup = ids[1:][ids[1:] == ids[:-1]]
    if dup.size:
        raise RoIDBInputError(f"{path}: duplicate image ids {np.unique(dup)[:10].tolist()} "
                              f"({dup.size} duplicates); image ids must be unique")
    widths, heights = raw.img_w[order_img], raw.img_h[order_img]
    with np.errstate(invalid="ignore"):
        bad = np.flatnonzero(~((widths > 0) & (heights > 0) & (widths == np.floor(widths))
                               & (heights == np.floor(heights)) & (widths < 2 ** 31)
                               & (heights < 2 ** 31)))
    if bad.size:
        ex = ", ".join(f"id {int(ids[i])} ({widths[i]:g}x{heights[i]:g})" for i in bad[:5])
        raise RoIDBInputError(
            f"{path}: {bad.size} image(s) have a width or height that is not a positive "
            f"integer: {ex}. Fix 'width'/'height' in the JSON (read them from the image files) "
            f"or remove those images.")
    names = [raw.file_names[i] for i in order_img.tolist()]
    widths, heights = widths.astype(np.int32), heights.astype(np.int32)
    n = len(ids)
    counts: Counter = Counter()
    a_img = raw.ann_img
    pos = np.minimum(np.searchsorted(ids, a_img), max(n - 1, 0))
    known = (ids[pos] == a_img) if n else np.zeros(len(a_img), bool)
    counts["annotation_unknown_image"] = int((~known).sum())
    if counts["annotation_unknown_image"]:
        logger.warning("%s: %d annotation(s) refer to image ids not in 'images' (e.g. %s); "
                       "ignored, as pycocotools does", path, counts["annotation_unknown_image"],
                       np.unique(a_img[~known])[:5].tolist())
    w_img = widths[pos].astype(np.float64)
    h_img = heights[pos].astype(np.float64)
    _check_polygons(raw, known)
    rle_rows = _check_rles(raw, known, h_img, w_img)
    kp_table = _check_keypoints(raw, known, info, keypoints_required)

    area, crowd, ignore, bbox = raw.ann_area, raw.ann_crowd, raw.ann_ignore, raw.ann_bbox
    keep = known.copy()
    with np.errstate(invalid="ignore"):
        small = keep & (area < gt_min_area)
    counts["gt_min_area"] = int(small.sum())
    keep &= ~small
    ign = keep & (ignore == 1)
    counts["ignore"] = int(ign.sum())
    keep &= ~ign
    x1, y1 = bbox[:, 0], bbox[:, 1]
    with np.errstate(invalid="ignore"):
        x2 = x1 + np.maximum(0.0, bbox[:, 2] - 1.0)
        y2 = y1 + np.maximum(0.0, bbox[:, 3] - 1.0)
        x1 = np.minimum(w_img - 1.0, np.maximum(0.0, x1))
        y1 = np.minimum(h_img - 1.0, np.maximum(0.0, y1))
        x2 = np.minimum(w_img - 1.0, np.maximum(0.0, x2))
        y2 = np.minimum(h_img - 1.0, np.maximum(0.0, y2))
    nonfinite = keep & ~np.isfinite(bbox).all(axis=1)
    counts["non_finite_bbox"] = int(nonfinite.sum())
    keep &= ~nonfinite
    bad_area = keep & ~(area > 0)
    counts["non_positive_area"] = int(bad_area.sum())
    keep &= ~bad_area
    degenerate = keep & ~((x2 > x1) & (y2 > y1))
    counts["degenerate_box"] = int(degenerate.sum())
    keep &= ~degenerate

    kept = np.flatnonzero(keep)
    order = kept[np.argsort(pos[kept], kind="stable")]
    gt_off = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(pos[order], minlength=n), out=gt_off[1:])
    classes = _classes(raw, order, info)
    segms, seg_counts = _segm_columns(raw, order, rle_rows)
    counts.update(seg_counts)
    keypoints, has_vis = None, np.zeros(n, bool)
    if kp_table is not None:
        keypoints = kp_table(order)
        vis = keypoints[:, 2, :].sum(axis=1) > 0
        has_vis = np.bincount(pos[order], weights=vis, minlength=n) > 0
    counts["images"] = n
    counts["gt_boxes"] = int(order.size)
    counts["gt_crowd"] = int((crowd[order] != 0).sum())
    return GtTable(
        info=info, ids=ids, widths=widths, heights=heights, file_names=names, gt_off=gt_off,
        boxes=np.stack([x1, y1, x2, y2], axis=1)[order].astype(np.float32),
        classes=classes, seg_areas=area[order].astype(np.float32),
        is_crowd=crowd[order] != 0, segms=segms, keypoints=keypoints, has_vis_kp=has_vis,
        counts=counts)


_SEG_FIX = ("A polygon is a list of numbers [x1, y1, x2, y2, ...] (at least 3 points); "
            "fix the polygon or remove it (or the annotation).")


def _check_polygons(raw: RawCoco, known: np.ndarray) -> None:
    """Odd-length or non-finite polygons of annotations of known images: a named error."""
    if not raw.coord_n.size:
        return
    owner = np.repeat(np.arange(raw.poly_n.size), raw.poly_n)
    rel = known[owner]
    odd = rel & (raw.coord_n % 2 == 1) & (raw.coord_n >= 6)
    if odd.any():
        _fail(raw, owner[odd], f"has a polygon with an odd number of coordinates "
              f"({int(raw.coord_n[np.flatnonzero(odd)[0]])})", _SEG_FIX)
    fin = np.isfinite(raw.coords)
    if not fin.all():
        c_owner = np.repeat(owner, raw.coord_n)
        bad = np.unique(c_owner[~fin & rel[np.repeat(np.arange(owner.size), raw.coord_n)]])
        if bad.size:
            _fail(raw, bad, "has a polygon coordinate that is not a finite number", _SEG_FIX)


_RLE_FIX = ("A COCO RLE is {'size': [image height, image width], 'counts': [run lengths] "
            "or 'compressed string'} whose runs cover exactly height x width pixels; "
            "re-encode the mask (pycocotools.mask.encode) or use polygons.")


def _check_rles(raw: RawCoco, known: np.ndarray, h_img: np.ndarray,
                w_img: np.ndarray) -> dict:
    """Validate the RLEs of annotations of known images; ``{row: (h, w, counts)}``."""
    out: dict = {}
    strs, str_rows = [], []
    for i, rle in raw.rles.items():
        if not known[i]:
            continue
        row = np.array([i])
        if not isinstance(rle, dict) or "counts" not in rle or "size" not in rle:
            _fail(raw, row, f"has a malformed RLE segmentation without 'size' and 'counts' "
                  f"({rle!r:.60})", _RLE_FIX)
        size, cnt = rle["size"], rle["counts"]
        if not (type(size) is list and len(size) == 2 and all(type(v) is int for v in size)):
            _fail(raw, row, f"has an RLE 'size' of {size!r:.40}, expected [height, width]",
                  _RLE_FIX)
        h, w = size
        if (h, w) != (int(h_img[i]), int(w_img[i])):
            _fail(raw, row, f"has an RLE of size [{h}, {w}] but its image is "
                  f"{int(h_img[i])} x {int(w_img[i])} (height x width); the mask would not "
                  f"line up with the image", _RLE_FIX)
        if type(cnt) is list:
            if not (set(map(type, cnt)) <= {int} and all(c >= 0 for c in cnt)):
                _fail(raw, row, "has RLE counts that are not non-negative integers", _RLE_FIX)
            if sum(cnt) != h * w:
                _fail(raw, row, f"has RLE counts summing to {sum(cnt)}, not height x width = "
                      f"{h * w}", _RLE_FIX)
            out[i] = (h, w, cnt)
        elif type(cnt) is str:
            if not cnt.isascii():
                _fail(raw, row, "has a compressed RLE string with non-ASCII characters",
                      _RLE_FIX)
            b = cnt.encode("ascii")
            strs.append(b)
            str_rows.append(i)
            out[i] = (h, w, b)
        else:
            _fail(raw, row, f"has RLE 'counts' {cnt!r:.40}; expected a list of run lengths "
                  f"or a compressed string", _RLE_FIX)
    if strs:
        c, off, bad = rle_string_counts(strs)
        cs = np.concatenate([[0], np.cumsum(c)])
        sums = cs[off[1:]] - cs[off[:-1]]
        hw = np.array([out[i][0] * out[i][1] for i in str_rows], np.int64)
        wrong = bad | (sums != hw)
        if wrong.any():
            j = int(np.flatnonzero(wrong)[0])
            what = ("a compressed RLE string that does not decode" if bad[j] else
                    f"a compressed RLE covering {int(sums[j])} pixels, not height x width = "
                    f"{int(hw[j])}")
            _fail(raw, np.array(str_rows)[wrong], f"has {what}", _RLE_FIX)
    return out


def _check_keypoints(raw: RawCoco, known: np.ndarray, info: DatasetInfo,
                     required: bool) -> Optional[Any]:
    """Validate keypoints; returns ``rows -> int32 (G, 3, K)`` or ``None`` (no keypoints)."""
    if info.keypoints is None:
        return None
    k = info.num_keypoints
    kp_len = raw.kp_len
    present = kp_len > 0  # missing, null and [] all mean "no keypoints"
    if required:
        kp_cats = np.array(keypoint_category_ids(raw.categories), np.int64)
        need = known & np.isin(raw.ann_cat, kp_cats) & ~present
        if need.any():
            rows = np.flatnonzero(need)
            ex = ", ".join(raw.ann_label(int(i)) for i in rows[:5])
            raise RoIDBInputError(
                f"{raw.source}: the model trains keypoints (MODEL.KEYPOINTS_ON) and category "
                f"'person' lists {k} keypoints, but {rows.size} 'person' annotation(s) have no "
                f"'keypoints' field: {ex}. Add 'keypoints': [0, 0, 0] * {k} for objects "
                f"without labelled keypoints (Detectron crashes here).")
    wrong = known & present & (kp_len != 3 * k)
    if wrong.any():
        rows = np.flatnonzero(wrong)
        i = int(rows[0])
        raise RoIDBInputError(
            f"{raw.source}: {raw.ann_label(i)} has {int(kp_len[i])} keypoint values, expected "
            f"3 x {k} = {3 * k} ({rows.size} such annotations). Fix the 'keypoints' lists.")
    off = _offsets(np.maximum(kp_len, 0))
    vals = raw.kp_vals
    with np.errstate(invalid="ignore"):
        bad_v = ~(np.abs(vals) < 2 ** 31)
    if bad_v.any():
        v_owner = np.repeat(np.arange(kp_len.size), np.maximum(kp_len, 0))
        rows = np.unique(v_owner[bad_v & known[v_owner]])
        if rows.size:
            _fail(raw, rows, "has a keypoint value that is not a finite number within the "
                  "int32 range", "Keypoints are [x1, y1, v1, ...] in pixels; use 0, 0, 0 for "
                  "a keypoint that is not labelled.")

    def table(rows: np.ndarray) -> np.ndarray:
        out = np.zeros((rows.size, 3 * k), np.int32)
        has = present[rows]
        sel = rows[has]
        if (kp_len[present] == 3 * k).all():  # the usual case: one (3K,) row per holder
            rank = np.cumsum(present) - 1
            picked = vals.reshape(-1, 3 * k)[rank[sel]]
        else:
            picked = vals[off[sel][:, None] + np.arange(3 * k)]
        out[has] = picked.astype(np.int32)  # truncates toward zero, like Detectron
        # (G, K, 3) -> (G, 3, K)
        return np.ascontiguousarray(out.reshape(-1, k, 3).transpose(0, 2, 1))

    return table


def _classes(raw: RawCoco, order: np.ndarray, info: DatasetInfo) -> np.ndarray:
    cat = raw.ann_cat[order]
    j2c = info.json_category_id_to_contiguous_id
    keys = np.array(sorted(j2c), dtype=np.int64)
    vals = np.array([j2c[k] for k in keys.tolist()], dtype=np.int32)
    p = np.minimum(np.searchsorted(keys, cat), max(len(keys) - 1, 0))
    ok = (keys[p] == cat) if len(keys) else np.zeros(cat.size, bool)
    if not ok.all():
        bad = np.flatnonzero(~ok)
        ex = ", ".join(f"{raw.ann_label(int(order[i]))}: category_id {int(cat[i])}"
                       for i in bad[:5])
        raise RoIDBInputError(
            f"{raw.source}: {bad.size} annotation(s) use category ids missing from "
            f"'categories' ({ex}); known ids: {keys.tolist()[:100]}. Add the categories or "
            f"fix the ids.")
    return vals[p]


def _segm_columns(raw: RawCoco, order: np.ndarray,
                  rles: dict) -> tuple[SegmColumns, dict[str, int]]:
    """:class:`SegmColumns` of rows ``order``; polygons under 6 coordinates dropped (Detectron quirk
    Q24, docs/detectron_quirks.md)."""
    g = order.size
    poly_off = _offsets(raw.poly_n)
    coord_off = _offsets(raw.coord_n)
    pidx = take_ranges(poly_off[order], raw.poly_n[order])
    row_of = np.repeat(np.arange(g), raw.poly_n[order])
    short = raw.coord_n[pidx] < 6
    pidx, row_of = pidx[~short], row_of[~short]
    poly_counts = np.bincount(row_of, minlength=g).astype(np.int64)
    coord_counts = raw.coord_n[pidx]
    if pidx.size == raw.coord_n.size and (pidx == np.arange(pidx.size)).all():
        coords = raw.coords  # every polygon kept, in file order (one file per image order)
    else:
        coords = raw.coords[take_ranges(coord_off[pidx], coord_counts)]
    seg_kind = raw.seg_kind[order]
    kind = np.full(g, POLY, np.int8)
    rle_idx = np.full(g, -1, np.int32)
    rows = np.flatnonzero(seg_kind == SEG_RLE).tolist()
    missing = int((seg_kind == SEG_MISSING).sum())
    cols = SegmColumns(
        kind=kind, poly_off=_offsets(poly_counts), coord_off=_offsets(coord_counts),
        coords=np.ascontiguousarray(coords, np.float64), rle_idx=rle_idx,
        **rle_columns(rows, [rles[int(order[j])] for j in rows], kind, rle_idx))
    empty = int(((kind == POLY) & (poly_counts == 0)).sum()) - missing
    return cols, {"polygon_lt_6_coords": int(short.sum()), "empty_segmentation": empty,
                  "missing_segmentation": missing}
