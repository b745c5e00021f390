"""Finish a worker's compact blobs on the training device (after the host-to-device copy).

Two blobs dominate a worker's output: the image (``data``) and, for Mask R-CNN, the
class-specific ``masks_int32`` of shape ``(n, NUM_CLASSES * M * M)`` that is -1 except
one slot per row (65 MB per batch at COCO settings). Workers can ship both compactly
(``pixel_format="uint8"``, ``mask_format="compact"``); :func:`finalize_on_device`
restores Detectron's exact blobs on the device, where filling memory is nearly free.
"""

from __future__ import annotations

from typing import Any, MutableMapping, Sequence

import torch

from lit_roidata.minibatch.image import normalize_on_device

__all__ = ["expand_masks_on_device", "finalize_on_device"]


def expand_masks_on_device(masks: torch.Tensor, classes: torch.Tensor,
                           num_classes: int) -> torch.Tensor:
    """Detectron's class-specific mask targets from compact ones (spec §6.5).

    Args:
        masks: ``(n, M*M)`` int32 targets (values -1/0/1).
        classes: ``(n,)`` class of each row; rows with class 0 (the bg placeholder)
            stay all -1.
        num_classes: ``MODEL.NUM_CLASSES``.

    Returns:
        ``(n, num_classes * M * M)`` int32, identical to the worker-side expansion.
    """
    n, m2 = masks.shape
    out = masks.new_full((n, num_classes, m2), -1)
    rows = torch.nonzero(classes > 0).squeeze(1)
    out[rows, classes[rows].long()] = masks[rows]
    return out.view(n, num_classes * m2)


def finalize_on_device(batch: MutableMapping[str, Any], pixel_means: Sequence[float],
                       num_classes: int, *, image_sizes: Any = None) -> MutableMapping[str, Any]:
    """Turn a worker's compact blobs into Detectron's, in place, on their device.

    Normalises a uint8 ``data`` blob (:func:`normalize_on_device`, using
    ``_meta["image_sizes"]``) and expands compact masks (``mask_class_int32`` present)
    with :func:`expand_masks_on_device`; ``mask_class_int32`` is removed. A batch that
    is already in Detectron's format is returned unchanged. Meant for
    ``LightningDataModule.on_after_batch_transfer``. ``image_sizes`` (``(n, 2)``
    unpadded ``(h, w)``), when given, is used instead of the ``_meta`` lookup.
    """
    data = batch.get("data")
    if isinstance(data, torch.Tensor) and data.dtype == torch.uint8:
        meta = batch.get("_meta") or {}
        sizes = meta.get("image_sizes") if image_sizes is None else image_sizes
        if sizes is None:
            sizes = meta.get("im_info")
        if sizes is None:
            raise ValueError("finalize_on_device: a uint8 'data' blob needs _meta['image_sizes'] "
                             "(or 'im_info') to zero the padding")
        batch["data"] = normalize_on_device(data, sizes, pixel_means)
    if "mask_class_int32" in batch:
        classes = batch.pop("mask_class_int32")
        batch["masks_int32"] = expand_masks_on_device(batch["masks_int32"], classes, num_classes)
    return batch
