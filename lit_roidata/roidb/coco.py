"""COCO JSON → columnar ground-truth table, with Detectron's cleaning rules (Detectron semantics:
datasets and catalog; ground-truth cleaning).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np

from lit_roidata.osutil import malloc_trim
from lit_roidata.roidb.decode import SEG_MISSING, SEG_RLE, WINDOW_BYTES, RawCoco
from lit_roidata.roidb.decode import decode_generic, decode_window, iter_coco
from lit_roidata.roidb.decode import read_json
from lit_roidata.roidb.info import DatasetInfo, RoIDBInputError, keypoint_flip_map
from lit_roidata.roidb.segms import POLY, SegmColumns, rle_columns, rle_string_counts
from lit_roidata.roidb.segms import concat, offsets, take_ranges
from lit_roidata.roidb.workers import OrderedWorkers, build_workers

__all__ = ["GtTable", "load_coco_json", "table_from_raw", "table_from_windows", "read_json",
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
        image_lists: LVIS only (:func:`lit_roidata.roidb.lvis.lvis_image_lists`): per
            image ``neg_category_ids`` / ``not_exhaustive_category_ids`` as (offsets,
            contiguous classes); ``None`` for COCO.
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
    image_lists: Optional[dict] = None


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
    classes = ("__background__", *(cat_names if class_order is None else class_order))
    if class_order is None:
        j2c = {cid: i + 1 for i, cid in enumerate(cat_ids)}
    else:
        pos = {n: i + 1 for i, n in enumerate(class_order)}
        j2c = {cid: pos[n] for cid, n in zip(cat_ids, cat_names)}
    kps = [c["keypoints"] for c in categories if c.get("name") == "person" and c.get("keypoints")]
    keypoints = tuple(str(k) for k in kps[-1]) if kps else None  # the last such category
    return DatasetInfo(
        name=name, classes=classes, json_category_id_to_contiguous_id=j2c,
        contiguous_category_id_to_json_id={v: k for k, v in j2c.items()}, keypoints=keypoints,
        keypoint_flip_map=None if keypoints is None else keypoint_flip_map(keypoints))



def keypoint_category_ids(categories: Sequence[Any]) -> list[int]:
    """JSON ids of the categories whose keypoints the roidb reads (``person`` with keypoints)."""
    return [int(c["id"]) for c in categories if isinstance(c, dict)
            and c.get("name") == "person" and c.get("keypoints")]


def load_coco_json(path: str, *, name: str, gt_min_area: float = -1,
                   class_order: Optional[Sequence[str]] = None,
                   data: Optional[dict] = None, raw: Optional[RawCoco] = None,
                   keypoints_required: bool = False,
                   categories_hook: Optional[Callable[[list], Optional[Sequence[str]]]] = None,
                   window_bytes: int = WINDOW_BYTES) -> GtTable:
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
        categories_hook: called with the JSON ``categories`` once they are read; returns
            the ``class_order`` to use (the build checks and merges categories there).
        window_bytes: JSON bytes decoded at a time.

    Raises:
        RoIDBInputError: malformed JSON, duplicate ids, bad sizes, unknown category ids,
            malformed bboxes/segmentations/keypoints (see ``docs/roidb.md``).
    """
    if raw is None and data is not None:
        raw = decode_generic(data, path)
    if raw is not None:
        if categories_hook is not None:
            class_order = categories_hook(raw.categories)
        return table_from_raw(raw, name=name, gt_min_area=gt_min_area, class_order=class_order,
                              keypoints_required=keypoints_required)
    gb = _GtBuilder(path, gt_min_area, keypoints_required)
    n_workers = build_workers() if os.path.getsize(path) >= _PARALLEL_BYTES * window_bytes else 0
    with (ParallelWindows(path, n_workers, gt_min_area, keypoints_required) if n_workers
          else contextlib.nullcontext()) as mapper:
        for kind, *args in iter_coco(path, window_bytes=window_bytes, mapper=mapper):
            getattr(gb, kind)(*args)  # _GtBuilder's methods are named after the events
            if kind == "images_end" and mapper is not None:
                mapper.set_index(gb.ids, gb.widths, gb.heights)
    cats = gb.categories
    if categories_hook is not None:
        class_order = categories_hook(cats)
    info = dataset_info_from_categories(name, cats, source=path, class_order=class_order)
    return gb.finish(info, cats)


