"""LVIS evaluation: federated box and mask AP (AP, APr, APc, APf) as a Lightning callback.

:class:`LVISEvaluator` is :class:`~lit_roidata.evaluation.COCOEvaluator` with LVIS's rules
(federated filtering, 300 detections per image, APr/APc/APf), computed with
``faster-coco-eval``'s LVIS mode (the ``lvis`` extra); see docs/lvis.md.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections import defaultdict
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import orjson

from lit_roidata._optional import require
from lit_roidata.evaluation import COCOEvaluator

__all__ = ["LVISEvaluator", "limit_dets_per_image", "LVIS_MAX_DETS"]

log = logging.getLogger(__name__)

#: LVIS's detections per image (the official ``LVISResults(max_dets=300)``).
LVIS_MAX_DETS = 300
_LVIS_IOU_TYPES = ("bbox", "segm")
#: Our stat name -> ``faster-coco-eval``'s ``stats_as_dict`` key (LVIS mode, one maxDets).
_STATS = {"AP": "AP_all", "AP50": "AP_50", "AP75": "AP_75", "APs": "AP_small",
          "APm": "AP_medium", "APl": "AP_large", "APr": "APr", "APc": "APc", "APf": "APf",
          "AR": "AR_all", "ARs": "AR_small", "ARm": "AR_medium", "ARl": "AR_large"}
_FREQUENCIES = ("r", "c", "f")


def limit_dets_per_image(results: Sequence[Mapping[str, Any]],
                         max_dets: int = LVIS_MAX_DETS) -> list[Mapping[str, Any]]:
    """Keep the ``max_dets`` highest-scoring results of each image (over all categories).

    The official ``LVISResults.limit_dets_per_image``: results grouped by image in order of
    first appearance; an image with more than ``max_dets`` is sorted by score (stable, so
    equal scores keep their order) and cut; the others are kept as they are. A negative
    ``max_dets`` keeps everything.
    """
    if max_dets < 0:
        return list(results)
    by_image: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for r in results:
        by_image[int(r["image_id"])].append(r)
    out: list[Mapping[str, Any]] = []
    for anns in by_image.values():
        if len(anns) > max_dets:
            order = np.argsort(-np.asarray([a["score"] for a in anns], np.float64), kind="stable")
            anns = [anns[i] for i in order[:max_dets]]
        out.extend(anns)
    return out


def _check_lvis_gt(dataset: Mapping[str, Any], ann_file: str) -> None:
    """Named errors for an annotation file without LVIS's federated fields."""
    for cat in dataset.get("categories", ()):
        if cat.get("frequency") not in _FREQUENCIES:
            raise ValueError(
                f"{ann_file}: category id {cat.get('id')} has frequency "
                f"{cat.get('frequency')!r}, expected one of 'r', 'c', 'f'; LVISEvaluator needs "
                f"an LVIS-format annotation file (use COCOEvaluator for COCO-format data)")
    cat_ids = {int(c["id"]) for c in dataset.get("categories", ())}
    for img in dataset.get("images", ()):
        for key in ("neg_category_ids", "not_exhaustive_category_ids"):
            if key not in img:
                raise ValueError(
                    f"{ann_file}: image id {img.get('id')} has no {key!r}; LVISEvaluator needs "
                    f"an LVIS-format annotation file (every image lists its negative and "
                    f"not-exhaustive categories, possibly empty)")
            if unknown := sorted(set(int(c) for c in img[key]) - cat_ids):
                raise ValueError(f"{ann_file}: image id {img.get('id')} lists {key} {unknown[:5]} "
                                 f"that are not in its categories; fix the annotation file")


def _federated_pairs(gt: Any) -> set[tuple[int, int]]:
    """``(image id, category id)`` pairs a detection may be evaluated on: the image has
    that category annotated or lists it in ``neg_category_ids``."""
    pairs = {(int(a["image_id"]), int(a["category_id"])) for a in gt.dataset["annotations"]}
    pairs.update((int(im["id"]), int(c)) for im in gt.dataset["images"]
                 for c in im["neg_category_ids"])
    return pairs


def _categories_with_gt(gt: Any, image_ids: Sequence[int]) -> list[int]:
    """Sorted ids of the categories annotated in ``image_ids`` (all categories if none is,
    so that the library still has a category list)."""
    ids = set(int(i) for i in image_ids)
    cats = sorted({int(a["category_id"]) for a in gt.dataset["annotations"]
                   if int(a["image_id"]) in ids})
    return cats or sorted(int(c["id"]) for c in gt.dataset["categories"])


