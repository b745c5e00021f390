"""COCO evaluation: predictions to COCO results, and a Lightning callback for box/mask AP.

The model's ``validation_step`` / ``test_step`` returns ``{"detections": [per-image dict,
...]}`` for every image of the batch: ``image_id``, ``dataset``, ``boxes`` ``(k, 4)``
(original-image ``x1, y1, x2, y2``, Detectron's +1 convention), ``scores``, ``labels``
(contiguous ids), optionally ``masks`` (RLE dicts or ``(k, H, W)``), ``keypoints``
``(k, K, 3)`` and ``proposals: True`` (class-agnostic boxes, category 1). The format and
the conversion to COCO results are described in docs/evaluation.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
from collections import defaultdict
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import pytorch_lightning as pl
import torch

from lit_roidata.broadcast import gather_to_rank0, run_on_rank0
from lit_roidata.osutil import atomic_write

__all__ = ["COCOEvaluator", "detections_to_coco_results", "coco_category_map",
           "keypoint_category_ids", "dataset_info", "annotation_file", "gather_to_rank0"]

log = logging.getLogger(__name__)

#: ``COCOeval.stats`` positions of the numbers we log.
_STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl")
#: ... and for keypoints (COCO has no small-object keypoint AP).
_KP_STAT_NAMES = ("AP", "AP50", "AP75", "APm", "APl")
_IOU_TYPES = ("bbox", "segm", "keypoints")
#: The detection field each IoU type evaluates, and the result field it keeps.
_DET_FIELD = {"bbox": "boxes", "segm": "masks", "keypoints": "keypoints"}
_RESULT_FIELD = {"bbox": "bbox", "segm": "segmentation", "keypoints": "keypoints"}


def as_numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if torch.is_tensor(x) else np.asarray(x)


def _id_map(dataset_info: Any, dataset: Optional[str]) -> Mapping[int, int]:
    """The contiguous → json map of ``dataset`` from an info object or a by-name mapping."""
    if hasattr(dataset_info, "contiguous_category_id_to_json_id"):
        return dataset_info.contiguous_category_id_to_json_id
    if isinstance(dataset_info, Mapping):
        if dataset in dataset_info:
            return _id_map(dataset_info[dataset], dataset)
        if all(isinstance(k, (int, np.integer)) for k in dataset_info):
            return dataset_info  # already a contiguous -> json map
        raise KeyError(f"no dataset info for dataset {dataset!r}; have {sorted(dataset_info)}")
    raise TypeError(f"dataset_info must be a DatasetInfo, a {{name: DatasetInfo}} mapping or "
                    f"a {{contiguous id: json id}} map, got {type(dataset_info).__name__}")


def mask_rle(mask: Any, image_id: Optional[int] = None) -> dict[str, Any]:
    """A compressed RLE with text counts from an RLE dict or an ``(H, W)`` binary mask."""
    from pycocotools import mask as mask_utils

    if isinstance(mask, Mapping):
        rle = dict(mask)
        if isinstance(rle.get("counts"), list):  # uncompressed -> compressed
            rle = mask_utils.frPyObjects(rle, *rle["size"])
    else:
        m = as_numpy(mask)
        if m.ndim != 2:
            raise ValueError(f"image {image_id}: a mask must be (H, W), got shape {m.shape}")
        rle = mask_utils.encode(np.asfortranarray(m.astype(np.uint8)))
    if isinstance(rle["counts"], bytes):  # json needs text, as Detectron's segm results
        rle["counts"] = rle["counts"].decode("ascii")
    return rle


def detections_to_coco_results(detections: Iterable[Mapping[str, Any]],
                               dataset_info: Any) -> list[dict[str, Any]]:
    """Turn per-image detections into COCO result dicts (``loadRes`` / json format).

    Args:
        detections: per-image dicts as described in the module docstring.
        dataset_info: a :class:`~lit_roidata.roidb.info.DatasetInfo` (anything with
            ``contiguous_category_id_to_json_id``), a ``{dataset name: info}`` mapping
            (chosen by each detection's ``dataset``) or a plain ``{contiguous: json}`` map.

    Returns:
        ``[{"image_id", "category_id", "bbox": [x, y, w, h], "score"} (+ "segmentation",
        "keypoints"), ...]``, in input order.

    Raises:
        ValueError: a label with no json category (e.g. background 0 or a class the
            dataset lacks), or inconsistent array lengths; the message names the image.
    """
    results: list[dict[str, Any]] = []
    maps: dict[Any, dict[int, int]] = {}  # per dataset: its map, with int keys
    for det in detections:
        image_id = int(det["image_id"])
        boxes = as_numpy(det["boxes"]).astype(np.float64).reshape(-1, 4)
        scores = as_numpy(det["scores"]).astype(np.float64).reshape(-1)
        proposals = bool(det.get("proposals", False))
        labels = (np.ones(len(boxes), np.int64) if proposals and det.get("labels") is None
                  else as_numpy(det["labels"]).astype(np.int64).reshape(-1))
        if not len(boxes) == len(scores) == len(labels):
            raise ValueError(f"image {image_id}: {len(boxes)} boxes, {len(scores)} scores and "
                             f"{len(labels)} labels; they must have equal lengths")
        # Class-agnostic proposals: every box is category 1, as COCO's proposal results.
        if proposals:
            id_map = {int(c): 1 for c in labels}
        else:
            ds = det.get("dataset")
            if ds not in maps:
                maps[ds] = {int(k): v for k, v in _id_map(dataset_info, ds).items()}
            id_map = maps[ds]
        if unknown := sorted({int(c) for c in labels} - id_map.keys()):
            raise ValueError(f"image {image_id} (dataset {det.get('dataset')!r}): labels "
                             f"{unknown} have no json category id; known contiguous ids are "
                             f"{sorted(int(k) for k in id_map)} (0 is background)")
        masks = det.get("masks")
        if masks is not None and len(masks) != len(boxes):
            raise ValueError(f"image {image_id}: {len(masks)} masks for {len(boxes)} boxes")
        if (kps := det.get("keypoints")) is not None:
            kps = as_numpy(kps).astype(np.float64)
            if kps.ndim != 3 or kps.shape[0] != len(boxes) or kps.shape[2] < 2:
                raise ValueError(f"image {image_id}: keypoints must be (k, K, 3) for {len(boxes)} "
                                 f"boxes, got shape {kps.shape}")
            kps = np.concatenate([kps[:, :, :2], np.ones(kps.shape[:2] + (1,))], axis=2)
        xywh = boxes.copy()
        xywh[:, 2:] = boxes[:, 2:] - boxes[:, :2] + 1
        for k in range(len(boxes)):
            res = {"image_id": image_id, "category_id": int(id_map[int(labels[k])]),
                   "bbox": [round(float(v), 3) for v in xywh[k]], "score": float(scores[k])}
            if masks is not None:
                res["segmentation"] = mask_rle(masks[k], image_id)
            if kps is not None:  # COCO's (x, y, v) with every v 1
                res["keypoints"] = [round(float(v), 2) for v in kps[k].reshape(-1)]
            results.append(res)
    return results


def coco_category_map(coco: Any) -> dict[int, int]:
    """Detectron's contiguous → json map from a COCO object: ``categories`` order, 1-based."""
    return {i + 1: int(c) for i, c in enumerate(coco.getCatIds())}


def keypoint_category_ids(coco_gt: Any) -> list[int]:
    """Json ids of the categories that define keypoints (``"keypoints"`` names)."""
    return sorted(int(c["id"]) for c in coco_gt.loadCats(coco_gt.getCatIds()) if c.get("keypoints"))


def load_coco(ann_file: str) -> Any:
    """pycocotools' ``COCO`` of ``ann_file``, loaded quietly."""
    from pycocotools.coco import COCO

    with contextlib.redirect_stdout(io.StringIO()):
        return COCO(ann_file)


class COCOEvaluator(pl.Callback):
    """COCO box, mask and keypoint AP of the model's detections after every validation/test pass.

    The detections of all ranks are evaluated on rank 0 (on the images that were run) and
    logged on every rank as ``val/bbox_AP``, ``val/bbox_AP50``, ... (``test/`` for test,
    ``val/<dataset>/...`` too with several datasets); see docs/evaluation.md.

    Args:
        iou_types: ``"bbox"``, ``"segm"``, ``"keypoints"``; segm and keypoints run only if
            detections have masks / keypoints (keypoints on the json's categories that
            define keypoints, e.g. ``person``).
        annotation_files: ``{dataset name: COCO json}`` overriding the catalog.
        output_dir: if set, rank 0 writes ``<prefix>_<iou>_<dataset>_results.json`` there.
        print_summary: print a table of the APs on rank 0 after each evaluation.
        kpt_oks_sigmas: per-keypoint OKS sigmas when the dataset does not have COCO's 17
            person keypoints (COCOeval's default sigmas).
    """

    def __init__(self, iou_types: Sequence[str] = _IOU_TYPES,
                 annotation_files: Optional[dict[str, str]] = None,
                 output_dir: Optional[str] = None, print_summary: bool = True,
                 kpt_oks_sigmas: Optional[Sequence[float]] = None) -> None:
        if bad := sorted(set(iou_types) - set(self._iou_choices)):
            raise ValueError(f"iou_types {bad} are not supported by {self._label} evaluation; "
                             f"choose from {', '.join(self._iou_choices)}")
        self.iou_types = tuple(iou_types)
        self.kpt_oks_sigmas = None if kpt_oks_sigmas is None else list(kpt_oks_sigmas)
        self.annotation_files = dict(annotation_files or {})
        self.output_dir = output_dir
        self.print_summary = print_summary
        self._dets: list[dict[str, Any]] = []
        self._coco_cache: dict[str, Any] = {}
        self.last_metrics: dict[str, float] = {}

    #: What the messages call this evaluation; the prefix of its metric names (after
    #: ``val/``) and the table's columns. :class:`~lit_roidata.lvis_evaluation.LVISEvaluator`
    #: overrides them with the hooks below (``_load_gt``, ``_limit``, ``_score``).
    _label = "COCO"
    _key_prefix = ""
    _iou_choices: tuple[str, ...] = _IOU_TYPES
    _table_stats: tuple[str, ...] = _STAT_NAMES

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._dets = []

    on_test_epoch_start = on_validation_epoch_start

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        dets = outputs.get("detections") if isinstance(outputs, Mapping) else None
        self._dets += [{k: (as_numpy(v) if torch.is_tensor(v) else v) for k, v in d.items()}
                       for d in dets or ()]

    on_test_batch_end = on_validation_batch_end

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._finish(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish(trainer, pl_module, "test")

    def _finish(self, trainer: pl.Trainer, pl_module: pl.LightningModule, prefix: str) -> None:
        dets, self._dets = gather_to_rank0(self._dets), []  # only rank 0 evaluates
        if not dets and trainer.global_rank == 0:
            log.warning("%s: no detections were returned during %s; the model's %s_step must "
                        "return {'detections': [per-image dict, ...]} (see lit_roidata.evaluation)",
                        type(self).__name__, prefix, "validation" if prefix == "val" else "test")
        metrics = run_on_rank0(lambda: self.evaluate(dets, prefix=prefix, trainer=trainer),
                               trainer.global_rank, f"run the {self._label} evaluation") or {}
        self.last_metrics = dict(metrics)
        for key, value in metrics.items():
            # equal on every rank (broadcast above); sync_dist keeps Lightning content
            pl_module.log(key, float(value), sync_dist=True)

    def evaluate(self, detections: Sequence[Mapping[str, Any]], *, prefix: str = "val",
                 trainer: Optional[pl.Trainer] = None) -> dict[str, float]:
        """Evaluate ``detections`` (all ranks' already gathered) and return the metrics.

        Usable without a trainer: datasets then come from ``annotation_files`` or the
        default catalog.
        """
        # {dataset: {image id: its first detections}}: an image seen again (e.g. a
        # DistributedSampler padding the last shard) is ignored
        by_ds: dict[str, dict[Any, Mapping[str, Any]]] = defaultdict(dict)
        for d in detections:
            by_ds[str(d.get("dataset"))].setdefault(self._image_key(d["image_id"]), d)
        if repeats := len(detections) - sum(len(m) for m in by_ds.values()):
            log.info("%s evaluation: ignored %d repeated image(s) (padded shards)",
                     self._label, repeats)
        per_ds = {name: self._dataset_metrics(name, by_ds[name], prefix, trainer)
                  for name in sorted(by_ds)}
        metrics = {f"{prefix}/{k}": float(np.mean([m[k] for m in per_ds.values() if k in m]))
                   for k in sorted({k for m in per_ds.values() for k in m})}
        if len(per_ds) > 1:
            for name, m in per_ds.items():
                metrics.update({f"{prefix}/{name}/{k}": v for k, v in m.items()})
        if self.print_summary and per_ds:
            self._print_table(per_ds, prefix)
        elif per_ds:
            log.info("%s evaluation (%s): %s", self._label, prefix,
                     {k: round(v, 4) for k, v in metrics.items() if k.count("/") == 1})
        return metrics

    #: The key an image's detections are grouped by (VOC: the file id, a string).
    _image_key: Any = int

    def _dataset_metrics(self, name: str, by_image: Mapping[Any, Mapping[str, Any]],
                         prefix: str, trainer: Optional[pl.Trainer]) -> dict[str, float]:
        """The metrics of dataset ``name`` from its detections by image id."""
        coco, info = self._dataset(name, trainer)
        dets, image_ids = list(by_image.values()), sorted(by_image)
        if missing := sorted(set(image_ids) - set(coco.getImgIds())):
            raise ValueError(f"dataset {name!r}: image ids {missing[:5]} are not in its "
                             f"annotation file; are the detections from another dataset?")
        out: dict[str, float] = {}
        for iou in self.iou_types:
            sel = [d for d in dets if d.get(_DET_FIELD[iou]) is not None]
            if iou != "bbox" and not sel:
                continue
            results = self._result_dicts(sel, info, iou, coco)
            self._write(results, prefix, iou, name)
            stats, text = self._score(coco, results, iou, image_ids)
            # the full summary; the table has the headline numbers
            log.debug("%s evaluation, %s %s (%d images):\n%s", self._label, name, iou,
                      len(image_ids), text)
            out.update({f"{self._key_prefix}{iou}_{s}": float(v) for s, v in stats.items()})
        return out

    def _result_dicts(self, detections: Sequence[Mapping[str, Any]], info: Any, iou: str,
                 gt: Any) -> list[dict[str, Any]]:
        """The result dicts of ``detections`` for ``iou`` (the fields it does not use dropped)."""
        drop = {"segmentation", "keypoints"} - {_RESULT_FIELD[iou]}
        results = [{k: v for k, v in r.items() if k not in drop}
                   for r in detections_to_coco_results(detections, info)]
        if iou == "keypoints":
            kp_cats = set(keypoint_category_ids(gt))
            results = [r for r in results if r["category_id"] in kp_cats]
        return self._limit(results)

    def _limit(self, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The results evaluated and written (all of them; LVIS keeps 300 per image)."""
        return results

    def _score(self, gt: Any, results: list[dict[str, Any]], iou: str,
               image_ids: Sequence[int]) -> tuple[dict[str, float], str]:
        """``{stat name: value}`` and the summary text of COCOeval on ``image_ids``
        (keypoints on the keypoint categories only)."""
        from pycocotools.cocoeval import COCOeval

        names = _KP_STAT_NAMES if iou == "keypoints" else _STAT_NAMES
        if not results:
            return dict.fromkeys(names, 0.0), f"(no {iou} detections: AP is 0)"
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints; we log
            ev = COCOeval(gt, gt.loadRes(results), iou)
            ev.params.imgIds = sorted(int(i) for i in image_ids)
            if iou == "keypoints":
                ev.params.catIds = keypoint_category_ids(gt)
                k = len(results[0]["keypoints"]) // 3
                if self.kpt_oks_sigmas is not None:
                    ev.params.kpt_oks_sigmas = np.asarray(self.kpt_oks_sigmas, dtype=np.float64)
                if len(ev.params.kpt_oks_sigmas) != k:
                    raise ValueError(f"keypoint evaluation: the detections have {k} keypoints "
                                     f"but there are {len(ev.params.kpt_oks_sigmas)} OKS sigmas "
                                     f"(COCO's 17 by default); pass "
                                     f"COCOEvaluator(kpt_oks_sigmas=[...])")
            ev.evaluate()
            ev.accumulate()
            summary = io.StringIO()
            with contextlib.redirect_stdout(summary):
                ev.summarize()
        return {s: float(v) for s, v in zip(names, ev.stats)}, summary.getvalue()

    #: The ground-truth object of an annotation file (pycocotools' ``COCO``).
    _load_gt = staticmethod(load_coco)

    def _dataset(self, name: str, trainer: Optional[pl.Trainer]) -> tuple[Any, Any]:
        """(ground truth, id map source) for dataset ``name``."""
        ann_file = self.annotation_files.get(name) or annotation_file(name, trainer)
        if ann_file not in self._coco_cache:
            if not os.path.isfile(ann_file):
                raise FileNotFoundError(f"annotation file {ann_file} of dataset {name!r} does "
                                        f"not exist; fix the catalog entry or pass "
                                        f"annotation_files={{{name!r}: path}}")
            self._coco_cache[ann_file] = self._load_gt(ann_file)
        coco, info = self._coco_cache[ann_file], dataset_info(name, trainer)
        return coco, info if info is not None else coco_category_map(coco)

    def _write(self, results: list[dict[str, Any]], prefix: str, iou: str, name: str) -> None:
        if self.output_dir is None:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        path = os.path.join(self.output_dir, f"{prefix}_{iou}_{name}_results.json")
        with atomic_write(path, "w", fsync=False) as f:
            json.dump(results, f)

    def _print_table(self, per_ds: Mapping[str, Mapping[str, float]], prefix: str) -> None:
        from rich.console import Console
        from rich.table import Table

        table = Table("dataset", "type", title=f"{self._label} evaluation ({prefix})")
        for s in self._table_stats:
            table.add_column(s, justify="right")
        for name, m in per_ds.items():
            for iou in _IOU_TYPES:
                key = f"{self._key_prefix}{iou}_"
                if f"{key}AP" in m:
                    # -1: nothing to average (no ground truth in that area / group)
                    table.add_row(name, iou, *(f"{100 * m[key + s]:.1f}"
                                               if m.get(key + s, -1) >= 0 else "-"
                                               for s in self._table_stats))
        Console().print(table)


def dataset_info(name: str, trainer: Any) -> Any:
    """The ``DatasetInfo`` of dataset ``name`` in the trainer's data module's roidbs
    (validation, test, train), or ``None``."""
    dm = getattr(trainer, "datamodule", None)
    return next((info for attr in ("val_roidb", "test_roidb", "train_roidb")
                 for info in getattr(getattr(dm, attr, None), "datasets", ()) or ()
                 if info.name == name), None)


def annotation_file(name: str, trainer: Any = None) -> str:
    """The annotation file of dataset ``name`` in the trainer's data module's catalog, else
    in :data:`lit_roidata.catalog.DatasetCatalog`."""
    dm = getattr(trainer, "datamodule", None)
    catalog = dm.catalog() if hasattr(dm, "catalog") else None
    if catalog is None:
        from lit_roidata.catalog import DatasetCatalog as catalog
    entry = catalog.get(name)
    return str(entry["annotation_file"] if isinstance(entry, Mapping) else entry.annotation_file)
