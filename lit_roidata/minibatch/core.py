"""``get_minibatch``: one minibatch of blobs from roidb entries (Detectron semantics: minibatch
primitives; minibatch validity)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from lit_roidata import rng as rng_mod
from lit_roidata.minibatch.image import Allocator, ImageBatch, ImageLoader, build_image_blob
from lit_roidata.minibatch.model_type import blob_family
from lit_roidata.minibatch.names import get_minibatch_blob_names

__all__ = ["Minibatch", "build_minibatch", "get_minibatch"]


@dataclass
class Minibatch:
    """Blobs of one minibatch plus what the worker reports alongside them."""

    blobs: dict[str, Any]
    valid: bool
    image: ImageBatch


def build_minibatch(entries: Sequence[Mapping[str, Any]], cfg: Any, rng: rng_mod.RNG, *,
                    pixel_format: str = "detectron", loader: ImageLoader | None = None,
                    augment: Any = None, alloc: Allocator | None = None,
                    compact_masks: bool = False, fix_rpn_quirks: bool = False,
                    compact_targets: bool = False) -> Minibatch:
    """:func:`get_minibatch` with the worker's options and the image metadata kept.

    Args:
        entries, cfg, rng: as :func:`get_minibatch`.
        pixel_format: ``"detectron"`` (float32, Detectron's blob) or ``"uint8"``.
        loader: ``entry -> BGR uint8 HWC`` image reader (default: decode the file).
        augment: optional per-image augmentation applied before scaling.
        alloc: optional allocator for the large blobs (``data``, ``masks_int32``, the
            RPN wide blobs), e.g. shared memory, so a worker sends them without a copy.
        compact_masks: ship class-specific masks compactly (``mask_format="compact"``).
        fix_rpn_quirks: passed to the RPN target builder (Detectron quirks Q2/Q3 fixed).
        compact_targets: ship RPN / RetinaNet targets compactly (``target_format=
            "compact"``; docs/rpn_retinanet.md).
    """
    blobs: dict[str, Any] = {k: [] for k in get_minibatch_blob_names(cfg)}
    image = build_image_blob(entries, cfg, rng, pixel_format=pixel_format, loader=loader,
                             augment=augment, alloc=alloc)
    blobs["data"] = image.data
    family = blob_family(cfg)
    kwargs = {"rpn": dict(compact=compact_targets, fix_rpn_quirks=fix_rpn_quirks, alloc=alloc),
              "retinanet": dict(compact=compact_targets),
              "fast_rcnn": dict(alloc=alloc, compact_masks=compact_masks)}[family]
    # imported on first use: only their family needs the RPN / RetinaNet modules
    add = getattr(importlib.import_module(f"lit_roidata.minibatch.{family}"), f"add_{family}_blobs")
    valid = add(blobs, image.im_scales, image.entries, cfg, rng, **kwargs)
    return Minibatch(blobs=blobs, valid=bool(valid), image=image)


def get_minibatch(entries: Sequence[Mapping[str, Any]], cfg: Any,
                  rng: rng_mod.RNG) -> tuple[dict[str, np.ndarray], bool]:
    """Detectron's ``get_minibatch``: every training blob for one minibatch.

    The family is :func:`~lit_roidata.minibatch.model_type.blob_family`'s (Detectron's
    precedence: RPN, else RetinaNet, else Fast R-CNN from precomputed proposals). With a
    ``numpy.random.RandomState`` the draws follow Detectron's call order: the scale
    ``randint`` for all images, then per image the fg ``choice``, the bg ``choice``
    and (keypoints) the keypoint ``choice``.

    ``entries`` are roidb entries (Mappings with Detectron's field names), ``rng`` a
    ``numpy.random.Generator`` (e.g. :func:`lit_roidata.rng.block_rng`) or ``RandomState``.
    Returns ``(blobs, valid)``: blob name -> NumPy array in :func:`get_minibatch_blob_names`
    order (``data`` is Detectron's float32 blob) and the minibatch's validity. Raises
    :class:`BadImageError` for an image that is missing, undecodable or of the wrong size.
    """
    mb = build_minibatch(entries, cfg, rng, pixel_format="detectron")
    return mb.blobs, mb.valid
