"""Finish a worker's compact blobs on the training device (after the host-to-device copy).

Workers can ship the large blobs compactly (``pixel_format="uint8"``,
``mask_format="compact"``, ``target_format="compact"``: docs/minibatch.md and
docs/rpn_retinanet.md); :func:`finalize_on_device` restores Detectron's exact blobs on the
device, where filling memory is nearly free. Every function runs on the input's device
(CPU or CUDA); :func:`finish_batch` is what ``RoIDataModule.on_after_batch_transfer`` runs.
The torchvision output's compact masks are pasted by :func:`paste_mask_crops`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, MutableMapping, Sequence

import cv2
import numpy as np
import torch

from lit_roidata.minibatch.names import RPN_BLOB_KINDS, RPN_COMPACT_KEYS

__all__ = ["normalize_on_device", "expand_masks_on_device", "expand_rpn_targets",
           "expand_sparse", "expand_targets", "finalize_on_device", "finish_batch",
           "paste_mask_crops", "paste_target_masks"]


@functools.lru_cache(maxsize=None)
def _mean_lut(pixel_means: tuple[float, ...], device: str) -> torch.Tensor:
    """``float32(float64(v) - mean)`` for every uint8 ``v``, channel by channel (768 values)."""
    values = np.arange(256, dtype=np.float64)[None, :] - np.asarray(pixel_means)[:, None]
    return torch.from_numpy(values.astype(np.float32).reshape(-1)).to(device)


def normalize_on_device(data_uint8: torch.Tensor, image_sizes_or_im_info: Any,
                        pixel_means: Sequence[float], *, exact: bool = True) -> torch.Tensor:
    """Turn a uint8 BGR NCHW blob into Detectron's float blob, on the tensor's device.

    Subtracts ``PIXEL_MEANS`` and zeroes the padding, so the result has Detectron's
    layout, dtype and padding. With ``exact=True`` each value is
    ``float32(float64(v) - mean)``, bit-identical to Detectron's in-place subtraction
    (a 768-entry lookup table); ``exact=False`` subtracts in float32 (may differ by
    one ulp). Meant for ``LightningDataModule.on_after_batch_transfer``.

    Args:
        data_uint8: ``(n, 3, H, W)`` uint8 tensor (BGR).
        image_sizes_or_im_info: ``(n, 2)`` ``(h, w)`` sizes, or ``(n, 3)`` ``im_info``
            rows (their first two columns), as tensor, array or nested lists.
        pixel_means: BGR means (``cfg.PIXEL_MEANS``).

    Returns:
        ``(n, 3, H, W)`` float32 tensor on the same device.
    """
    if data_uint8.dtype != torch.uint8 or data_uint8.dim() != 4 or data_uint8.shape[1] != 3:
        raise ValueError("normalize_on_device expects a (n, 3, H, W) uint8 tensor, got "
                         f"{tuple(data_uint8.shape)} {data_uint8.dtype}")
    s = image_sizes_or_im_info
    sizes = torch.as_tensor(np.asarray(s.cpu() if torch.is_tensor(s) else s, dtype=np.float64))
    if sizes.dim() != 2 or sizes.shape[0] != data_uint8.shape[0] or sizes.shape[1] not in (2, 3):
        raise ValueError(f"image sizes must be (n, 2) or (n, 3) with n={data_uint8.shape[0]}, "
                         f"got {tuple(sizes.shape)}")
    dev = data_uint8.device
    rows = sizes[:, :2].round().to(torch.int64).tolist()
    lut = _mean_lut(tuple(float(m) for m in pixel_means), str(dev)) if exact else None
    if exact and dev.type == "cpu":
        # one pass over the pixels: OpenCV's LUT maps each plane's h x w image region
        # through the channel's 256-entry table straight into the output (no int64 index
        # tensor, no gather), then only the padding is zeroed: ~14x faster, same values
        n, _, H, W = data_uint8.shape
        out = torch.empty((n, 3, H, W), dtype=torch.float32)
        src, dst, table = data_uint8.numpy(), out.numpy(), lut.numpy().reshape(3, 256)
        for i, (h, w) in enumerate(rows):
            h, w = max(0, min(int(h), H)), max(0, min(int(w), W))
            for c in range(3 if h and w else 0):
                region = dst[i, c, :h, :w]
                res = cv2.LUT(src[i, c, :h, :w], table[c], dst=region)
                if not np.shares_memory(res, region):  # OpenCV could not write in place
                    region[...] = res
            dst[i, :, h:, :] = 0
            dst[i, :, :h, w:] = 0
        return out
    if exact:
        out = lut[data_uint8.to(torch.int64) + torch.arange(0, 768, 256, device=dev)[:, None, None]]
    else:
        out = data_uint8.to(torch.float32) - torch.tensor(
            [float(m) for m in pixel_means], dtype=torch.float32, device=dev).view(1, 3, 1, 1)
    for i, (h, w) in enumerate(rows):  # zero the padding
        out[i, :, h:, :] = 0
        out[i, :, :h, w:] = 0
    return out


def expand_masks_on_device(masks: torch.Tensor, classes: torch.Tensor,
                           num_classes: int) -> torch.Tensor:
    """Detectron's class-specific mask targets from compact ones (Detectron semantics: mask
    targets).

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


