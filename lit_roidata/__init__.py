"""lit_roidata: Detectron's training-data pipeline for PyTorch Lightning.

The public entry points are :class:`lit_roidata.RoIDataModule` (the Lightning face),
:mod:`lit_roidata.config` (Detectron's option tree), :mod:`lit_roidata.catalog`,
:mod:`lit_roidata.roidb`, :mod:`lit_roidata.sampler`, :mod:`lit_roidata.minibatch`,
:mod:`lit_roidata.callbacks` and :mod:`lit_roidata.exchange`. These classes are for
``pytorch_lightning``; :mod:`lit_roidata.lightning` has the same ones for
``lightning.pytorch`` (``import lightning as L``).
"""

from __future__ import annotations

from lit_roidata._optional import MissingOptionalDependency, lazy_getattr
from lit_roidata._pickle_trust import UntrustedPickleError

__version__ = "0.1.0"
__all__ = ["DemoRoIDataModule", "MissingOptionalDependency", "RoIDataModule",
           "UntrustedPickleError", "__version__"]


# Imported lazily so that ``import lit_roidata.config`` stays cheap in workers.
__getattr__ = lazy_getattr(__name__, {"RoIDataModule": "lit_roidata.datamodule",
                                      "DemoRoIDataModule": "lit_roidata.demo.datamodule"})
