"""RPN training targets in the loader: the "wide" anchor blobs, ``im_info`` and ``roidb``
(Detectron semantics: RPN targets; docs/rpn_retinanet.md, "RPN targets").

Anchors of all levels are labelled and sampled jointly per image, exactly as Detectron's
``roi_data/rpn.py``, on index sets: IoUs only where they can matter, and the wide blobs
written by scattering the at most ``RPN_BATCH_SIZE_PER_IM`` labelled anchors.

``fix_rpn_quirks=True`` corrects two Detectron quirks (docs/detectron_quirks.md) and
changes nothing else: Q2, a gt box with zero IoU to every inside anchor no longer makes
every anchor with zero overlap to it a best match; Q3, negatives are drawn *without*
replacement and only from anchors that were not positive before subsampling.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, MutableMapping, Sequence

import numpy as np
import torch

from lit_roidata import rng as rng_mod
from lit_roidata.boxes import bbox_overlaps
from lit_roidata.minibatch.anchors import (
    FieldOfAnchors, anchor_targets, concat_fields, inside_anchors, rpn_fields,
    rpn_overlaps, scaled_noncrowd_gt, stack_rows)
from lit_roidata.minibatch.image import im_info_rows
from lit_roidata.minibatch.names import (
    RPN_BLOB_KINDS, RPN_COMPACT_KEYS, get_rpn_blob_names, rpn_levels)
from lit_roidata.minibatch.roidb_blob import serialize_roidb

__all__ = ["get_rpn_blob_names", "add_rpn_blobs", "label_anchors", "RPN_BLOB_KINDS",
           "RPN_COMPACT_KEYS"]


def add_rpn_blobs(blobs: MutableMapping[str, Any], im_scales: Sequence[float],
                  entries: Sequence[Mapping[str, Any]], cfg: Any, rng: rng_mod.RNG, *,
                  fix_rpn_quirks: bool = False,
                  alloc: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None,
                  compact: bool = False) -> bool:
    """Add ``im_info``, ``roidb`` and the RPN wide blobs of one minibatch (Detectron
    semantics: RPN targets).

    Draws happen per image in image order (positive subsampling, then negatives), with
    the calls Detectron makes, so a ``RandomState`` seeded like Detectron reproduces it.

    Args:
        blobs: the minibatch dict (already holding ``data``); updated in place.
        im_scales: the scale of each image, as drawn for the image blob.
        entries: the roidb entries (Detectron field names, docs/architecture.md).
        cfg: a ``DetectronConfig``; rng: generator for all draws (``lit_roidata.rng``).
        fix_rpn_quirks: correct Detectron quirks Q2/Q3 (see the module docstring).
        alloc: optional ``(shape, dtype) -> zeroed array`` for the wide blobs (about
            35 MB for 2 images at FPN level 2 with MAX_SIZE 1333), e.g. shared memory
            in a DataLoader worker so they are sent without a copy.
        compact: instead of the wide blobs, add only what is not a fill value, the
            ``RPN_COMPACT_KEYS`` (docs/rpn_retinanet.md, "What crosses from a worker"); the same
            draws, and :func:`lit_roidata.minibatch.device.expand_rpn_targets` turns them
            into the wide blobs bit for bit (which is how the wide blobs are made here).

    Returns True (RPN minibatches are always valid). Raises ``ValueError`` for an entry
    without a non-crowd gt box (Detectron crashes there, quirk Q27; ``filter_for_training``
    normally removes such images).
    """
    fields = rpn_fields(cfg)
    all_anchors = concat_fields(fields)
    im_info = im_info_rows(entries, im_scales)
    per_image = []
    for i, entry in enumerate(entries):
        gt, _ = scaled_noncrowd_gt(entry, im_scales[i], "RPN", "Detectron crashes here "
                                   "(Detectron quirk Q27, see docs/detectron_quirks.md)")
        per_image.append(label_anchors(all_anchors, fields, gt, im_info[i, 0], im_info[i, 1],
                                       cfg.TRAIN, rng, fix_rpn_quirks=fix_rpn_quirks))
    blobs["im_info"] = im_info
    blobs["roidb"] = serialize_roidb(entries)
    rows = _compact(per_image, fields, rpn_levels(cfg))
    for k in get_rpn_blob_names(cfg)[2:] if compact else ():  # pre-created by get_minibatch
        blobs.pop(k, None)
    blobs.update(rows if compact else _wide(rows, alloc))
    return True


def _wide(rows: dict[str, np.ndarray], alloc: Callable | None) -> dict[str, np.ndarray]:
    """Detectron's wide blobs from the compact ones, in ``alloc``'s arrays when given."""
    from lit_roidata.minibatch.device import expand_rpn_targets

    new = None if alloc is None else (lambda shape, dtype: torch.from_numpy(
        alloc(shape, np.dtype(str(dtype).removeprefix("torch.")))))
    wide = expand_rpn_targets({k: torch.from_numpy(v) for k, v in rows.items()}, new=new)
    return {k: v.numpy() for k, v in wide.items()}


def _compact(per_image: list[tuple], fields: Sequence[FieldOfAnchors],
             levels: Sequence[int | None]) -> dict[str, np.ndarray]:
    """The ``RPN_COMPACT_KEYS`` blobs from each image's :func:`label_anchors` result."""
    layout = np.array([(-1 if lvl is None else lvl, f.num_cell_anchors, f.field_size)
                       for lvl, f in zip(levels, fields)], dtype=np.int64).reshape(-1, 3)
    labels = [np.stack([np.full(len(idx), i), idx, lab], 1)
              for i, (idx, lab, *_) in enumerate(per_image)]
    fg = [np.stack([np.full(len(p[2]), i), p[2]], 1) for i, p in enumerate(per_image)]
    return dict(zip(RPN_COMPACT_KEYS, (
        layout, stack_rows(labels, 3, np.int32), stack_rows(fg, 2, np.int32),
        stack_rows([np.asarray(p[3]).reshape(-1, 4) for p in per_image], 4, np.float32),
        np.array([1.0 / p[4] if p[4] else 0.0 for p in per_image], np.float32))))


