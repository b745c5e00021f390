"""The minibatch code as it was before the speed work (issue 10), kept as test oracles.

Each function is a verbatim copy of the package's implementation at the time it was
replaced; the equivalence tests compare the current code to these on many inputs.
"""

from __future__ import annotations

from typing import Any, Mapping

import cv2
import numpy as np
import pycocotools.mask as mask_util
import torch
from torchvision import tv_tensors

from lit_roidata.minibatch.mask import segm_as_rle, segm_polygons
from lit_roidata.minibatch.transport import shared_empty


def tv_masks(entry: Mapping[str, Any], rows: np.ndarray, scale: float, h: int, w: int,
             shared: bool = False) -> torch.Tensor:
    """torchvision_format._masks: one frPyObjects + merge + full decode per instance."""
    t = (shared_empty((rows.size, h, w), torch.uint8).zero_() if shared
         else torch.zeros((rows.size, h, w), dtype=torch.uint8))
    out = t.numpy()
    height, width = int(entry["height"]), int(entry["width"])
    for j, r in enumerate(rows):
        segm = entry["segms"][r]
        parts = segm_polygons(segm)
        if parts:
            rles = mask_util.frPyObjects([p.astype(np.float64) * scale for p in parts], h, w)
            out[j] = mask_util.decode(mask_util.merge(rles))
            continue
        rle = segm_as_rle(segm, height, width)
        if rle is not None:
            full = mask_util.decode(rle)
            out[j] = cv2.resize(full, (w, h), interpolation=cv2.INTER_NEAREST)
    return t


def tv_image_tensor(im: np.ndarray, pixel_format: str, shared: bool = False) -> tv_tensors.Image:
    """torchvision_format._image_tensor: a strided transpose copy."""
    src = im[:, :, ::-1] if pixel_format == "uint8" else im  # uint8: BGR -> RGB
    if shared:
        t = shared_empty((im.shape[2], im.shape[0], im.shape[1]), im.dtype)
        t.numpy()[...] = src.transpose(2, 0, 1)
        return tv_tensors.Image(t)
    return tv_tensors.Image(torch.from_numpy(np.ascontiguousarray(src.transpose(2, 0, 1))))
