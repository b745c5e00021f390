"""The demo: a synthetic COCO-style dataset and a small detector that trains on it.

``lit-roidata fit --config configs/demo.yaml`` uses :func:`ensure_demo_data` /
:func:`register_demo_datasets` to create the data on first use and
:class:`DemoRoIDataModule` (the data module on that data) and
:class:`DemoFastRCNN` as the model (:class:`DemoFasterRCNN` trains end to end from the
loader's RPN targets). The models are imported lazily so that the
data part stays usable (and cheap to import) without touching torchvision.
"""

from __future__ import annotations

from typing import Any

from lit_roidata.demo.data import (
    DEMO_CATEGORIES,
    DEMO_TRAIN_DATASETS,
    DEMO_VAL_DATASETS,
    DemoDatasets,
    ensure_demo_data,
    register_demo_datasets,
)

__all__ = [
    "DEMO_CATEGORIES",
    "DEMO_TRAIN_DATASETS",
    "DEMO_VAL_DATASETS",
    "DemoDatasets",
    "DemoFastRCNN",
    "DemoRoIDataModule",
    "DemoFasterRCNN",
    "ensure_demo_data",
    "register_demo_datasets",
]


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
    raise AttributeError(f"module 'lit_roidata.demo' has no attribute {name!r}")
