"""The demo: synthetic COCO- and LVIS-format data and small detectors that train on it.

``configs/demo.yaml`` uses :class:`DemoRoIDataModule` and :class:`DemoFastRCNN`
(:class:`DemoFasterRCNN` trains end to end from the RPN targets); :class:`RPNExchangeDemo`
and :func:`demo_alignment_stream` / :func:`demo_batches` serve the exchange demo. The
models are imported lazily (the data part needs no torchvision). See docs/demo.md.
"""

from __future__ import annotations

from typing import Any

from lit_roidata.demo.data import (DEMO_CATEGORIES, DEMO_TRAIN_DATASETS, DEMO_VAL_DATASETS,
                                   DemoDatasets, ensure_demo_data, register_demo_datasets)
from lit_roidata.demo.lvis_data import (LVIS_DEMO_DATASETS, ensure_lvis_demo_data,
                                        register_lvis_demo_datasets)

__all__ = ["DEMO_CATEGORIES", "DEMO_TRAIN_DATASETS", "DEMO_VAL_DATASETS", "LVIS_DEMO_DATASETS",
           "DemoDatasets", "DemoFastRCNN", "DemoRoIDataModule", "DemoFasterRCNN", "RPNExchangeDemo",
           "demo_alignment_stream", "demo_batches", "ensure_demo_data", "ensure_lvis_demo_data",
           "register_demo_datasets", "register_lvis_demo_datasets"]


def __getattr__(name: str) -> Any:
    if name == "DemoFastRCNN":
        from lit_roidata.demo.model import DemoFastRCNN

        return DemoFastRCNN
    if name == "DemoRoIDataModule":
        from lit_roidata.demo.datamodule import DemoRoIDataModule

        return DemoRoIDataModule
    if name == "DemoFasterRCNN":
        from lit_roidata.demo.faster import DemoFasterRCNN

        return DemoFasterRCNN
    if name == "RPNExchangeDemo":
        from lit_roidata.demo.rpn_exchange_model import RPNExchangeDemo

        return RPNExchangeDemo
    if name in ("demo_alignment_stream", "demo_batches"):
        from lit_roidata.demo import exchange_streams

        return getattr(exchange_streams, name)
    raise AttributeError(f"module 'lit_roidata.demo' has no attribute {name!r}")
