"""Repeat factors for long-tailed datasets (LVIS): Detectron2's category-frequency rule.

``r(I) = max over the categories c in I of max(1, sqrt(t / f(c)))`` over the training
roidb's distinct images, in Detectron2's float64 arithmetic rounded once to float32; the
rule and the side file ``repeat_factors-<key>.npy``: docs/sampler.md, "Repeat factors".
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from typing import Any

import numpy as np

from lit_roidata.osutil import atomic_write

__all__ = ["repeat_factors_from_category_frequency", "repeat_factors_for_roidb",
           "check_repeat_threshold"]

log = logging.getLogger(__name__)

_SIDE_VERSION = 1


def check_repeat_threshold(value: Any, name: str = "sampling.repeat_factor_threshold") -> float:
    """``value`` as a valid repeat-factor threshold (a finite float > 0), else ``ValueError``
    naming ``name`` and the fix."""
    try:
        t = float(value)
    except (TypeError, ValueError):
        t = float("nan")
    if isinstance(value, bool) or not math.isfinite(t) or t <= 0:
        raise ValueError(f"{name}={value!r}: the repeat-factor threshold must be a finite "
                         "number > 0 (LVIS uses 0.001; images whose rarest category is in "
                         "fewer than that fraction of images are repeated). To turn repeat "
                         "factors off, leave it unset (null)")
    return t


def repeat_factors_from_category_frequency(img_gt_off: Any, gt_classes: Any,
                                           repeat_thresh: float, *, images: Any = None,
                                           sqrt: bool = True) -> np.ndarray:
    """Per-image float32 repeat factors (module doc), one per element of ``images``.

    ``img_gt_off`` (n + 1 offsets) and ``gt_classes`` (any integer labelling) are the
    roidb's columns; ``images`` are the distinct image rows whose categories are counted
    (default: all); ``sqrt=False`` uses ``max(1, t / f(c))``. ValueError: a bad
    threshold, or ``images`` with repeats or out of range.
    """
    t = check_repeat_threshold(repeat_thresh, "repeat_thresh")
    off = np.asarray(img_gt_off, dtype=np.int64).reshape(-1)
    n_rows = off.size - 1
    images = (np.arange(n_rows, dtype=np.int64) if images is None
              else np.asarray(images, dtype=np.int64).reshape(-1))
    if images.size and (images.min() < 0 or images.max() >= n_rows):
        raise ValueError(f"images: rows must lie in [0, {n_rows})")
    sel = np.zeros(n_rows, dtype=bool)
    sel[images] = True
    if int(sel.sum()) != images.size:
        raise ValueError("images: each image row may be given once (a flipped entry is the "
                         "same image: pass distinct rows)")
    num_images = images.size
    out = np.ones(n_rows, dtype=np.float64)
    cls_all = np.asarray(gt_classes).reshape(-1)
    if num_images == 0 or cls_all.size == 0:
        return out[images].astype(np.float32)
    idx_t = np.int32 if n_rows < 2**31 else np.int64
    row_img = np.repeat(np.arange(n_rows, dtype=idx_t), np.diff(off))
    keep = slice(None) if num_images == n_rows else sel[row_img]  # every image row: no mask
    img = row_img[keep].astype(np.int64)
    cls = cls_all[: row_img.size][keep].astype(np.int64)
    del row_img
    if cls.size == 0:
        return out[images].astype(np.float32)
    cls -= int(cls.min())
    k = int(cls.max()) + 1
    # One (image, category) pair per category present in an image. The gt rows are
    # grouped by image, so the keys are nearly sorted: a stable (radix) sort is cheap.
    key = np.sort(img * k + cls, kind="stable")
    key = key[np.r_[True, key[1:] != key[:-1]]]  # the first of each run
    pair_img, pair_cls = np.divmod(key, k)
    freq = np.bincount(pair_cls, minlength=k) / num_images  # f(c), Detectron2's v / n
    present = freq > 0
    rep_c = np.ones(k, dtype=np.float64)
    ratio = t / freq[present]
    rep_c[present] = np.maximum(1.0, np.sqrt(ratio) if sqrt else ratio)
    starts = np.flatnonzero(np.diff(pair_img, prepend=-1))
    out[pair_img[starts]] = np.maximum.reduceat(rep_c[pair_cls], starts)
    return out[images].astype(np.float32)


def _side_name(key: str, t: float, sqrt: bool) -> str:
    doc = json.dumps({"v": _SIDE_VERSION, "roidb": key, "t": repr(float(t)), "sqrt": bool(sqrt)},
                     sort_keys=True)
    return f"repeat_factors-{hashlib.sha256(doc.encode()).hexdigest()[:20]}.npy"


def repeat_factors_for_roidb(roidb: Any, repeat_thresh: float, *, sqrt: bool = True,
                             cache: bool = True) -> np.ndarray:
    """Read-only float32 repeat factors (>= 1) of each entry of a training
    :class:`~lit_roidata.roidb.columnar.RoIDB` (a flip gets its original's), read from or
    written to (``cache``) the side file in its cache folder. ``repeat_thresh`` and
    ``sqrt``: Detectron2's ``DATALOADER.REPEAT_THRESHOLD`` / ``REPEAT_SQRT``. ValueError: a
    bad threshold; TypeError: not a columnar roidb.
    """
    t = check_repeat_threshold(repeat_thresh)
    if not hasattr(roidb, "entry_image_rows") or not hasattr(roidb, "column"):
        raise TypeError("repeat factors need a lit_roidata RoIDB (the columnar training "
                        f"roidb), got {type(roidb).__name__}; for other data compute them "
                        "with repeat_factors_from_category_frequency and pass "
                        "RoIBatchSampler(repeat_factors=...)")
    key = (getattr(roidb, "manifest", None) or {}).get("key")
    path = None
    if cache and key and getattr(roidb, "path", None):
        path = os.path.join(roidb.path, _side_name(str(key), t, sqrt))
        try:
            arr = np.load(path, mmap_mode=None, allow_pickle=False)
            if arr.dtype == np.float32 and arr.shape == (len(roidb),):
                arr.setflags(write=False)
                return arr
            log.warning("%s: unexpected shape/dtype %s %s; recomputing", path, arr.shape,
                        arr.dtype)
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("%s: unreadable (%s); recomputing", path, exc)
    images = np.unique(roidb.entry_image_rows)
    per_image = repeat_factors_from_category_frequency(
        roidb.column("img_gt_off"), roidb.column("gt_classes"), t, images=images, sqrt=sqrt)
    out = per_image[np.searchsorted(images, roidb.entry_image_rows)]
    if path is not None:  # a failure (read-only cache) only costs a recomputation
        try:
            with atomic_write(path) as fh:
                np.save(fh, out, allow_pickle=False)
        except OSError as exc:
            log.info("repeat factors not cached in %s (%s)", os.path.dirname(path), exc)
    out.setflags(write=False)
    return out
