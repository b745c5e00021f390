"""COCO JSON → columnar ground-truth table, with Detectron's cleaning rules (spec §2.2-2.4).

The JSON is parsed with ``orjson`` and every per-annotation rule is a vectorised NumPy
expression over whole columns; the only Python loops left are the field extractions
(one generator per field) and the segmentation flattening. Detectron goes through
``pycocotools.COCO``, whose index building alone costs more than our whole build.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter, methodcaller
from typing import Any, Callable, Optional, Sequence

import numpy as np
import orjson

from lit_roidata.roidb.info import DatasetInfo, RoIDBInputError, keypoint_flip_map
from lit_roidata.roidb.segms import SegmColumns, encode_segms

__all__ = ["GtTable", "load_coco_json", "read_json", "dataset_info_from_categories"]

logger = logging.getLogger(__name__)


@dataclass
class GtTable:
    """One dataset's images (sorted by id) and cleaned gt rows, as columns.

    Attributes:
        info: the dataset's :class:`DatasetInfo`.
        ids, widths, heights: per image, ascending id.
        file_names: per image, JSON ``file_name``.
        gt_off: int64 (n+1,) gt row range per image.
        boxes, classes, seg_areas, is_crowd: per gt row (spec §2.4).
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


def read_json(path: str) -> Any:
    """Parse a JSON file with orjson.

    Raises:
        RoIDBInputError: malformed JSON, naming the file, line, column and byte offset.
    """
    with open(path, "rb") as fh:
        raw = fh.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RoIDBInputError(
            f"{path}: malformed JSON at line {exc.lineno}, column {exc.colno} (byte {exc.pos}): "
            f"{exc.msg}. Re-export or repair the file; a truncated download is a common "
            f"cause.") from None