def _fail(raw: RawCoco, rows: np.ndarray, problem: str, fix: str) -> None:
    """Raise the error for the first of ``rows`` (annotation positions) having ``problem``."""
    more = f" ({rows.size} annotations have this problem)" if rows.size > 1 else ""
    raise RoIDBInputError(f"{raw.source}: {raw.ann_label(int(rows[0]))} {problem}{more}. {fix}")


def table_from_raw(raw: RawCoco, *, name: str, gt_min_area: float = -1,
                   class_order: Optional[Sequence[str]] = None,
                   keypoints_required: bool = False) -> GtTable:
    """Validate and clean decoded columns into a :class:`GtTable` (see :func:`load_coco_json`)."""
    return table_from_windows([(raw, raw)], raw.categories, source=raw.source, name=name,
                              gt_min_area=gt_min_area, class_order=class_order,
                              keypoints_required=keypoints_required)


def table_from_windows(windows: Iterable[tuple[RawCoco, RawCoco]], categories: list, *,
                       source: str, name: str, gt_min_area: float = -1,
                       class_order: Optional[Sequence[str]] = None,
                       keypoints_required: bool = False) -> GtTable:
    """A :class:`GtTable` from ``(images, annotations)`` window pairs of decoded columns
    (annotations with ``ann_base`` set), cleaned as :func:`load_coco_json` cleans a file's."""
    info = dataset_info_from_categories(name, categories, source=source, class_order=class_order)
    gb = _GtBuilder(source, gt_min_area, keypoints_required)
    for images, anns in windows:
        gb.images(images)
        gb.annotations(anns)
    return gb.finish(info, categories)


#: counts every table reports, in report order
_COUNT_KEYS = ("annotation_unknown_image", "gt_min_area", "ignore", "non_finite_bbox",
               "non_positive_area", "degenerate_box")


