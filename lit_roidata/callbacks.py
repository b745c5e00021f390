"""Every Lightning callback of lit_roidata, importable from one place:
:class:`BroadcastParameters` (:mod:`lit_roidata.broadcast`: rank-0 weights, broadcast,
replica check), :class:`COCOEvaluator` (:mod:`lit_roidata.evaluation`: COCO AP),
:class:`BadImageReport` (:mod:`lit_roidata.skip`: skipped-image report),
:class:`BlobExchangeCallback` (:mod:`lit_roidata.exchange.callback`: cross-process blob
exchange), :class:`COCOPredictionWriter` (:mod:`lit_roidata.models.predict`: ``predict``
output) and :class:`StepTQDMProgressBar` (:mod:`lit_roidata.progress`: the step-based
progress bar).

Each is imported on first use, so ``import lit_roidata.callbacks`` stays cheap and does not
pull in optional dependencies. ``lit_roidata.callbacks.X`` and the defining module's
``X`` are the same class, so either works as a ``class_path`` in a config file. The
weights-file and broadcast helpers that used to live here moved to
:mod:`lit_roidata.weights` and :mod:`lit_roidata.broadcast`; their old names here still
work for one release, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

#: Callback name -> the module that defines it.
CALLBACKS: dict[str, str] = {
    "BroadcastParameters": "lit_roidata.broadcast",
    "COCOEvaluator": "lit_roidata.evaluation",
    "BadImageReport": "lit_roidata.skip",
    "BlobExchangeCallback": "lit_roidata.exchange.callback",
    "COCOPredictionWriter": "lit_roidata.models.predict",
    "StepTQDMProgressBar": "lit_roidata.progress",
}

#: Names that were defined here before the split -> their new module (deprecated here).
_MOVED: dict[str, str] = {
    "LoadReport": "lit_roidata.weights",
    "WeightsShapeError": "lit_roidata.weights",
    "load_weights_file": "lit_roidata.weights",
    "load_weights_into": "lit_roidata.weights",
    "ReplicaMismatchError": "lit_roidata.broadcast",
    "broadcast_module": "lit_roidata.broadcast",
    "verify_replicas": "lit_roidata.broadcast",
}

__all__ = list(CALLBACKS)


def __getattr__(name: str) -> Any:
    if name in CALLBACKS:
        value = getattr(importlib.import_module(CALLBACKS[name]), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        warnings.warn(f"lit_roidata.callbacks.{name} is deprecated and will be removed in the "
                      f"next release; import it from {_MOVED[name]} ({_MOVED[name]}.{name})",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module 'lit_roidata.callbacks' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
