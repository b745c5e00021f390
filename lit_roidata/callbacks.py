"""Every Lightning callback of lit_roidata, importable from one place:
:class:`GracefulStop` (:mod:`lit_roidata.loader_callbacks`: Ctrl-C / SIGTERM stop at a
clean step boundary), :class:`BadImageReport` (:mod:`lit_roidata.loader_callbacks`:
``on_bad_image="skip"``'s exchange and report),
:class:`BroadcastParameters` (:mod:`lit_roidata.broadcast`: rank-0 weights, broadcast,
replica check), :class:`COCOEvaluator` (:mod:`lit_roidata.evaluation`: COCO AP),
:class:`LVISEvaluator` (:mod:`lit_roidata.lvis_evaluation`: LVIS AP, APr, APc, APf),
:class:`BlobExchangeCallback` (:mod:`lit_roidata.exchange.callback`: cross-process blob
exchange), :class:`COCOPredictionWriter` (:mod:`lit_roidata.models.predict`: ``predict``
output) and :class:`StepTQDMProgressBar` (:mod:`lit_roidata.progress`: the step-based
progress bar).

Each is imported on first use, so ``import lit_roidata.callbacks`` stays cheap and does not
pull in optional dependencies. ``lit_roidata.callbacks.X`` and the defining module's
``X`` are the same class, so either works as a ``class_path`` in a config file.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Callback name -> the module that defines it.
CALLBACKS: dict[str, str] = {
    "BroadcastParameters": "lit_roidata.broadcast",
    "COCOEvaluator": "lit_roidata.evaluation",
    "LVISEvaluator": "lit_roidata.lvis_evaluation",
    "GracefulStop": "lit_roidata.loader_callbacks",
    "BadImageReport": "lit_roidata.loader_callbacks",
    "BlobExchangeCallback": "lit_roidata.exchange.callback",
    "COCOPredictionWriter": "lit_roidata.models.predict",
    "StepTQDMProgressBar": "lit_roidata.progress",
}

__all__ = list(CALLBACKS)


def __getattr__(name: str) -> Any:
    if name in CALLBACKS:
        value = getattr(importlib.import_module(CALLBACKS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'lit_roidata.callbacks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