class _GtBuilder:
    """Images, then annotation windows, cleaned into kept-row columns; then the table."""

    def __init__(self, path: str, gt_min_area: float, keypoints_required: bool) -> None:
        self.path, self.gt_min_area, self.required = path, gt_min_area, keypoints_required
        self.img_parts, self.pending, self.parts, self.categories = [], [], [], []
        self.ids: Optional[np.ndarray] = None
        self.counts: Counter = Counter({k: 0 for k in _COUNT_KEYS})
        self.unknown_ids = np.zeros(0, np.int64)

    def end(self, categories: list) -> None:
        """The file's ``categories`` (the last event)."""
        self.categories = categories

    def images(self, w: RawCoco, base: int = 0) -> None:
        """One window of images (its ``img_*`` and ``file_names`` columns)."""
        self.img_parts.append(w)

    def images_end(self, count: int = 0) -> None:
        """Validate and sort the images; clean the annotation windows that waited."""
        if self.ids is not None:
            return
        path, parts = self.path, self.img_parts
        img_id, img_w, img_h = (
            concat([getattr(p, k) for p in parts], dt)
            for k, dt in (("img_id", np.int64), ("img_w", np.float64), ("img_h", np.float64)))
        file_names = [f for p in parts for f in p.file_names]
        self.img_parts = []
        order_img = np.argsort(img_id, kind="stable")
        ids = img_id[order_img]
        dup = ids[1:][ids[1:] == ids[:-1]]
        if dup.size:
            raise RoIDBInputError(f"{path}: duplicate image ids {np.unique(dup)[:10].tolist()} "
                                  f"({dup.size} duplicates); image ids must be unique")
        widths, heights = wh = np.stack([img_w[order_img], img_h[order_img]])
        with np.errstate(invalid="ignore"):
            bad = np.flatnonzero(~((wh > 0) & (wh == np.floor(wh)) & (wh < 2 ** 31)).all(0))
        if bad.size:
            ex = ", ".join(f"id {int(ids[i])} ({widths[i]:g}x{heights[i]:g})" for i in bad[:5])
            raise RoIDBInputError(
                f"{path}: {bad.size} image(s) have a width or height that is not a positive "
                f"integer: {ex}. Fix 'width'/'height' in the JSON (read them from the image "
                f"files) or remove those images.")
        self.names = [file_names[i] for i in order_img.tolist()]
        self.ids, self.widths, self.heights = ids, widths.astype(np.int32), heights.astype(np.int32)
        pending, self.pending = self.pending, []
        for w in pending:
            self.annotations(w)

    def annotations(self, w: RawCoco, base: int = 0) -> None:
        """Clean one window of annotations (a :class:`RawCoco` with ``ann_base`` set;
        ``base``, its event's, is that)."""
        if self.ids is None:
            self.pending.append(w)
        else:
            self._add(*clean_window(w, self.ids, self.widths, self.heights,
                                    self.gt_min_area, self.required))

    def annotations_mapped(self, cleaned: tuple, base: int) -> None:
        """One window cleaned elsewhere (:func:`clean_window` of a window whose first
        annotation is the file's ``base``-th, decoded with ``ann_base=0``)."""
        part, counts, unknown = cleaned
        if base:
            part["gpos"] = _narrow(part["gpos"].astype(np.int64) + base)
            part["k_pos"] = part["k_pos"] + base
        self._add(part, counts, unknown)

    def _add(self, part: dict, counts: dict, unknown: np.ndarray) -> None:
        self.parts.append(part)
        self.counts.update(counts)
        self.unknown_ids = np.unique(np.concatenate([self.unknown_ids, unknown]))[:5]

    def finish(self, info: DatasetInfo, categories: list) -> GtTable:
        """The table: kept rows ordered by image, class ids, segms and keypoints."""
        self.images_end()
        malloc_trim()  # the windows' freed objects: their heap pages back to the system
        path, parts, ids, counts = self.path, self.parts, self.ids, self.counts
        n = len(ids)
        if counts["annotation_unknown_image"]:
            logger.warning("%s: %d annotation(s) refer to image ids not in 'images' (e.g. %s); "
                           "ignored, as pycocotools does", path,
                           counts["annotation_unknown_image"], self.unknown_ids.tolist())

        def col(k: str, dtype: Any) -> np.ndarray:
            return concat([p.pop(k) for p in parts], dtype)

        kp_table = krow = None
        if info.keypoints is not None:  # checked first, as Detectron's order of checks
            kbase = offsets([p["k_id"].size for p in parts])
            krow = concat([np.where(p["krow"] >= 0, p["krow"] + b, -1)
                         for p, b in zip(parts, kbase)], np.int64)
            kraw = RawCoco(source=path, categories=categories, ann_id=col("k_id", np.int64),
                           ann_img=col("k_img", np.int64), ann_cat=col("k_cat", np.int64),
                           kp_len=col("k_len", np.int64), kp_vals=col("k_vals", np.float64),
                           ann_pos=col("k_pos", np.int64))
            kp_table = _check_keypoints(kraw, info, self.required)
        pos = col("pos", np.int64)
        # annotations grouped by image in image order (many exports): no reordering
        grouped = pos.size < 2 or bool((pos[1:] >= pos[:-1]).all())
        order = np.arange(pos.size) if grouped else np.argsort(pos, kind="stable")
        pos_o = pos if grouped else pos[order]

        def by_image(a: np.ndarray) -> np.ndarray:
            return a if grouped else a[order]
        gt_off = offsets(np.bincount(pos_o, minlength=n))
        kept = RawCoco(source=path, categories=categories, ann_id=col("ann_id", np.int64),
                       ann_img=ids[pos], ann_cat=col("cat", np.int64),
                       seg_kind=col("seg_kind", np.int8), poly_n=col("poly_n", np.int64),
                       coord_n=col("coord_n", np.int64), coords=col("coords", np.float64),
                       ann_pos=col("gpos", np.int64))
        classes = _classes(kept, order, info)
        # only the segmentation columns are needed from here on
        kept.ann_id = kept.ann_cat = kept.ann_pos = kept.ann_img = None  # type: ignore[assignment]
        del pos
        boxes = by_image(col("boxes", np.float32).reshape(-1, 4))
        seg_areas = by_image(col("area", np.float32))
        is_crowd = by_image(col("crowd", bool))
        rles = {b + j: v for p, b in zip(parts, offsets([p["krow"].size for p in parts]).tolist())
                for j, v in p.pop("rles").items()}
        segms, seg_counts = _segm_columns(kept, order, rles)
        counts.update(seg_counts)
        del kept, rles
        keypoints, has_vis = None, np.zeros(n, bool)
        if kp_table is not None and krow is not None:
            kr = by_image(krow)
            keypoints = np.zeros((order.size, 3, info.num_keypoints), np.int32)
            keypoints[kr >= 0] = kp_table(kr[kr >= 0])
            vis = keypoints[:, 2, :].sum(axis=1) > 0
            has_vis = np.bincount(pos_o, weights=vis, minlength=n) > 0
        counts.update(images=n, gt_boxes=int(order.size), gt_crowd=int(is_crowd.sum()))
        self.parts = []
        return GtTable(info=info, ids=ids, widths=self.widths, heights=self.heights,
                       file_names=self.names, gt_off=gt_off, boxes=boxes, classes=classes,
                       seg_areas=seg_areas, is_crowd=is_crowd, segms=segms, keypoints=keypoints,
                       has_vis_kp=has_vis, counts=counts)


