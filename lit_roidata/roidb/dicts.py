"""Detectron2's standard dataset dicts → the roidb's ground-truth table, window by window:
COCO-shaped windows, decoded and cleaned exactly as a COCO json's (docs/custom_datasets.md).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Mapping
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np
import orjson

from lit_roidata.roidb.coco import GtTable, table_from_windows
from lit_roidata.roidb.decode import decode_generic
from lit_roidata.roidb.info import RoIDBInputError

__all__ = ["load_records", "coco_windows", "records_digest", "dict_categories", "WINDOW"]

#: records converted and decoded at a time
WINDOW = 2048
#: Detectron2's ``BoxMode`` values
XYXY_ABS, XYWH_ABS = 0, 1
_MODES = {0: "XYXY_ABS", 1: "XYWH_ABS", 2: "XYXY_REL", 3: "XYWH_REL", 4: "XYWHA_ABS"}
_IMAGE_KEYS = ("file_name", "height", "width", "image_id")
_NUM = {int, float}


def dict_categories(thing_classes: Sequence[str],
                    keypoint_names: Optional[Sequence[str]] = None) -> list[dict]:
    """COCO ``categories`` of contiguous ids 0..K-1 (``person`` with the keypoint names)."""
    kp = {"keypoints": list(keypoint_names)} if keypoint_names else {}
    return [{"id": i, "name": n, **(kp if n == "person" else {})}
            for i, n in enumerate(thing_classes)]


def _py(v: Any) -> Any:
    """NumPy scalars as Python numbers (the decoder checks exact types)."""
    return v.item() if isinstance(v, np.generic) else v


def _floats(v: Any) -> Any:
    """A flat list of numbers, or ``v`` unchanged for the decoder to name."""
    if type(v) is list and set(map(type, v)) <= _NUM:
        return v
    try:
        return np.asarray(v, np.float64).ravel().tolist()
    except (TypeError, ValueError):
        return v


def _area(seg: Any, box: list, h: Any, w: Any) -> float:
    """COCO's area: the mask's (polygons rasterised, as pycocotools), else the box's."""
    from pycocotools import mask as mask_util

    try:
        if isinstance(seg, dict):
            rle = (mask_util.frPyObjects(seg, int(h), int(w)) if isinstance(seg["counts"], list)
                   else seg)
            return float(mask_util.area(rle))
        polys = [p for p in seg or () if len(p) >= 6]  # those Detectron keeps (Q24)
        if polys:
            return float(mask_util.area(mask_util.merge(mask_util.frPyObjects(polys, int(h),
                                                                              int(w)))))
        return float(box[2] * box[3])
    except Exception:  # a malformed mask or box: the decoder or the cleaning names it
        return 0.0


def _need(obj: Any, keys: Sequence[str], where: str, what: str) -> None:
    """A named error unless ``obj`` is a dict holding ``keys``."""
    missing = [k for k in keys if k not in obj] if isinstance(obj, Mapping) else None
    if missing is None or missing:
        raise RoIDBInputError(
            f"{where} " + (f"is a {type(obj).__name__}, not a dict" if missing is None else
                           f"has no {', '.join(missing)}") + f"; Detectron2's standard dataset "
            f"dicts carry {what}. Add them in the registered function.")


def _annotation(a: Any, iid: int, h: Any, w: Any, k: int, where: Callable[[], str]) -> dict:
    """One Detectron2 annotation as a COCO one (XYWH box, area, keypoints less 0.5)."""
    if not (isinstance(a, Mapping) and {"bbox", "bbox_mode", "category_id"} <= a.keys()):
        _need(a, ("bbox", "bbox_mode", "category_id"), where(), "'bbox', 'bbox_mode' "
              "(detectron2.structures.BoxMode) and 'category_id' per annotation")
    mode, cat, box = _py(a["bbox_mode"]), _py(a["category_id"]), _floats(a["bbox"])
    if mode not in (XYXY_ABS, XYWH_ABS) or type(mode) is bool:
        label = _MODES.get(mode, "?") if isinstance(mode, int) else "?"
        raise RoIDBInputError(f"{where()} has bbox_mode={mode!r} ({label}); use BoxMode."
                              f"XYXY_ABS (0) or BoxMode.XYWH_ABS (1), absolute pixels.")
    if type(cat) is not int or not 0 <= cat < k:
        raise RoIDBInputError(
            f"{where()} has category_id={cat!r}, not a contiguous id 0..{k - 1} of the {k} "
            f"thing_classes given at registration; add the class to thing_classes or map "
            f"the ids to 0..K-1 (as Detectron2's thing_dataset_id_to_contiguous_id).")
    if mode == XYXY_ABS and len(box) == 4 and set(map(type, box)) <= _NUM:
        box = [box[0], box[1], box[2] - box[0], box[3] - box[1]]
    seg = a.get("segmentation")
    if isinstance(seg, Mapping) and isinstance(seg.get("counts"), bytes):  # pycocotools'
        seg = {**seg, "counts": seg["counts"].decode("ascii")}
    elif isinstance(seg, (list, tuple)):
        seg = [_floats(p) for p in seg]
    out = {"image_id": iid, "category_id": cat, "bbox": box, "iscrowd": _py(a.get("iscrowd", 0)),
           "segmentation": seg, "area": _py(a["area"]) if "area" in a else _area(seg, box, h, w)}
    kp = a.get("keypoints")
    if kp is not None and len(kp):  # Detectron2 adds 0.5 to COCO's pixel indices
        kp = _floats(kp)
        out["keypoints"] = [v - 0.5 if i % 3 != 2 else v for i, v in enumerate(kp)] \
            if set(map(type, kp)) <= _NUM else kp
    if "ignore" in a:
        out["ignore"] = _py(a["ignore"])
    return out