def label_anchors(all_anchors: np.ndarray, fields: Sequence[FieldOfAnchors], gt: np.ndarray,
                  im_h: float, im_w: float, train: Any, rng: rng_mod.RNG, *,
                  fix_rpn_quirks: bool = False
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
    """Label one image's anchors (Detectron semantics: RPN targets steps 3-8), in Detectron's draw
    order.

    Args:
        all_anchors: the concatenated fields ``(K, 4)``; fields: those fields.
        gt: non-crowd gt boxes in the scaled frame ``(G, 4)``, ``G >= 1``.
        im_h, im_w: ``round(height * scale)``, ``round(width * scale)``.
        train: ``cfg.TRAIN`` (thresholds, batch size, straddle margin).

    Returns:
        ``(labelled, labels, fg, targets, num_examples)``: global indices (into
        ``all_anchors``) of anchors with label >= 0 and those labels; global indices of
        the anchors that get regression targets and the ``(len(fg), 4)`` targets;
        the number of examples (weights are ``1/num_examples``).

    Detectron's positives, positive subsampling and negatives run on index sets, not on
    K-long label arrays, with the same draws on the same ascending index arrays. Only
    anchors with an IoU that can matter are visited (outside the candidates of
    :func:`rpn_overlaps` every anchor's max IoU is below both thresholds), and the
    negatives are picked by position in the inside anchors minus the excluded ones without
    listing them (:meth:`InsideAnchors.select`). Where that does not hold (a non-positive
    threshold, or Detectron quirk Q2: a gt with zero IoU to every inside anchor makes all
    of them positive) every inside anchor is a candidate.
    """
    inside = inside_anchors(fields, im_h, im_w, train.RPN_STRADDLE_THRESH)
    pos_t, neg_t = train.RPN_POSITIVE_OVERLAP, train.RPN_NEGATIVE_OVERLAP
    if inside.count == 0:  # Detectron crashes in argmax here; nothing to label
        fg = np.zeros(0, np.int64)
        return np.zeros(0, np.int64), np.zeros(0, np.int32), fg, anchor_targets(
            all_anchors[fg], gt)[1], 0.0
    cand = np.zeros(0, np.int64)
    if pos_t > 0 and neg_t > 0:
        cand, overlaps = rpn_overlaps(fields, all_anchors, inside, gt, below=min(neg_t, pos_t))
    if not len(cand) or not (fix_rpn_quirks or overlaps.max(axis=0).all()):
        cand = inside.select(np.arange(inside.count))
        overlaps = bbox_overlaps(all_anchors[cand], gt)
    a2g, g2a = overlaps.max(axis=1), overlaps.max(axis=0)
    best = overlaps == g2a[None, :]
    if fix_rpn_quirks:
        best &= (g2a > 0)[None, :]
    is_pos = best.any(axis=1) | (a2g >= pos_t)
    fg_inds = cand[is_pos]  # ascending, as flatnonzero
    num_fg = int(train.RPN_FG_FRACTION * train.RPN_BATCH_SIZE_PER_IM)
    if len(fg_inds) > num_fg:
        disable = rng_mod.choice(rng, fg_inds, size=len(fg_inds) - num_fg, replace=False)
        fg_inds = np.setdiff1d(fg_inds, disable, assume_unique=True)
    num_bg = max(int(train.RPN_BATCH_SIZE_PER_IM - len(fg_inds)), 0)
    # negatives: the inside anchors minus `excluded` (ascending), by position
    excluded = cand[(a2g >= neg_t) | is_pos] if fix_rpn_quirks else cand[a2g >= neg_t]
    n_cand = inside.count - len(excluded)
    # positions of the drawn negatives among the n_cand candidates (all if at most num_bg).
    # Detectron: bg_inds[npr.randint(len(bg_inds), size=num_bg)] (quirk Q3: with
    # replacement, may overwrite positives); fixed: choice(bg_inds, num_bg, replace=False),
    # whose draws depend only on the number of candidates, so drawing positions is the same
    pos = (np.arange(n_cand) if n_cand <= num_bg else np.asarray(
        rng_mod.choice(rng, n_cand, size=num_bg, replace=False) if fix_rpn_quirks
        else rng_mod.randint(rng, n_cand, size=num_bg)))
    # the p-th candidate is the q-th inside anchor, q = p + #excluded placed before it
    shift = inside.rank(excluded) - np.arange(len(excluded))
    bg_inds = inside.select(pos + np.searchsorted(shift, pos, side="right"))
    labelled = np.union1d(fg_inds, bg_inds).astype(np.int64, copy=False)
    lab = np.where(np.isin(labelled, bg_inds), 0, 1).astype(np.int32)
    _, targets = anchor_targets(all_anchors[fg_inds], gt)  # only the <= 128 that need it
    return labelled, lab, fg_inds, targets, float(len(labelled))

