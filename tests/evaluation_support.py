"""A model for the evaluator tests: fixed detections per validation batch."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch


class OracleDetector(pl.LightningModule):
    """Returns ``dets[i]`` for the validation batch holding image ``i`` (one per batch)."""

    def __init__(self, dets: list[dict[str, Any]]) -> None:
        super().__init__()
        self.dets = dets
        self.w = torch.nn.Parameter(torch.zeros(1))

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> dict:
        return {"detections": [self.dets[int(batch[0])]]}
