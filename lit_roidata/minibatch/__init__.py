"""Minibatch blobs: image blob and per-family training targets (Detectron semantics: minibatch
primitives).

Public API (a contract with the rest of ``lit_roidata``):

* :func:`get_minibatch_blob_names` — blob names for the configured family (Detectron
  semantics: blob names);
* :func:`get_minibatch` — ``(blobs, valid)`` for a list of roidb entries;
* :func:`get_image_blob` — Detectron's ``data`` blob and ``im_scales``;
* :func:`normalize_on_device` — uint8 blob to Detectron's float blob on the device.

``rpn``, ``retinanet``, ``anchors`` and ``proposal_labels`` are separate modules,
imported on first use.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from lit_roidata.minibatch.core import build_minibatch, get_minibatch
from lit_roidata.minibatch.decode import BadImageError
from lit_roidata.minibatch.image import PIXEL_FORMATS, get_image_blob, normalize_on_device
from lit_roidata.minibatch.names import get_minibatch_blob_names

__all__ = [
    "BadImageError",
    "PIXEL_FORMATS",
    "build_minibatch",
    "get_image_blob",
    "get_minibatch",
    "get_minibatch_blob_names",
    "normalize_on_device",
    "proposal_labels",
]

_LAZY_MODULES = ("proposal_labels", "rpn", "retinanet", "anchors", "torchvision_format",
                 "augment")


class _CallableModule(types.ModuleType):
    """The ``proposal_labels`` module, callable as its ``proposal_labels`` function.

    ``lit_roidata.minibatch.proposal_labels(rois, entries, im_scales, cfg, rng)`` is the
    public spelling (issue 5); the module of the same name stays importable.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["proposal_labels"](*args, **kwargs)


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value: Any) -> None:
        # The import system sets the package attribute when the submodule loads.
        if name == "proposal_labels" and type(value) is types.ModuleType:
            value.__class__ = _CallableModule
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return importlib.import_module(f"lit_roidata.minibatch.{name}")
    raise AttributeError(f"module 'lit_roidata.minibatch' has no attribute {name!r}")