def clean_window(raw: RawCoco, ids: np.ndarray, widths: np.ndarray, heights: np.ndarray,
                 gt_min_area: float, required: bool) -> tuple[dict, dict, np.ndarray]:
    """Detectron's cleaning of one window of annotations against the sorted image ids
    (and their int32 sizes): ``(kept rows' columns, counts by reason, up to 5 unknown
    image ids)``. Every rule is per annotation, so windows clean independently.

    Raises:
        RoIDBInputError: a malformed polygon or RLE of an annotation of a known image.
    """
    n, a_img = len(ids), raw.ann_img
    pos = np.minimum(np.searchsorted(ids, a_img), max(n - 1, 0))
    known = (ids[pos] == a_img) if n else np.zeros(len(a_img), bool)
    counts = Counter(annotation_unknown_image=int((~known).sum()))
    unknown_ids = np.unique(a_img[~known])[:5]
    w_img = widths[pos].astype(np.float64)
    h_img = heights[pos].astype(np.float64)
    _check_polygons(raw, known)
    rle_rows = _check_rles(raw, known, h_img, w_img)
    kp_rows = np.flatnonzero(known & ((raw.kp_len > 0) | required))

    area, ignore, bbox = raw.ann_area, raw.ann_ignore, raw.ann_bbox
    with np.errstate(invalid="ignore"):
        # x1 y1 x2 y2, clipped to the image (Detectron's xywh_to_xyxy + clip_xyxy_to_image)
        box = np.concatenate([bbox[:, :2], bbox[:, :2] + np.maximum(0.0, bbox[:, 2:] - 1.0)], 1)
        box = np.minimum(np.stack([w_img, h_img, w_img, h_img], 1) - 1.0, np.maximum(0.0, box))
        keep = known.copy()
        for reason, drop in (("gt_min_area", area < gt_min_area), ("ignore", ignore == 1),
                             ("non_finite_bbox", ~np.isfinite(bbox).all(axis=1)),
                             ("non_positive_area", ~(area > 0)),
                             ("degenerate_box", ~(box[:, 2:] > box[:, :2]).all(1))):
            drop &= keep
            counts[reason] += int(drop.sum())
            keep &= ~drop
    kept = np.flatnonzero(keep)
    poly_n, coord_n, coords, _ = _polygons(raw, kept)
    seg_kind = raw.seg_kind[kept]
    rle_kept = np.flatnonzero(seg_kind == SEG_RLE).tolist()
    krow = np.full(kept.size, -1, np.int32)
    in_kp = np.isin(kept, kp_rows)
    krow[in_kp] = np.searchsorted(kp_rows, kept[in_kp])
    kp_len = np.maximum(raw.kp_len, 0)
    # kept rows in their output dtypes (a float32 cast before or after the gather is
    # the same), integers narrowed where they fit: only these live to the end
    part = {
        "pos": _narrow(pos[kept]), "boxes": box[kept].astype(np.float32),
        "area": area[kept].astype(np.float32), "crowd": raw.ann_crowd[kept] != 0,
        "cat": _narrow(raw.ann_cat[kept]), "ann_id": _narrow(raw.ann_id[kept]),
        "gpos": _narrow(raw.ann_at(kept)), "seg_kind": seg_kind, "poly_n": _narrow(poly_n),
        "coord_n": coord_n, "coords": coords,
        "rles": {j: rle_rows[int(kept[j])] for j in rle_kept}, "krow": krow,
        "k_id": raw.ann_id[kp_rows], "k_img": a_img[kp_rows], "k_cat": raw.ann_cat[kp_rows],
        "k_len": raw.kp_len[kp_rows],
        "k_vals": raw.kp_vals[take_ranges(offsets(kp_len)[kp_rows], kp_len[kp_rows])],
        "k_pos": raw.ann_at(kp_rows)}
    return part, dict(counts), unknown_ids


