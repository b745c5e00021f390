"""RetinaNet training targets in the loader (Detectron semantics: RetinaNet targets).

Every anchor of every (level, octave, aspect) field is labelled against the image's
non-crowd gt boxes, with no sampling and no straddle filter, exactly as Detectron's
``roi_data/retinanet.py``: best-match and threshold positives take the class of their
own argmax gt, then every anchor with max IoU below ``NEGATIVE_OVERLAP`` becomes 0,
after the foreground was counted (Detectron quirk Q4, docs/detectron_quirks.md, reproduced).
Labels are cropped to the padded image's feature size; positives are listed as
``roi_fg_bbox_locs`` rows whose column 1 is the channel offset of the box prediction, so the
loss gathers without a dense target.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, MutableMapping, Sequence

import numpy as np

from lit_roidata import rng as rng_mod
from lit_roidata.minibatch.anchors import (
    FieldOfAnchors, anchor_targets, concat_fields, inside_anchors, level_offsets, retinanet_fields,
    rpn_overlaps, scaled_noncrowd_gt, stack_rows)
from lit_roidata.minibatch.image import im_info_rows
from lit_roidata.minibatch.names import get_retinanet_blob_names

__all__ = ["add_retinanet_blobs", "label_retinanet_anchors", "get_retinanet_blob_names"]


def add_retinanet_blobs(blobs: MutableMapping[str, Any], im_scales: Sequence[float],
                        entries: Sequence[Mapping[str, Any]], cfg: Any,
                        rng: rng_mod.RNG | None = None, *, compact: bool = False) -> bool:
    """Add ``im_info``, ``retnet_fg_num``, ``retnet_bg_num`` and the per-level blobs (Detectron
    semantics: RetinaNet targets).

    The padded size comes from ``blobs["data"]`` (NCHW), as Detectron passes the
    network input's width and height. Nothing is random; ``rng`` is accepted for the
    common signature of the family builders.

    Args:
        blobs: the minibatch dict, already holding ``data``; updated in place.
        im_scales: the scale of each image.
        entries: roidb entries (Detectron field names).
        cfg: a ``DetectronConfig`` with ``FPN.FPN_ON``.
        compact: ship each level's class labels (mostly 0, background) sparsely, as
            ``retnet_cls_labels_fpn<l>_sparse`` and ``..._shape`` in place of
            ``retnet_cls_labels_fpn<l>`` (docs/rpn_retinanet.md, "What crosses from a
            worker"); :func:`lit_roidata.minibatch.device.expand_sparse` restores it.

    Returns:
        True: RetinaNet minibatches are always valid.

    Raises:
        ValueError: FPN is off, an entry has no non-crowd gt box (Detectron asserts),
            or a label does not fit ``MODEL.NUM_CLASSES``.
    """
    get_retinanet_blob_names(cfg)  # raises without FPN, like Detectron's assert
    fields = retinanet_fields(cfg)
    all_anchors = concat_fields(fields)
    pad_h, pad_w = int(blobs["data"].shape[2]), int(blobs["data"].shape[3])
    top = 2 ** int(cfg.FPN.RPN_MAX_LEVEL)
    if pad_h % top or pad_w % top:
        warnings.warn(
            f"RetinaNet: padded blob {pad_h}x{pad_w} is not a multiple of the coarsest level "
            f"stride {top}; the cropped labels will not match the head's feature size. "
            f"Set FPN.COARSEST_STRIDE to {top} (Detectron's RetinaNet configs use 128).",
            stacklevel=2)
    retina, n_classes = cfg.RETINANET, int(cfg.MODEL.NUM_CLASSES)
    fg_total, bg_total = 0.0, 0.0
    per_image = []
    for entry, scale in zip(entries, im_scales):
        gt, keep = scaled_noncrowd_gt(entry, scale, "RetinaNet", "Detectron asserts here")
        labels, fg, targets, num_bg = label_retinanet_anchors(
            all_anchors, fields, gt, np.asarray(entry["gt_classes"])[keep], retina)
        fg_num = np.float32(len(fg) + 1.0)
        fg_total += fg_num
        bg_total += (num_bg + 1.0) * (n_classes - 1) + fg_num * (n_classes - 2)
        per_image.append((labels, fg, targets))
    blobs["im_info"] = im_info_rows(entries, im_scales)
    blobs["retnet_fg_num"] = np.array([fg_total], dtype=np.float32)
    blobs["retnet_bg_num"] = np.array([bg_total], dtype=np.float32)
    # crop labels per field, list the positives per level (Detectron semantics: RetinaNet
    # targets step 4)
    loc_stride = 4 * (n_classes - 1) if retina.CLASS_SPECIFIC_BBOX else 4
    offsets = level_offsets(fields)
    # fields per level, in (octave, aspect) order: a field's place in its level is its anchor
    a = retina.SCALES_PER_OCTAVE * len(retina.ASPECT_RATIOS)
    if compact:  # written again below in blob order, the sparse pair in the labels' place
        for k in [k for k in blobs if k.startswith("retnet_") and "_fpn" in k]:
            del blobs[k]
    for k, lvl in enumerate(range(cfg.FPN.RPN_MIN_LEVEL, cfg.FPN.RPN_MAX_LEVEL + 1)):
        size, stride = fields[k * a].field_size, fields[k * a].stride
        h, w = int(pad_h / stride), int(pad_w / stride)
        shape = (len(per_image), a, min(h, size), min(w, size))
        cls = np.empty(shape, np.int32)
        lo, hi = offsets[k * a], offsets[(k + 1) * a]
        tgt_rows, loc_rows = [], []
        for i, (labels, fg, targets) in enumerate(per_image):
            cls[i] = labels[lo:hi].reshape(a, size, size)[:, :h, :w]
            sel = (fg >= lo) & (fg < hi)
            sel[sel] = labels[fg[sel]] > 0  # positives overwritten by negatives drop out
            anchor_ind, cell = np.divmod(fg[sel] - lo, size * size)
            y, x = np.divmod(cell, size)
            lab = labels[fg[sel]].astype(np.int64)
            l_cls = lab - 1 if retina.CLASS_SPECIFIC_BBOX else np.zeros_like(lab)
            if l_cls.size and (l_cls.min() < 0 or l_cls.max() >= n_classes - 1):
                raise ValueError(
                    f"RetinaNet label {int(lab.max())} does not fit MODEL.NUM_CLASSES = "
                    f"{n_classes}; set it to the dataset's class count plus one")
            locs = np.stack([np.full_like(y, i), 4 * l_cls + loc_stride * anchor_ind, y, x], 1)
            tgt_rows.append(targets[sel])
            loc_rows.append(locs.astype(np.float32))
        if compact:  # (flat index, label) of the non-zero labels, and the blob's shape
            nz = np.flatnonzero(cls)
            blobs[f"retnet_cls_labels_fpn{lvl}_sparse"] = np.stack(
                [nz, cls.reshape(-1)[nz]], 1).astype(np.int32).reshape(-1, 2)
            blobs[f"retnet_cls_labels_fpn{lvl}_shape"] = np.array(shape, np.int64)
        else:
            blobs[f"retnet_cls_labels_fpn{lvl}"] = cls
        blobs[f"retnet_roi_bbox_targets_fpn{lvl}"] = stack_rows(tgt_rows, 4, np.float32)
        blobs[f"retnet_roi_fg_bbox_locs_fpn{lvl}"] = stack_rows(loc_rows, 4, np.float32)
    return True


def label_retinanet_anchors(all_anchors: np.ndarray, fields: Sequence[FieldOfAnchors],
                            gt: np.ndarray, gt_classes: np.ndarray, retina: Any
                            ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Label all anchors of one image (Detectron semantics: RetinaNet targets steps 1-3).

    Returns:
        ``(labels, fg, targets, num_bg)``: float32 labels over all anchors (-1, 0 or a
        class), the anchors counted as foreground *before* the negative overwrite (Detectron
        quirk Q4), their ``(len(fg), 4)`` targets, and the number of anchors below
        ``NEGATIVE_OVERLAP``.
    """
    n = all_anchors.shape[0]
    below = min(retina.NEGATIVE_OVERLAP, retina.POSITIVE_OVERLAP)
    every = inside_anchors(fields, 0, 0, -1.0)  # no straddle filter
    cand, overlaps = rpn_overlaps(fields, all_anchors, every, gt, below)
    a2g_max = np.zeros(n, dtype=np.float32)
    a2g_max[cand] = overlaps.max(axis=1)
    g2a_max = overlaps.max(axis=0, initial=0)
    # a gt with zero IoU everywhere ties at zero with every anchor (as Detectron)
    positive = np.full(n, (g2a_max == 0).any())
    positive[cand] = (overlaps == g2a_max[None, :]).any(axis=1)
    positive |= a2g_max >= retina.POSITIVE_OVERLAP
    fg = np.flatnonzero(positive)
    assigned, targets = anchor_targets(all_anchors[fg], gt)  # for the positives only
    labels = np.full(n, -1, dtype=np.float32)
    labels[fg] = gt_classes[assigned]
    bg = a2g_max < retina.NEGATIVE_OVERLAP
    labels[bg] = 0
    return labels, fg, targets, int(bg.sum())

