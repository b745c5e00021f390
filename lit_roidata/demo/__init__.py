"""The demo: a synthetic COCO-style dataset and a small detector that trains on it.

:func:`ensure_lvis_demo_data` / :func:`register_lvis_demo_datasets` make synthetic LVIS
v1-format data (long-tailed categories, neg / not-exhaustive lists, ``coco_url`` names).

``lit-roidata fit --config configs/demo.yaml`` uses :func:`ensure_demo_data` /
:func:`register_demo_datasets` to create the data on first use and
:class:`DemoRoIDataModule` (the data module on that data) and
:class:`DemoFastRCNN` as the model (:class:`DemoFasterRCNN` trains end to end from the
loader's RPN targets). For the cross-process blob exchange
(:mod:`lit_roidata.exchange`), :class:`RPNExchangeDemo` is a tiny FPN-RPN teacher/student
(``configs/exchange_*.yaml``) and :func:`demo_alignment_stream` / :func:`demo_batches` are
aligned synthetic streams. The models are imported lazily so that the
data part stays usable (and cheap to import) without touching torchvision.
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