def dataset_info_from_categories(name: str, categories: Sequence[dict], *, source: str,
                                 class_order: Optional[Sequence[str]] = None) -> DatasetInfo:
    """Classes and id maps in the order of the JSON ``categories`` array (spec §2.2).

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


def _column(items: list, key: str, dtype: Any, *, source: str, what: str,
            default: Any = None) -> np.ndarray:
    """``np.array([it[key] for it in items])`` with an error naming the offending record."""
    get: Callable[[dict], Any] = (itemgetter(key) if default is None
                                  else methodcaller("get", key, default))
    try:
        return np.fromiter(map(get, items), dtype, len(items))
    except (KeyError, TypeError, ValueError):
        for i, it in enumerate(items):
            try:
                np.asarray(get(it), dtype=dtype).reshape(())
            except (KeyError, TypeError, ValueError, AttributeError):
                rid = it.get("id") if isinstance(it, dict) else None
                raise RoIDBInputError(
                    f"{source}: {what} #{i} (id {rid}) has a missing or non-numeric {key!r} "
                    f"(got {it.get(key) if isinstance(it, dict) else it!r}); fix that "
                    f"record.") from None
        raise


def _images(data: dict, source: str) -> tuple[np.ndarray, list, np.ndarray, np.ndarray, list]:
    images = data.get("images")
    if not isinstance(images, list):
        raise RoIDBInputError(f"{source}: no 'images' list at the top level; is this a "
                              f"COCO-format annotation file?")
    ids = _column(images, "id", np.int64, source=source, what="image")
    order = np.argsort(ids, kind="stable")
    ids = ids[order]
    dup = ids[1:][ids[1:] == ids[:-1]]
    if dup.size:
        raise RoIDBInputError(f"{source}: duplicate image ids {np.unique(dup)[:10].tolist()} "
                              f"({dup.size} duplicates); image ids must be unique")
    sorted_images = [images[i] for i in order]
    widths = _column(sorted_images, "width", np.float64, source=source, what="image")
    heights = _column(sorted_images, "height", np.float64, source=source, what="image")
    bad = np.flatnonzero((widths <= 0) | (heights <= 0) | (widths != np.floor(widths))
                         | (heights != np.floor(heights)))
    if bad.size:
        ex = ", ".join(f"id {int(ids[i])} ({widths[i]:g}x{heights[i]:g})" for i in bad[:5])
        raise RoIDBInputError(
            f"{source}: {bad.size} image(s) have a width or height that is not a positive "
            f"integer: {ex}. Fix 'width'/'height' in the JSON (read them from the image files) "
            f"or remove those images.")
    try:
        names = [str(im["file_name"]) for im in sorted_images]
    except KeyError:
        i = next(i for i, im in enumerate(sorted_images) if "file_name" not in im)
        raise RoIDBInputError(f"{source}: image id {int(ids[i])} has no 'file_name'") from None
    return ids, names, widths.astype(np.int32), heights.astype(np.int32), sorted_images


def load_coco_json(path: str, *, name: str, gt_min_area: float = -1,
                   class_order: Optional[Sequence[str]] = None,
                   data: Optional[dict] = None) -> GtTable:
    """Load one COCO annotation file into a :class:`GtTable` (spec §2.2-2.4).

    Args:
        path: the annotation JSON.
        name: the dataset's catalog name.
        gt_min_area: ``TRAIN.GT_MIN_AREA``; objects with JSON ``area`` below it are dropped.
        class_order: shared class names for ``category_policy="by_name"``.
        data: the already parsed JSON (skips reading ``path``).

    Raises:
        RoIDBInputError: malformed JSON, duplicate ids, bad sizes, unknown category ids,
            malformed bboxes/segmentations, keypoint annotations missing or of wrong length.
    """
    if data is None:
        data = read_json(path)
    if not isinstance(data, dict):
        raise RoIDBInputError(f"{path}: expected a JSON object at the top level")
    info = dataset_info_from_categories(name, data.get("categories") or [], source=path,
                                        class_order=class_order)
    ids, names, widths, heights, _ = _images(data, path)
    anns = data.get("annotations") or []
    counts: Counter = Counter()
    n = len(ids)
    a_img = _column(anns, "image_id", np.int64, source=path, what="annotation")
    pos = np.minimum(np.searchsorted(ids, a_img), max(n - 1, 0))
    known = (ids[pos] == a_img) if n else np.zeros(len(anns), bool)
    counts["annotation_unknown_image"] = int((~known).sum())
    if counts["annotation_unknown_image"]:
        logger.warning("%s: %d annotation(s) refer to image ids not in 'images' (e.g. %s); "
                       "ignored, as pycocotools does", path, counts["annotation_unknown_image"],
                       np.unique(a_img[~known])[:5].tolist())
    area = _column(anns, "area", np.float64, source=path, what="annotation")
    crowd = _column(anns, "iscrowd", np.int64, source=path, what="annotation", default=0)
    ignore = _column(anns, "ignore", np.float64, source=path, what="annotation", default=0)
    bbox = _bboxes(anns, path)
    keep = known.copy()
    small = keep & (area < gt_min_area)
    counts["gt_min_area"] = int(small.sum())
    keep &= ~small
    ign = keep & (ignore == 1)
    counts["ignore"] = int(ign.sum())
    keep &= ~ign
    x1, y1 = bbox[:, 0], bbox[:, 1]
    x2 = x1 + np.maximum(0.0, bbox[:, 2] - 1.0)
    y2 = y1 + np.maximum(0.0, bbox[:, 3] - 1.0)
    w_img = widths[pos].astype(np.float64)
    h_img = heights[pos].astype(np.float64)
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
    classes = _classes(anns, order, info, path, ids[pos[order]])
    ann_ids = np.array([anns[i].get("id", -1) for i in order], dtype=np.int64)
    segms, seg_counts = encode_segms([anns[i].get("segmentation") for i in order], source=path,
                                     ann_ids=ann_ids, image_ids=ids[pos[order]])
    counts.update(seg_counts)
    keypoints, has_vis = None, np.zeros(n, bool)
    if info.keypoints is not None:
        keypoints = _keypoints(anns, order, info.num_keypoints, path, ann_ids, ids[pos[order]])
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


def _bboxes(anns: list, path: str) -> np.ndarray:
    try:
        boxes = [a["bbox"] for a in anns]
        lens = np.fromiter(map(len, boxes), np.int64, len(boxes))
        if lens.size and (lens != 4).any():
            raise ValueError
        return np.fromiter(chain.from_iterable(boxes), np.float64, 4 * len(boxes)).reshape(-1, 4)
    except (KeyError, TypeError, ValueError):
        for i, a in enumerate(anns):
            b = a.get("bbox") if isinstance(a, dict) else None
            try:
                if np.asarray(b, np.float64).shape != (4,):
                    raise ValueError
            except (TypeError, ValueError):
                raise RoIDBInputError(
                    f"{path}: annotation id {a.get('id')} (image id {a.get('image_id')}) has "
                    f"bbox {b!r}; expected [x, y, width, height]. Fix or remove it.") from None
        raise


def _classes(anns: list, order: np.ndarray, info: DatasetInfo, path: str,
             img_ids: np.ndarray) -> np.ndarray:
    cat = np.fromiter((anns[i]["category_id"] for i in order), np.int64, order.size)
    j2c = info.json_category_id_to_contiguous_id
    keys = np.array(sorted(j2c), dtype=np.int64)
    vals = np.array([j2c[k] for k in keys.tolist()], dtype=np.int32)
    p = np.minimum(np.searchsorted(keys, cat), max(len(keys) - 1, 0))
    ok = (keys[p] == cat) if len(keys) else np.zeros(cat.size, bool)
    if not ok.all():
        bad = np.flatnonzero(~ok)
        ex = ", ".join(f"annotation id {anns[order[i]].get('id')} (image id {int(img_ids[i])}): "
                       f"category_id {int(cat[i])}" for i in bad[:5])
        raise RoIDBInputError(
            f"{path}: {bad.size} annotation(s) use category ids missing from 'categories' "
            f"({ex}); known ids: {keys.tolist()[:100]}. Add the categories or fix the ids.")
    return vals[p]


def _keypoints(anns: list, order: np.ndarray, k: int, path: str, ann_ids: np.ndarray,
               img_ids: np.ndarray) -> np.ndarray:
    kps = [anns[i].get("keypoints") for i in order]
    missing = [j for j, v in enumerate(kps) if v is None]
    if missing:
        ex = ", ".join(f"annotation id {int(ann_ids[j])} (image id {int(img_ids[j])})"
                       for j in missing[:5])
        raise RoIDBInputError(
            f"{path}: this is a keypoint dataset (category 'person' lists {k} keypoints) but "
            f"{len(missing)} annotation(s) have no 'keypoints' field: {ex}. Add "
            f"'keypoints': [0, 0, 0] * {k} for objects without keypoints (Detectron crashes "
            f"here, spec Q23).")
    lens = np.fromiter(map(len, kps), np.int64, len(kps))
    bad = np.flatnonzero(lens != 3 * k)
    if bad.size:
        j = int(bad[0])
        raise RoIDBInputError(
            f"{path}: annotation id {int(ann_ids[j])} (image id {int(img_ids[j])}) has "
            f"{int(lens[j])} keypoint values, expected 3 x {k} = {3 * k} ({bad.size} such "
            f"annotations). Fix the 'keypoints' lists.")
    n = 3 * k * len(kps)
    try:  # integer fast path; Python floats are truncated toward zero, like Detectron
        flat = np.fromiter(chain.from_iterable(kps), np.int64, n)
    except (TypeError, ValueError, OverflowError):
        flat = np.fromiter(chain.from_iterable(kps), np.float64, n)
    # (G, K, 3) -> (G, 3, K); the int32 cast truncates toward zero, like Detectron.
    return np.ascontiguousarray(flat.reshape(-1, k, 3).transpose(0, 2, 1)).astype(np.int32)