def coco_windows(records: Iterable[Mapping], *, name: str, thing_classes: Sequence[str],
                 keypoint_names: Optional[Sequence[str]] = None,
                 window: int = WINDOW) -> Iterator[dict]:
    """The records as COCO json dicts (``images``, ``annotations``, ``categories``),
    ``window`` records at a time, consumed lazily. Image ids are the records' ``image_id``
    when the first is an integer, else (e.g. VOC's ``"000005"``) their positions.

    RoIDBInputError: a record or annotation lacking a key, a box mode other than XYXY_ABS /
    XYWH_ABS, or a category id outside 0..K-1 (naming the dataset, record, id and fix).
    """
    if not hasattr(records, "__iter__"):
        raise RoIDBInputError(f"dataset {name!r}: the registered function returned "
                              f"{type(records).__name__}, not a list or generator of dicts")
    cats, k, it = dict_categories(thing_classes, keypoint_names), len(thing_classes), iter(records)
    positional, n = None, 0
    for chunk in iter(lambda: list(itertools.islice(it, window)), []):
        images, anns = [], []
        for rec in chunk:
            rid = rec.get("image_id") if isinstance(rec, Mapping) else None
            _need(rec, _IMAGE_KEYS, f"dataset {name!r}: record #{n} (image_id {rid!r})",
                  "file_name, height, width and image_id per image")
            if positional is None:
                positional = type(_py(rid)) is not int
            iid = n if positional else _py(rid)
            h, w = _py(rec["height"]), _py(rec["width"])
            images.append({"id": iid, "width": w, "height": h,
                           "file_name": os.fspath(rec["file_name"])})
            for j, a in enumerate(rec.get("annotations") or ()):
                anns.append(_annotation(a, iid, h, w, k, lambda: f"dataset {name!r}: record "
                                        f"#{n} (image_id {rid!r}), annotation #{j}"))
            n += 1
        del chunk, rec  # the window's records are freed before the next is read
        yield {"images": images, "annotations": anns, "categories": cats}


def load_records(records: Iterable[Mapping], *, name: str, thing_classes: Sequence[str],
                 keypoint_names: Optional[Sequence[str]] = None, gt_min_area: float = -1,
                 keypoints_required: bool = False,
                 categories_hook: Optional[Callable[[list], Optional[Sequence[str]]]] = None,
                 window: int = WINDOW) -> GtTable:
    """The :class:`GtTable` of Detectron2-style records (a list or a generator), the same
    as a COCO json holding them gives (:func:`lit_roidata.roidb.coco.load_coco_json`, whose
    keyword arguments it shares). ``thing_classes`` name the contiguous category ids
    0..K-1; ``window`` records are decoded at a time. RoIDBInputError: a malformed record
    (:func:`coco_windows`).
    """
    cats = dict_categories(thing_classes, keypoint_names)
    source = f"dataset {name!r}"
    order = categories_hook(cats) if categories_hook is not None else None

    def windows() -> Iterator[tuple]:
        n_img = n_ann = 0
        for w in coco_windows(records, name=name, thing_classes=thing_classes,
                              keypoint_names=keypoint_names, window=window):
            yield (decode_generic({"images": w["images"]}, source, img_base=n_img),
                   decode_generic({"images": [], "annotations": w["annotations"]}, source,
                                  ann_base=n_ann))
            n_img, n_ann = n_img + len(w["images"]), n_ann + len(w["annotations"])

    return table_from_windows(windows(), cats, source=source, name=name, gt_min_area=gt_min_area,
                              class_order=order, keypoints_required=keypoints_required)


def records_digest(records: Iterable[Mapping]) -> str:
    """A content hash of the records (the cache key of a function registered without a
    ``version``), computed as they stream."""
    h = hashlib.blake2b(digest_size=16)
    opt = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS
    for rec in records:
        h.update(orjson.dumps(rec, default=repr, option=opt))
    return h.hexdigest()
