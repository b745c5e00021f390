"""Pascal VOC evaluation: the devkit's AP (VOC2007 11-point or area under the curve) per
class, as Detectron2's ``PascalVOCDetectionEvaluator``, and a Lightning callback.

:class:`VOCEvaluator` is :class:`~lit_roidata.evaluation.COCOEvaluator`'s callback with
the ground truth of a VOC tree (``format="voc"`` catalog records); see docs/evaluation.md.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pytorch_lightning as pl

from lit_roidata.boxes import box_areas
from lit_roidata.evaluation import COCOEvaluator, annotation_file, as_numpy, dataset_info
from lit_roidata.roidb.voc import VOC_CLASSES, parse_voc_xml, voc_image_ids, voc_root_split

__all__ = ["VOCEvaluator", "voc_ap", "voc_class_aps"]

#: Detectron2's IoU thresholds (AP is their mean, as COCO's), in percent.
_THRESHOLDS = tuple(range(50, 100, 5))


def voc_ap(rec: np.ndarray, prec: np.ndarray, use_07_metric: bool) -> float:
    """The devkit's AP of a precision/recall curve: VOC2007's 11-point interpolated
    (maximum precision at recall >= 0, 0.1, ... 1) or the area under the monotone
    precision envelope (VOC2010 on)."""
    if use_07_metric:
        return float(sum(prec[rec >= t].max(initial=0.0) for t in np.arange(0.0, 1.1, 0.1)) / 11.0)
    mrec = np.concatenate(([0.0], rec, [1.0]))
    mpre = np.maximum.accumulate(np.concatenate(([0.0], prec, [0.0]))[::-1])[::-1]
    i = np.flatnonzero(mrec[1:] != mrec[:-1])
    return float(np.sum((mrec[i + 1] - mrec[i]) * mpre[i + 1]))


def _round(x: np.ndarray, digits: int) -> np.ndarray:
    """``x`` as the devkit's results files write it (``%.<digits>f``, read back)."""
    return np.array([f"{v:.{digits}f}" for v in x.ravel().tolist()], np.float64).reshape(x.shape)


