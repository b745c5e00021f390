"""Real detectors on the data module: torchvision's detection models as LightningModules.

:class:`TorchvisionDetector` trains torchvision's Faster / Mask / Keypoint R-CNN and
RetinaNet (and a Fast R-CNN from precomputed proposals) on the data module's
``output_format="torchvision"`` batches, evaluates on its evaluation batches and writes
COCO results in ``predict`` (:class:`COCOPredictionWriter`).
"""

from __future__ import annotations

from lit_roidata._optional import lazy_getattr

__all__ = ["ARCHS", "COCOPredictionWriter", "TorchvisionDetector", "detectron_solver_kwargs"]

# lazy: importing torchvision's detection zoo is slow
__getattr__ = lazy_getattr(__name__, {name: "lit_roidata.models." + (
    "predict" if name == "COCOPredictionWriter" else "detector") for name in __all__})