#: files of fewer windows than this are decoded in one process (forking costs more)
_PARALLEL_BYTES = 4


class ParallelWindows(OrderedWorkers):
    """Decodes and cleans windows of a COCO file in forked worker processes, as the
    ``mapper`` of :func:`iter_coco`.

    Args:
        path: the annotation file (each worker maps it).
        n: worker processes.
        gt_min_area, keypoints_required: as for :func:`load_coco_json`.
    """

    def __init__(self, path: str, n: int, gt_min_area: float, keypoints_required: bool
                 ) -> None:
        super().__init__(functools.partial(_window_task, path, gt_min_area,
                                           keypoints_required), n)
        self.depth, self.indexed = 2 * n, False

    def handles(self, key: str) -> bool:
        """Images always; annotations once the image index is known."""
        return key == "images" or self.indexed

    def set_index(self, ids: np.ndarray, widths: np.ndarray, heights: np.ndarray) -> None:
        """Give the workers the images (sorted ids, int32 widths and heights)."""
        if self.alive:
            self.broadcast({"ids": ids, "widths": widths, "heights": heights})
            self.indexed = True


class _Refused(Exception):
    """The typed decoder did not accept a window (the in-process decode redoes it)."""


def _window_task(path: str, gt_min_area: float, required: bool, task: tuple,
                 state: dict) -> tuple[int, Any]:
    """A worker's window: decoded, and for annotations cleaned against the index."""
    key, start, end = task[:3]
    cols = decode_window(path, key, start, end)
    if cols is None:
        raise _Refused(f"{path}: bytes {start}-{end}")
    if key == "images":
        return len(cols.img_id), cols
    return len(cols.ann_id), clean_window(cols, state["ids"], state["widths"],
                                          state["heights"], gt_min_area, required)


def _narrow(a: np.ndarray) -> np.ndarray:
    """``a`` as int32 when its values fit (window columns held to the end)."""
    return a if a.size and (a.min() < -2 ** 31 or a.max() >= 2 ** 31) else a.astype(np.int32)


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
    with np.errstate(over="ignore", invalid="ignore"):
        total = raw.coords.sum()
    if np.isfinite(total):  # no NaN/inf anywhere (one pass, no temporary)
        return
    # (the sum also overflows for huge finite values: then no row is bad)
    bad_c = ~np.isfinite(raw.coords) & np.repeat(rel, raw.coord_n)
    bad = np.unique(np.repeat(owner, raw.coord_n)[bad_c])
    if bad.size:
        _fail(raw, bad, "has a polygon coordinate that is not a finite number", _SEG_FIX)


_RLE_FIX = ("A COCO RLE is {'size': [image height, image width], 'counts': [run lengths] "
            "or 'compressed string'} whose runs cover exactly height x width pixels; "
            "re-encode the mask (pycocotools.mask.encode) or use polygons.")


