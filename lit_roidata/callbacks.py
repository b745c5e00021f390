"""Every Lightning callback of lit_roidata, importable from one place (:data:`CALLBACKS`
names the module defining each; docs/callbacks.md describes them).

Each is imported on first use, so ``import lit_roidata.callbacks`` stays cheap and does not
pull in optional dependencies. ``lit_roidata.callbacks.X`` and the defining module's
``X`` are the same class, so either works as a ``class_path`` in a config file.
"""

from __future__ import annotations

from lit_roidata._optional import lazy_getattr

#: Callback name -> the module that defines it.
CALLBACKS: dict[str, str] = {
    "BroadcastParameters": "lit_roidata.broadcast",
    "COCOEvaluator": "lit_roidata.evaluation",
    "LVISEvaluator": "lit_roidata.lvis_evaluation",
    "VOCEvaluator": "lit_roidata.voc_evaluation",
    "GracefulStop": "lit_roidata.loader_callbacks",
    "BadImageReport": "lit_roidata.loader_callbacks",
    "BlobExchangeCallback": "lit_roidata.exchange.callback",
    "COCOPredictionWriter": "lit_roidata.models.predict",
    "StepTQDMProgressBar": "lit_roidata.progress",
}

__all__ = list(CALLBACKS)


__getattr__ = lazy_getattr(__name__, CALLBACKS)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
