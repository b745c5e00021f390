"""``COCOPredictionWriter``: ``predict`` detections written as COCO results json files.

Collects the per-image detection dicts of ``predict_step`` (:mod:`lit_roidata.evaluation`),
gathers them to rank 0 and writes ``<output_dir>/<dataset>.json`` (default
``<default_root_dir>/predictions``) in the format ``COCO.loadRes`` reads.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from typing import Any, Mapping, Optional, Sequence

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BasePredictionWriter

from lit_roidata.broadcast import gather_to_rank0
from lit_roidata.evaluation import (annotation_file, coco_category_map, dataset_info,
                                    detections_to_coco_results, load_coco)
from lit_roidata.osutil import atomic_write

__all__ = ["COCOPredictionWriter"]

log = logging.getLogger(__name__)


class COCOPredictionWriter(BasePredictionWriter):
    """Write ``predict`` detections as COCO results json, one file per dataset.

    Args:
        output_dir: folder of the json files; default ``<trainer.default_root_dir>/predictions``.

    Attributes:
        written: ``{dataset: path}`` of the last ``predict`` run (rank 0).
    """

    def __init__(self, output_dir: Optional[str] = None) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = output_dir
        self._dets: list[dict[str, Any]] = []
        self.written: dict[str, str] = {}

    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._dets = []

    def write_on_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           prediction: Any, batch_indices: Optional[Sequence[int]], batch: Any,
                           batch_idx: int, dataloader_idx: int) -> None:
        if isinstance(prediction, Mapping):
            prediction = prediction.get("detections")
        if prediction is None:
            raise TypeError(f"{type(pl_module).__name__}.predict_step returned nothing; it must "
                            f"return a list of per-image detection dicts (lit_roidata.evaluation)")
        self._dets += [{k: (v.detach().cpu().numpy() if torch.is_tensor(v) else v)
                        for k, v in d.items()} for d in prediction]

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dets, self._dets = gather_to_rank0(self._dets), []
        if trainer.global_rank != 0:
            return
        self.written = self.write(dets, trainer)
        for name, path in self.written.items():
            print(f"predictions ({name}): {path}", flush=True)

    def write(self, detections: Sequence[Mapping[str, Any]], trainer: Optional[pl.Trainer] = None
              ) -> dict[str, str]:
        """Write ``detections`` grouped by dataset; return ``{dataset: path}``."""
        by_ds: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
        for d in detections:
            by_ds[str(d.get("dataset"))].append(d)
        out_dir = self.output_dir or os.path.join(
            getattr(trainer, "default_root_dir", None) or os.getcwd(), "predictions")
        os.makedirs(out_dir, exist_ok=True)
        written = {}
        for name, dets in sorted(by_ds.items()):
            info = dataset_info(name, trainer)
            if info is None:  # the annotation file's category order (Detectron's ids)
                info = coco_category_map(load_coco(annotation_file(name, trainer)))
            results = detections_to_coco_results(dets, info)
            written[name] = path = os.path.join(out_dir, f"{name}.json")
            with atomic_write(path, "w", fsync=False) as f:
                json.dump(results, f)
            log.info("wrote %d detections of %d images (%s) to %s", len(results), len(dets),
                     name, path)
        if not by_ds:
            log.warning("predict produced no detections to write")
        return written

