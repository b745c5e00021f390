"""The demo: synthetic COCO- and LVIS-format data and small detectors that train on it.

``configs/demo.yaml`` uses :class:`DemoRoIDataModule` and :class:`DemoFastRCNN`
(:class:`DemoFasterRCNN` trains end to end from the RPN targets); :class:`RPNExchangeDemo`
and :func:`demo_alignment_stream` / :func:`demo_batches` serve the exchange demo. The
models are imported lazily (the data part needs no torchvision). See docs/demo.md.
"""

from __future__ import annotations

from lit_roidata._optional import lazy_getattr
from lit_roidata.demo.data import (DEMO_CATEGORIES, DEMO_TRAIN_DATASETS, DEMO_VAL_DATASETS,
                                   DemoDatasets, ensure_demo_data, register_demo_datasets)
from lit_roidata.demo.lvis_data import (LVIS_DEMO_DATASETS, ensure_lvis_demo_data,
                                        register_lvis_demo_datasets)

__all__ = ["DEMO_CATEGORIES", "DEMO_TRAIN_DATASETS", "DEMO_VAL_DATASETS", "LVIS_DEMO_DATASETS",
           "DemoDatasets", "DemoFastRCNN", "DemoRoIDataModule", "DemoFasterRCNN", "RPNExchangeDemo",
           "demo_alignment_stream", "demo_batches", "ensure_demo_data", "ensure_lvis_demo_data",
           "register_demo_datasets", "register_lvis_demo_datasets"]


#: Names imported on first use (the models import torchvision) -> their module.
__getattr__ = lazy_getattr(__name__, {
    name: f"lit_roidata.demo.{module}" for name, module in (
        ("DemoFastRCNN", "model"), ("DemoRoIDataModule", "datamodule"),
        ("DemoFasterRCNN", "faster"), ("RPNExchangeDemo", "rpn_exchange_model"),
        ("demo_alignment_stream", "exchange_streams"), ("demo_batches", "exchange_streams"))})