def voc_class_aps(gt: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
                  dets: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]],
                  num_classes: int) -> dict[tuple[int, bool], np.ndarray]:
    """Per-class AP at each IoU threshold 50, 55, ... 95 (percent), with the devkit's
    matching, by both metrics.

    ``gt[i]`` is image i's ``(boxes (n, 4) 1-based inclusive, classes (n,), difficult
    (n,))``; ``dets[i]`` its ``(boxes (k, 4) 1-based, classes (k,), scores (k,))`` with
    scores rounded to 3 and boxes to 1 decimal, as in the results files. Per class,
    detections in descending score order (NumPy's default ``argsort`` of the scores in
    input order, as the devkit's) each take the ground truth of highest IoU (+1
    convention); IoU above the threshold makes it a true positive if that box is not
    difficult and not yet taken, nothing if it is difficult, else a false positive.
    Returns ``{(threshold, use_07_metric): (num_classes,) APs}``; NaN for a class
    without non-difficult ground truth.
    """
    starts = np.cumsum([0] + [len(g[1]) for g in gt])
    gt_cls, hard = (np.concatenate([g[k] for g in gt] + [np.zeros(0, t)])
                    for k, t in ((1, np.int64), (2, bool)))
    ovmax, owner = [np.zeros(0)], [np.zeros(0, np.int64)]
    for start, (gb, gc, _), (db, dc, _) in zip(starts, gt, dets):
        gb, gc = np.vstack([gb, np.zeros((1, 4))]), np.append(gc, -1)  # a column never taken
        w = np.minimum(db[:, None, 2], gb[:, 2]) - np.maximum(db[:, None, 0], gb[:, 0]) + 1.0
        h = np.minimum(db[:, None, 3], gb[:, 3]) - np.maximum(db[:, None, 1], gb[:, 1]) + 1.0
        inter = np.maximum(w, 0.0) * np.maximum(h, 0.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            iou = inter / (box_areas(db)[:, None] + box_areas(gb) - inter)
        iou[dc[:, None] != gc] = -np.inf  # only the detection's class
        j = iou.argmax(axis=1)
        ovmax.append(iou[np.arange(len(db)), j])
        owner.append(start + j)
    ovmax, owner = np.concatenate(ovmax), np.concatenate(owner)
    cls, score = (np.concatenate([d[k] for d in dets] + [np.zeros(0)]) for k in (1, 2))
    out = {(t, m): np.full(num_classes, np.nan) for t in _THRESHOLDS for m in (True, False)}
    for c in range(num_classes):
        npos = int(np.sum((gt_cls == c) & ~hard))
        if npos == 0:
            continue
        sel = np.flatnonzero(cls == c)
        order = sel[np.argsort(-score[sel])]
        ov, key = ovmax[order], owner[order]
        for t in _THRESHOLDS:
            hit = ov > t / 100.0
            easy = hit & ~hard[np.where(hit, key, 0)]
            pos = np.flatnonzero(easy)
            tp = np.zeros(len(order))
            tp[pos[np.unique(key[pos], return_index=True)[1]]] = 1.0
            fp = np.cumsum(~hit | (easy & (tp == 0)))
            tp = np.cumsum(tp)
            prec = tp / np.maximum(tp + fp, np.finfo(np.float64).eps)
            for m in (True, False):
                out[t, m][c] = voc_ap(tp / npos, prec, m)
    return out


class VOCEvaluator(COCOEvaluator):
    """Pascal VOC box AP after every validation/test pass (Detectron2's
    ``PascalVOCDetectionEvaluator``'s numbers), on the images that were run.

    Logs ``val/voc_bbox_AP`` (mean over IoU 0.5:0.95), ``_AP50``, ``_AP75`` with the
    dataset's metric, ``_AP50_11pt`` and ``_AP50_area`` (mAP at IoU 0.5 with each
    metric) and ``_AP50_11pt_<class>`` / ``_AP50_area_<class>`` per class, as fractions.

    Args:
        annotation_files: ``{dataset name: <VOC root>/ImageSets/Main/<split>.txt}``
            overriding the catalog.
        use_07_metric: 11-point AP for AP/AP50/AP75; ``None``: when the dataset name or
            the VOC root names 2007 (Detectron2's rule: the year).
        class_names: the names of labels 1, 2, ...; default: the data module's roidb's
            classes, else the 20 VOC classes.
        print_summary: print a table of the APs on rank 0 after each evaluation.
    """

    _label = "VOC"
    _key_prefix = "voc_"
    _iou_choices = ("bbox",)
    _table_stats = ("AP", "AP50", "AP75", "AP50_11pt", "AP50_area")
    #: a file id (str) as is; an integer id is a position in the split (the dicts roidb's)
    _image_key = staticmethod(lambda i: i if isinstance(i, str) else int(i))

    def __init__(self, annotation_files: Optional[dict[str, str]] = None,
                 use_07_metric: Optional[bool] = None, print_summary: bool = True,
                 class_names: Optional[Sequence[str]] = None) -> None:
        super().__init__(("bbox",), annotation_files, None, print_summary)
        self.use_07_metric = use_07_metric
        self.class_names = None if class_names is None else tuple(class_names)

    def _dataset_metrics(self, name: str, by_image: Mapping[Any, Mapping[str, Any]],
                         prefix: str, trainer: Optional[pl.Trainer]) -> dict[str, float]:
        root, split = voc_root_split(self.annotation_files.get(name)
                                     or annotation_file(name, trainer))
        info = dataset_info(name, trainer)
        classes = self.class_names or (tuple(info.classes[1:]) if info is not None else VOC_CLASSES)
        index = {c: i for i, c in enumerate(classes)}
        ids, gt, dets = voc_image_ids(root, split), [], []
        for image_id, d in by_image.items():
            fid = image_id if isinstance(image_id, str) else ids[image_id] if (
                0 <= image_id < len(ids)) else f"<position {image_id} of {len(ids)}>"
            xml = os.path.join(root, "Annotations", f"{fid}.xml")
            if not os.path.isfile(xml):
                raise ValueError(f"dataset {name!r}: image id {image_id!r} has no annotation "
                                 f"file {xml}; are the detections from another dataset?")
            objs = [(b, index[n], hard) for n, b, hard in parse_voc_xml(xml)[2] if n in index]
            b, c, hard = zip(*objs) if objs else ((), (), ())
            gt.append((np.array(b, np.float64).reshape(-1, 4), np.array(c, np.int64),
                       np.array(hard, bool)))
            boxes = as_numpy(d["boxes"]).astype(np.float64).reshape(-1, 4)
            dets.append((_round(boxes + 1.0, 1), as_numpy(d["labels"]).astype(np.int64) - 1,
                         _round(as_numpy(d["scores"]).astype(np.float64).reshape(-1), 3)))
        use07 = (self.use_07_metric if self.use_07_metric is not None
                 else "2007" in name or "2007" in os.path.basename(root))
        aps = voc_class_aps(gt, dets, len(classes))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a mean of no class: NaN
            mean = {t: np.nanmean(aps[t, use07]) for t in _THRESHOLDS}
            out = {"AP": np.mean(list(mean.values())), "AP50": mean[50], "AP75": mean[75]}
            for m, kind in ((True, "11pt"), (False, "area")):
                out[f"AP50_{kind}"] = np.nanmean(aps[50, m])
                out.update({f"AP50_{kind}_{c}": v for c, v in zip(classes, aps[50, m])})
        return {f"voc_bbox_{k}": float(v) for k, v in out.items()}