class LVISEvaluator(COCOEvaluator):
    """LVIS box and mask AP (AP, APr, APc, APf, federated) after every validation/test pass.

    As :class:`~lit_roidata.evaluation.COCOEvaluator`, with each image's 300 best
    detections and LVIS's federated rules; logs ``val/lvis_bbox_AP``, ``_APr``, ``_APc``,
    ``_APf``, ``_AR``, ... (-1 for a frequency group without ground truth); see docs/lvis.md.

    Args:
        iou_types: ``"bbox"`` and/or ``"segm"`` (segm runs only if detections have masks).
        annotation_files: ``{dataset name: LVIS json}`` overriding the catalog.
        output_dir: if set, rank 0 writes ``<prefix>_<iou>_<dataset>_results.json`` there
            (after the per-image limit: the file ``LVISEval`` would read).
        print_summary: print a table of the APs on rank 0 after each evaluation.
        max_dets_per_image: detections kept per image; LVIS's rule is 300 (-1: all).

    Raises:
        lit_roidata._optional.MissingOptionalDependency: ``faster-coco-eval`` is not
            installed (``pip install "lit_roidata[lvis]"``).
    """

    _label = "LVIS"
    _key_prefix = "lvis_"
    _iou_choices = _LVIS_IOU_TYPES
    _table_stats = ("AP", "AP50", "AP75", "APr", "APc", "APf", "APs", "APm", "APl")

    def __init__(self, iou_types: Sequence[str] = _LVIS_IOU_TYPES,
                 annotation_files: Optional[dict[str, str]] = None,
                 output_dir: Optional[str] = None, print_summary: bool = True,
                 max_dets_per_image: int = LVIS_MAX_DETS) -> None:
        require("faster_coco_eval", "lvis", "LVIS evaluation (LVISEvaluator)")
        super().__init__(iou_types=iou_types, annotation_files=annotation_files,
                         output_dir=output_dir, print_summary=print_summary)
        self.max_dets_per_image = int(max_dets_per_image)
        #: id(gt) -> (gt, the (image, category) pairs the federated rule evaluates)
        self._federated: dict[int, tuple[Any, set[tuple[int, int]]]] = {}

    def _load_gt(self, ann_file: str) -> Any:
        """``faster-coco-eval``'s ``COCO`` of an LVIS json, checked for the federated fields."""
        fce = require("faster_coco_eval", "lvis", "LVIS evaluation (LVISEvaluator)")
        with open(ann_file, "rb") as f:
            dataset = orjson.loads(f.read())  # LVIS v1 val is ~200 MB of json
        _check_lvis_gt(dataset, ann_file)
        # by sorted id, as the LVIS roidb: the label map without a roidb follows this order
        dataset["categories"] = sorted(dataset.get("categories", ()), key=lambda c: c["id"])
        gt = fce.COCO()
        gt.dataset = dataset
        with contextlib.redirect_stdout(io.StringIO()):
            gt.createIndex()
        self._federated[id(gt)] = (gt, _federated_pairs(gt))  # holds gt: its id is not reused
        return gt

    def _limit(self, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return limit_dets_per_image(results, self.max_dets_per_image)  # type: ignore

    def _score(self, gt: Any, results: list[dict[str, Any]], iou: str,
               image_ids: Sequence[int]) -> tuple[dict[str, float], str]:
        from faster_coco_eval import COCOeval_faster

        # The federated filter, the library's own rule, applied before the library sees
        # the results: faster-coco-eval 1.8's segm path fails (IndexError
        # "unordered_map::at") on a dropped mask in an image with no kept detection and no
        # ground truth. Filtering first changes no number (the tests hold the results to
        # the official LVISEval's, boxes and masks).
        known = self._federated[id(gt)][1]
        kept = [r for r in results if (int(r["image_id"]), int(r["category_id"])) in known]
        lines: list[str] = []
        with contextlib.redirect_stdout(io.StringIO()):
            # loadRes adds fields (area, id, ...) to the dicts it is given: give it copies
            dt = gt.loadRes([dict(r) for r in kept])
            ev = COCOeval_faster(gt, dt, iou, lvis_style=True, print_function=lines.append)
            ev.params.imgIds = sorted(int(i) for i in image_ids)
            # Only the categories with ground truth in these images: any other has no AP or
            # AR to average (LVISEval's -1), so the numbers are the same, and the work,
            # which grows with images x categories, shrinks on a partial or small split.
            ev.params.catIds = _categories_with_gt(gt, ev.params.imgIds)
            # one cap per (image, category) equal to the per-image cap, as LVISEval's
            ev.params.maxDets = [self.max_dets_per_image if self.max_dets_per_image >= 0
                                 else 10 ** 9]
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
        got = ev.stats_as_dict
        return {ours: float(got[theirs]) for ours, theirs in _STATS.items()}, "\n".join(
            str(x) for x in lines)