def _rle_problem(rle: Any, h_img: int, w_img: int) -> Optional[str]:
    """What is wrong with one JSON RLE of an image of ``h_img`` x ``w_img``, if anything
    (compressed strings are decoded by :func:`_check_rles`)."""
    if not isinstance(rle, dict) or "counts" not in rle or "size" not in rle:
        return f"has a malformed RLE segmentation without 'size' and 'counts' ({rle!r:.60})"
    size, cnt = rle["size"], rle["counts"]
    if not (type(size) is list and len(size) == 2 and all(type(v) is int for v in size)):
        return f"has an RLE 'size' of {size!r:.40}, expected [height, width]"
    h, w = size
    if (h, w) != (h_img, w_img):
        return (f"has an RLE of size [{h}, {w}] but its image is {h_img} x {w_img} (height x "
                f"width); the mask would not line up with the image")
    if type(cnt) is list:
        if not (set(map(type, cnt)) <= {int} and (not cnt or min(cnt) >= 0)):
            return "has RLE counts that are not non-negative integers"
        if sum(cnt) != h * w:
            return f"has RLE counts summing to {sum(cnt)}, not height x width = {h * w}"
    elif type(cnt) is not str:
        return (f"has RLE 'counts' {cnt!r:.40}; expected a list of run lengths or a "
                f"compressed string")
    elif not cnt.isascii():
        return "has a compressed RLE string with non-ASCII characters"
    return None


def _check_rles(raw: RawCoco, known: np.ndarray, h_img: np.ndarray,
                w_img: np.ndarray) -> dict:
    """Validate the RLEs of annotations of known images; ``{row: (h, w, counts)}``."""
    out: dict = {}
    strs, str_rows = [], []
    for i, rle in raw.rles.items():
        if not known[i]:
            continue
        problem = _rle_problem(rle, int(h_img[i]), int(w_img[i]))
        if problem:
            _fail(raw, np.array([i]), problem, _RLE_FIX)
        cnt = rle["counts"]
        if type(cnt) is str:
            cnt = cnt.encode("ascii")
            strs.append(cnt)
            str_rows.append(i)
        out[i] = (*rle["size"], cnt)
    if strs:
        c, off, bad = rle_string_counts(strs)
        cs = offsets(c)
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


def _check_keypoints(raw: RawCoco, info: DatasetInfo, required: bool) -> Optional[Any]:
    """Validate the keypoints of annotations of known images; returns ``rows -> int32
    (G, 3, K)`` or ``None`` (no keypoints)."""
    if info.keypoints is None:
        return None
    k, kp_len = info.num_keypoints, raw.kp_len
    present = kp_len > 0  # missing, null and [] all mean "no keypoints"
    if required:
        kp_cats = np.array(keypoint_category_ids(raw.categories), np.int64)
        rows = np.flatnonzero(np.isin(raw.ann_cat, kp_cats) & ~present)
        if rows.size:
            ex = ", ".join(raw.ann_label(int(i)) for i in rows[:5])
            raise RoIDBInputError(
                f"{raw.source}: the model trains keypoints (MODEL.KEYPOINTS_ON) and category "
                f"'person' lists {k} keypoints, but {rows.size} 'person' annotation(s) have no "
                f"'keypoints' field: {ex}. Add 'keypoints': [0, 0, 0] * {k} for objects "
                f"without labelled keypoints (Detectron crashes here).")
    rows = np.flatnonzero(present & (kp_len != 3 * k))
    if rows.size:
        i = int(rows[0])
        raise RoIDBInputError(
            f"{raw.source}: {raw.ann_label(i)} has {int(kp_len[i])} keypoint values, expected "
            f"3 x {k} = {3 * k} ({rows.size} such annotations). Fix the 'keypoints' lists.")
    vals = raw.kp_vals
    # all within (-2**31, 2**31) (NaN fails both): two reductions, no temporaries
    if not (vals.size == 0 or (vals.min() > -2 ** 31 and vals.max() < 2 ** 31)):
        with np.errstate(invalid="ignore"):
            bad_v = ~(np.abs(vals) < 2 ** 31)
        rows = np.unique(np.repeat(np.arange(kp_len.size), np.maximum(kp_len, 0))[bad_v])
        if rows.size:
            _fail(raw, rows, "has a keypoint value that is not a finite number within the "
                  "int32 range", "Keypoints are [x1, y1, v1, ...] in pixels; use 0, 0, 0 for "
                  "a keypoint that is not labelled.")

    def table(rows: np.ndarray) -> np.ndarray:
        out = np.zeros((rows.size, 3, k), np.int32)
        has = present[rows]
        # every holder has one (3K,) row of ``vals`` (checked above)
        picked = vals.reshape(-1, 3 * k)[(np.cumsum(present) - 1)[rows[has]]]
        # (S, K, 3) -> (S, 3, K), cast on assignment: truncates toward zero, like Detectron
        out[has] = picked.reshape(-1, k, 3).transpose(0, 2, 1)
        return out

    return table


