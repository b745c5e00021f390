"""lit_roidata for ``import lightning as L`` (the ``lightning.pytorch`` namespace).

The classes of :mod:`lit_roidata` bound to ``lightning.pytorch`` (same code, same
arguments), and ``python -m lit_roidata.lightning``, ``lit-roidata`` with that namespace's
LightningCLI. Needs ``pip install "lit_roidata[lightning]"``; see docs/cli.md::

    from lit_roidata.lightning import DemoFastRCNN, DemoRoIDataModule
"""

from __future__ import annotations

from typing import Any

from lit_roidata import cli
from lit_roidata._lightning import LIGHTNING, bind, bound_classes, import_namespace

import_namespace(LIGHTNING)  # a clear error naming the extra when `lightning` is missing

#: Public name here -> ``module:name`` of the ``pytorch_lightning`` class it binds (every
#: Lightning-derived class of lit_roidata: tests/test_lightning_namespaces.py checks it).
CLASSES: dict[str, str] = {name: f"lit_roidata.{module}:{name}" for module, names in (
    ("datamodule", "RoIDataModule"), ("demo.datamodule", "DemoRoIDataModule"),
    ("broadcast", "BroadcastParameters"), ("loader_callbacks", "BadImageReport GracefulStop"),
    ("evaluation", "COCOEvaluator"), ("lvis_evaluation", "LVISEvaluator"),
    ("voc_evaluation", "VOCEvaluator"),
    ("progress", "StepTQDMProgressBar"), ("exchange.callback", "BlobExchangeCallback"),
    ("models.predict", "COCOPredictionWriter"), ("models.detector", "TorchvisionDetector"),
    ("demo.model", "DemoFastRCNN"), ("demo.faster", "DemoFasterRCNN"),
    ("demo.rpn_exchange_model", "RPNExchangeDemo"), ("trainer_cli", "RoIDataCLI"))
    for name in names.split()}

__all__ = [*CLASSES, "cli_main", "main"]


def _source(name: str) -> type:
    import importlib

    module, attr = CLASSES[name].split(":")
    return getattr(importlib.import_module(module), attr)


def __getattr__(name: str) -> Any:
    # Bound on first use (importing every class would import torchvision's models, ...).
    if name in CLASSES:
        globals()[name] = cls = bind(_source(name), LIGHTNING)
        return cls
    for cls in bound_classes(LIGHTNING):  # bound on the fly (lit_roidata.lightning.bind)
        if cls.__qualname__ == name:
            return cls
    raise AttributeError(f"module 'lit_roidata.lightning' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def cli_main(args: Any = None, run: bool = True) -> Any:
    """:func:`lit_roidata.cli.cli_main` with ``lightning.pytorch``'s LightningCLI."""
    return cli.cli_main(args, run, namespace=LIGHTNING)


def main(argv: Any = None) -> int:
    """``python -m lit_roidata.lightning``: :func:`lit_roidata.cli.main` (the Lightning
    subcommands and the data tools) with ``lightning.pytorch``'s LightningCLI."""
    return cli.main(argv, namespace=LIGHTNING)
