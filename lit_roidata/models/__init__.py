"""Real detectors on the data module: torchvision's detection models as LightningModules.

:class:`TorchvisionDetector` trains torchvision's Faster / Mask / Keypoint R-CNN and
RetinaNet (and a Fast R-CNN from precomputed proposals) on the data module's
``output_format="torchvision"`` batches, evaluates on its evaluation batches and writes
COCO results in ``predict`` (:class:`COCOPredictionWriter`).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["ARCHS", "COCOPredictionWriter", "TorchvisionDetector", "detectron_solver_kwargs"]


def __getattr__(name: str) -> Any:  # lazy: importing torchvision's detection zoo is slow
    if name in __all__:
        module = "predict" if name == "COCOPredictionWriter" else "detector"
        return getattr(importlib.import_module(f"lit_roidata.models.{module}"), name)
    raise AttributeError(f"module 'lit_roidata.models' has no attribute {name!r}")