_LUT_MAX = 1 << 20


def _classes(raw: RawCoco, order: np.ndarray, info: DatasetInfo) -> np.ndarray:
    cat = raw.ann_cat[order]
    keys, vals = info.category_lut()
    if len(keys) and 0 <= keys[0] and keys[-1] < _LUT_MAX and cat.size > 16 * keys[-1]:
        # small non-negative ids (every COCO-style set): one gather through a table
        lut = np.full(int(keys[-1]) + 2, -1, np.int32)
        lut[keys] = vals
        c = lut[np.clip(cat, -1, int(keys[-1]) + 1)]
        if (c >= 0).all():
            return c
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


def _polygons(raw: RawCoco, rows: np.ndarray, min_coords: int = 0) -> tuple:
    """The polygons of annotations ``rows`` (in that order) with at least ``min_coords``
    coordinates: ``(polygons per row, coordinates per polygon, coordinates, dropped)``."""
    if not raw.coord_n.size:  # no polygon at all (box-only datasets): no index arrays
        return raw.poly_n[rows], raw.coord_n, raw.coords, 0
    pidx = take_ranges(offsets(raw.poly_n)[rows], raw.poly_n[rows])
    row_of = np.repeat(np.arange(rows.size), raw.poly_n[rows])
    short = raw.coord_n[pidx] < min_coords
    pidx, row_of = pidx[~short], row_of[~short]
    if pidx.size == raw.coord_n.size and (pidx == np.arange(pidx.size)).all():
        coords = raw.coords  # every polygon kept, in file order (one file per image order)
    elif (rows[1:] > rows[:-1]).all():  # kept polygons in file order: a mask will do
        keep = np.zeros(raw.coord_n.size, bool)
        keep[pidx] = True
        coords = raw.coords[np.repeat(keep, raw.coord_n)]
    else:
        coords = raw.coords[take_ranges(offsets(raw.coord_n)[pidx], raw.coord_n[pidx])]
    return (np.bincount(row_of, minlength=rows.size), raw.coord_n[pidx], coords,
            int(short.sum()))


def _segm_columns(raw: RawCoco, order: np.ndarray,
                  rles: dict) -> tuple[SegmColumns, dict[str, int]]:
    """:class:`SegmColumns` of rows ``order``; polygons under 6 coordinates dropped (Detectron quirk
    Q24, docs/detectron_quirks.md)."""
    poly_counts, coord_counts, coords, short = _polygons(raw, order, 6)
    seg_kind = raw.seg_kind[order]
    kind = np.full(order.size, POLY, np.int8)
    rle_idx = np.full(order.size, -1, np.int32)
    rows = np.flatnonzero(seg_kind == SEG_RLE).tolist()
    missing = int((seg_kind == SEG_MISSING).sum())
    cols = SegmColumns(
        kind=kind, poly_off=offsets(poly_counts), coord_off=offsets(coord_counts),
        coords=np.ascontiguousarray(coords, np.float64), rle_idx=rle_idx,
        **rle_columns(rows, [rles[int(order[j])] for j in rows], kind, rle_idx))
    empty = int(((kind == POLY) & (poly_counts == 0)).sum()) - missing
    return cols, {"polygon_lt_6_coords": short, "empty_segmentation": empty,
                  "missing_segmentation": missing}
