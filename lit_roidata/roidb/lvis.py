"""LVIS-format annotation files (``format: lvis`` in the catalog)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from lit_roidata.roidb.decode import LVIS_IMAGE_LISTS, RawCoco, decode_coco
from lit_roidata.roidb.info import DatasetInfo, RoIDBInputError
from lit_roidata.roidb.segms import offsets, take_ranges

__all__ = ["LVIS_IMAGE_LISTS", "IMAGE_LIST_COLUMNS", "decode_lvis", "file_name_from_coco_url",
           "lvis_image_lists"]

#: Their columns in the roidb cache: entry field → (per-image offsets, contiguous classes).
#: Written only when a dataset of the roidb is LVIS (a COCO roidb has none of them).
IMAGE_LIST_COLUMNS = {key: (f"img_{short}_off", f"{short}_classes")
                      for key, short in LVIS_IMAGE_LISTS.items()}


def file_name_from_coco_url(url: str) -> Optional[str]:
    """``<split folder>/<file>`` from a ``coco_url`` (its last two path parts), or
    ``None`` when the URL has fewer than two non-empty parts."""
    parts = url.split("/")[-2:]
    return parts[0] + "/" + parts[1] if len(parts) == 2 and all(parts) else None


def decode_lvis(path: str, *, fast: bool = True) -> RawCoco:
    """Decode an LVIS json: :func:`~lit_roidata.roidb.decode.decode_coco` with the LVIS
    image fields, file names resolved from ``coco_url`` where absent, categories sorted
    by id, and the neg / not-exhaustive lists checked against the categories.

    Raises:
        RoIDBInputError: an image with neither ``file_name`` nor a usable ``coco_url``;
            a neg / not-exhaustive id that is not a category (file, image id, fix).
    """
    raw = decode_coco(path, fast=fast, lvis=True)
    urls = raw.coco_urls or [None] * len(raw.file_names)
    names = [n if n is not None or u is None else file_name_from_coco_url(u)
             for n, u in zip(raw.file_names, urls)]
    bad = [i for i, n in enumerate(names) if n is None]
    if bad:
        i = bad[0]
        what = ("neither 'file_name' nor 'coco_url'" if urls[i] is None else
                f"no 'file_name' and a coco_url {urls[i]!r:.80} without a folder and a file name")
        raise RoIDBInputError(
            f"{path}: image id {int(raw.img_id[i])} has {what} ({len(bad)} image(s) have this "
            f"problem). Give each image a 'coco_url' ending in '<split folder>/<file>' (LVIS "
            f"v1, e.g. 'http://images.cocodataset.org/train2017/000000000139.jpg') or a "
            f"'file_name' relative to the dataset's image directory.")
    raw.file_names = names
    cats = raw.categories
    if all(isinstance(c, dict) and type(c.get("id")) is int for c in cats):
        raw.categories = sorted(cats, key=lambda c: c["id"])
        known = np.array(sorted(c["id"] for c in cats), np.int64)
        for key, short in LVIS_IMAGE_LISTS.items():
            _check_ids(raw, key, getattr(raw, short + "_n"), getattr(raw, short + "_ids"), known)
    return raw


def _check_ids(raw: RawCoco, key: str, n: np.ndarray, ids: np.ndarray,
               known: np.ndarray) -> None:
    ok = np.isin(ids, known)
    if ok.all():
        return
    owner = np.repeat(np.arange(n.size), n)
    bad = np.flatnonzero(~ok)
    ex = ", ".join(f"image id {int(raw.img_id[owner[j]])}: {int(ids[j])}" for j in bad[:5])
    raise RoIDBInputError(
        f"{raw.source}: {bad.size} {key} value(s) in {np.unique(owner[bad]).size} image(s) are "
        f"not ids of 'categories' ({ex}). Remove them from the images' {key} or add the "
        f"categories.")


def lvis_image_lists(raw: RawCoco, info: DatasetInfo) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The neg / not-exhaustive lists per image as columns, images in ascending id (the
    :class:`~lit_roidata.roidb.coco.GtTable` order), ids mapped to contiguous class ids.

    Returns:
        ``{"neg_category_ids": (off, classes), "not_exhaustive_category_ids": (off,
        classes)}``: ``off`` int64 (n+1,), ``classes`` int32, JSON order within an image.
    """
    order = np.argsort(raw.img_id, kind="stable")
    keys, vals = info.category_lut()
    out = {}
    for key, short in LVIS_IMAGE_LISTS.items():
        n, ids = getattr(raw, short + "_n"), getattr(raw, short + "_ids")
        picked = ids[take_ranges(offsets(n)[order], n[order])]
        classes = vals[np.searchsorted(keys, picked)] if picked.size else np.zeros(0, np.int32)
        out[key] = (offsets(n[order]), classes.astype(np.int32))
    return out
