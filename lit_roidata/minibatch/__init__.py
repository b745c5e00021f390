"""Minibatch blobs: image blob and per-family training targets (docs/minibatch.md).

Public API: :func:`get_minibatch_blob_names`, :func:`get_minibatch` (``(blobs, valid)``),
:func:`build_minibatch`, :func:`get_image_blob`, :func:`normalize_on_device` and
:func:`proposal_labels` (second stage, end to end). ``rpn``, ``retinanet``, ``anchors``,
``torchvision_format`` and ``augment`` are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from lit_roidata.minibatch.core import build_minibatch, get_minibatch
from lit_roidata.minibatch.decode import BadImageError
from lit_roidata.minibatch.image import PIXEL_FORMATS, get_image_blob, normalize_on_device
from lit_roidata.minibatch.names import get_minibatch_blob_names
from lit_roidata.minibatch.second_stage import proposal_labels

__all__ = ["BadImageError", "PIXEL_FORMATS", "build_minibatch", "get_image_blob", "get_minibatch",
           "get_minibatch_blob_names", "normalize_on_device", "proposal_labels"]


def __getattr__(name: str) -> Any:
    if name in ("rpn", "retinanet", "anchors", "torchvision_format", "augment"):
        return importlib.import_module(f"lit_roidata.minibatch.{name}")
    raise AttributeError(f"module 'lit_roidata.minibatch' has no attribute {name!r}")