def expand_rpn_targets(compact: Mapping[str, torch.Tensor], *,
                       new: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None
                       ) -> dict[str, torch.Tensor]:
    """Detectron's RPN wide blobs from the compact ones (``target_format="compact"``).

    Args:
        compact: the five ``rpn_compact_*`` tensors of
            :func:`lit_roidata.minibatch.rpn.add_rpn_blobs` (``compact=True``), all on
            one device.
        new: ``(shape, dtype) -> zeroed tensor`` for the blobs (default ``torch.zeros``
            on that device), e.g. shared memory in a DataLoader worker.

    Returns:
        ``rpn_labels_int32_wide``, ``rpn_bbox_targets_wide``,
        ``rpn_bbox_inside_weights_wide``, ``rpn_bbox_outside_weights_wide`` (suffixed
        ``_fpn<l>`` per FPN level), in Detectron's order, shapes ``(n, A, F, F)`` int32
        and ``(n, 4A, F, F)`` float32, on the same device: labels -1 and the rest 0
        except at the listed anchors, bit-identical to the worker-side blobs.
    """
    layout, rows, fg, targets, weights = (compact[k] for k in RPN_COMPACT_KEYS)
    layout, rows, fg = layout.detach().cpu().tolist(), rows.to(torch.int64), fg.to(torch.int64)
    n, dev = int(weights.shape[0]), weights.device
    new = new or (lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=dev))
    out: dict[str, torch.Tensor] = {}
    lo = 0
    for lvl, a, f in layout:
        hi = lo + f * f * a
        names = [k if lvl < 0 else f"{k}_fpn{lvl}" for k in RPN_BLOB_KINDS]
        labels = new((n, a, f, f), torch.int32).fill_(-1)
        tgt, inw, outw = (new((n, 4 * a, f, f), torch.float32) for _ in range(3))
        # (image, cell, anchor, its 4 channels) of level-local rows (a fastest), as columns
        def at(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            cell = torch.div(r[:, 1:2] - lo, a, rounding_mode="floor")
            anc = (r[:, 1:2] - lo) % a
            return r[:, :1], cell, anc, 4 * anc + torch.arange(4, device=dev)

        sel = rows[(rows[:, 1] >= lo) & (rows[:, 1] < hi)]
        img, cell, anc, ch = at(sel)
        pos = sel[:, 2] == 1
        labels.view(n, a, f * f)[img, anc, cell] = sel[:, 2:].to(torch.int32)
        outw.view(n, 4 * a, f * f)[img, ch, cell] = weights[img].expand(-1, 4)
        inw.view(n, 4 * a, f * f)[img[pos], ch[pos], cell[pos]] = 1.0
        sel_fg = (fg[:, 1] >= lo) & (fg[:, 1] < hi)
        img, cell, _, ch = at(fg[sel_fg])
        tgt.view(n, 4 * a, f * f)[img, ch, cell] = targets[sel_fg]
        out.update(zip(names, (labels, tgt, inw, outw)))
        lo = hi
    return out


def expand_sparse(rows: torch.Tensor, shape: Any, fill: int = 0) -> torch.Tensor:
    """A dense int32 blob from ``(flat index, value)`` rows (RetinaNet's sparse labels).

    Args:
        rows: int32 ``(K, 2)``; shape: the blob's shape (tensor or sequence);
        fill: the value everywhere else (0, background, for RetinaNet labels).
    """
    shape = [int(x) for x in (shape.detach().cpu().tolist() if torch.is_tensor(shape) else shape)]
    out = torch.full(shape, fill, dtype=torch.int32, device=rows.device)
    out.view(-1)[rows[:, 0].to(torch.int64)] = rows[:, 1].to(torch.int32)
    return out


def paste_mask_crops(bits: torch.Tensor, boxes: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """Full-image ``(n, h, w)`` uint8 masks from a torchvision target's compact ones, on
    ``bits``' device (bit-identical to the masks built in the worker).

    Args:
        bits: ``mask_crops``: every mask's crop, row-major, concatenated and bit-packed
            (most significant bit first, as ``np.packbits``).
        boxes: ``mask_boxes``: ``(n, 4)`` crop ``y0, x0, y1, x1`` (ends exclusive; empty
            for an empty mask); size: ``(h, w)``, the image's size.
    """
    rows, dev, shape = boxes.tolist(), bits.device, (len(boxes), int(size[0]), int(size[1]))
    if dev.type == "cpu":  # NumPy: single-threaded, no intra-op pool to wake per small op
        out, flat = torch.from_numpy(np.zeros(shape, np.uint8)), torch.from_numpy(
            np.unpackbits(bits.numpy()))
    else:
        out = torch.zeros(shape, dtype=torch.uint8, device=dev)
        flat = ((bits[:, None] >> torch.arange(7, -1, -1, dtype=torch.uint8, device=dev)) & 1
                ).view(-1)
    lo = 0
    for j, (y0, x0, y1, x1) in enumerate(rows):
        n = (y1 - y0) * (x1 - x0)
        out[j, y0:y1, x0:x1] = flat[lo:lo + n].view(y1 - y0, x1 - x0)
        lo += n
    return out


def paste_target_masks(batch: Any) -> Any:
    """``finish_batch`` of a torchvision ``(images, targets)`` batch: each target's
    ``mask_crops`` / ``mask_boxes`` replaced, in place and at their position, by ``masks``
    (a ``tv_tensors.Mask``); anything else is returned unchanged."""
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and isinstance(batch[1], list)):
        return batch
    for image, target in zip(*batch):
        if isinstance(target, dict) and "mask_boxes" in target:
            from torchvision import tv_tensors

            masks = tv_tensors.Mask(paste_mask_crops(
                target["mask_crops"], target["mask_boxes"], image.shape[-2:]))
            items = [("masks", masks) if k == "mask_crops" else (k, v)
                     for k, v in target.items() if k != "mask_boxes"]
            target.clear()
            target.update(items)
    return batch


def expand_targets(batch: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Replace compact RPN / RetinaNet targets in ``batch`` by Detectron's blobs, in place.

    The expanded blobs take the compact ones' place, so the key order is Detectron's
    blob order again (:func:`~lit_roidata.minibatch.get_minibatch_blob_names`). A batch
    without compact targets is returned unchanged.
    """
    has_rpn = RPN_COMPACT_KEYS[0] in batch
    if not has_rpn and not any(k.endswith("_sparse") for k in batch):
        return batch
    rpn = expand_rpn_targets({k: batch[k] for k in RPN_COMPACT_KEYS}) if has_rpn else {}
    items = dict(batch)
    batch.clear()
    for k, v in items.items():
        if k in RPN_COMPACT_KEYS:
            if k == RPN_COMPACT_KEYS[0]:
                batch.update(rpn)
        elif k.endswith("_sparse") and torch.is_tensor(v):
            base = k[: -len("_sparse")]
            batch[base] = expand_sparse(v, items[f"{base}_shape"])
        elif not (k.endswith("_shape") and f"{k[: -len('_shape')]}_sparse" in items):
            batch[k] = v
    return batch


def finalize_on_device(batch: MutableMapping[str, Any], pixel_means: Sequence[float],
                       num_classes: int, *, image_sizes: Any = None,
                       expand_compact_targets: bool = True) -> MutableMapping[str, Any]:
    """Turn a worker's compact blobs into Detectron's, in place, on their device.

    Normalises a uint8 ``data`` blob (:func:`normalize_on_device` with ``image_sizes``,
    ``(n, 2)`` unpadded ``(h, w)``, by default ``_meta["image_sizes"]`` or
    ``_meta["im_info"]``), expands compact masks (``mask_class_int32``, then removed) with
    :func:`expand_masks_on_device`, and compact RPN / RetinaNet targets with
    :func:`expand_targets` (unless ``expand_compact_targets=False``: a model that computes
    its loss on the sampled anchors keeps them). A batch already in Detectron's format is
    returned unchanged. Meant for ``LightningDataModule.on_after_batch_transfer``.
    """
    data = batch.get("data")
    if isinstance(data, torch.Tensor) and data.dtype == torch.uint8:
        meta = batch.get("_meta") or {}
        sizes = next((x for x in (image_sizes, meta.get("image_sizes"), meta.get("im_info"))
                      if x is not None), None)
        if sizes is None:
            raise ValueError("finalize_on_device: a uint8 'data' blob needs _meta['image_sizes'] "
                             "(or 'im_info') to zero the padding")
        batch["data"] = normalize_on_device(data, sizes, pixel_means)
    if "mask_class_int32" in batch:
        batch["masks_int32"] = expand_masks_on_device(
            batch["masks_int32"], batch.pop("mask_class_int32"), num_classes)
    if expand_compact_targets:
        expand_targets(batch)
    return batch


def finish_batch(batch: Any, cfg: Any, *, expand_compact_targets: bool = True) -> Any:
    """Finish one transferred batch on its device (``on_after_batch_transfer``).

    A dict batch (``output_format="detectron"``, evaluation batches) is finished in place
    by :func:`finalize_on_device` with the config's ``PIXEL_MEANS`` and
    ``MODEL.NUM_CLASSES`` (image sizes: ``_meta``, else ``im_info``, else the whole
    blob); a ``TorchvisionBatch`` gets its compact masks pasted (:func:`paste_mask_crops`).
    ``expand_compact_targets=False`` keeps compact RPN / RetinaNet targets
    (``target_format="compact_raw"``).
    """
    if not isinstance(batch, dict):
        return paste_target_masks(batch)
    data, sizes = batch.get("data"), None
    if isinstance(data, torch.Tensor) and data.dtype == torch.uint8 and data.dim() == 4:
        n, _, h, w = data.shape
        sizes = (batch.get("_meta") or {}).get("image_sizes", batch.get("im_info", [[h, w]] * n))
    return finalize_on_device(batch, cfg.PIXEL_MEANS, int(cfg.MODEL.NUM_CLASSES),
                              image_sizes=sizes, expand_compact_targets=expand_compact_targets)
