"""Fast R-CNN blobs from a roidb with proposals: RoI sampling and targets (Detectron
semantics: Fast R-CNN targets). No image I/O: the loader calls :func:`add_fast_rcnn_blobs`
for precomputed proposals, end-to-end training at run time with the RPN's proposals.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping, Sequence

import numpy as np

from lit_roidata import rng as rng_mod
from lit_roidata.minibatch.fpn import add_multilevel_rois, rois_blob
from lit_roidata.minibatch.keypoints import add_keypoint_rcnn_blobs, finalize_keypoint_minibatch
from lit_roidata.minibatch.mask import add_mask_rcnn_blobs, expand_class_specific_masks
from lit_roidata.minibatch.names import get_fast_rcnn_blob_names

__all__ = ["fg_rois_per_image", "sample_rois", "expand_bbox_targets", "add_fast_rcnn_blobs"]


def fg_rois_per_image(cfg: Any) -> int:
    """Nominal fg quota ``round(FG_FRACTION * BATCH_SIZE_PER_IM)`` (16 for 64)."""
    # round() on a float rounds half to even, as np.round does
    return int(round(float(cfg.TRAIN.FG_FRACTION * int(cfg.TRAIN.BATCH_SIZE_PER_IM))))


def expand_bbox_targets(bbox_target_data: np.ndarray, cfg: Any) -> tuple[np.ndarray, np.ndarray]:
    """Expand compact ``(class, tx, ty, tw, th)`` rows to ``(r, 4C)`` targets and weights.

    The class comes from column 0 (the roidb's, Detectron quirk Q30 (docs/detectron_quirks.md)), ``C
    = NUM_CLASSES`` or 2
    when ``CLS_AGNOSTIC_BBOX_REG``.

    Raises:
        ValueError: a target class ``>= C`` (``MODEL.NUM_CLASSES`` too small).
    """
    num_reg_classes = 2 if cfg.MODEL.CLS_AGNOSTIC_BBOX_REG else int(cfg.MODEL.NUM_CLASSES)
    if num_reg_classes <= 0:
        raise ValueError("MODEL.NUM_CLASSES is not set (it is -1 by default); set it to the "
                         "number of classes plus one for background, e.g. 81 for COCO")
    data = np.asarray(bbox_target_data, dtype=np.float32).reshape(-1, 5)
    clss = data[:, 0].astype(np.int64)
    n = data.shape[0]
    targets, inside = np.zeros((2, n, num_reg_classes, 4), dtype=np.float32)
    rows = np.flatnonzero(data[:, 0] > 0)
    if rows.size and clss[rows].max() >= num_reg_classes:
        why = ("MODEL.CLS_AGNOSTIC_BBOX_REG needs class 1; the roidb's targets were built class-"
               "specific: rebuild them with the same config" if cfg.MODEL.CLS_AGNOSTIC_BBOX_REG
               else f"MODEL.NUM_CLASSES is {num_reg_classes}; set MODEL.NUM_CLASSES to the "
               "dataset's class count plus one (background)")
        raise ValueError(f"a regression target has class {int(clss[rows].max())} but {why}")
    targets[rows, clss[rows]] = data[rows, 1:]
    inside[rows, clss[rows]] = 1.0
    return targets.reshape(n, 4 * num_reg_classes), inside.reshape(n, 4 * num_reg_classes)


def _expanded_targets(target_data: np.ndarray, cfg: Any) -> dict[str, np.ndarray]:
    targets, inside = expand_bbox_targets(target_data, cfg)
    # inside weights are exactly 0 or 1, so (inside > 0) as float32 equals a copy
    return {"bbox_targets": targets, "bbox_inside_weights": inside,
            "bbox_outside_weights": inside.copy()}


def sample_rois(entry: Mapping[str, Any], im_scale: float, batch_idx: int, cfg: Any,
                rng: rng_mod.RNG, *, expand_targets: bool = True) -> dict[str, np.ndarray]:
    """Sample fg/bg RoIs of one image and build its Fast R-CNN (+mask/keypoint) blobs.

    Draw order: ``choice`` over fg candidates (if any), then over bg candidates (if
    any), then the keypoint draw — Detectron's order, so a ``RandomState`` seeded like
    Detectron's reproduces its RoIs. With ``expand_targets=False`` the compact
    ``(r, 5)`` targets are returned as ``_bbox_target_data`` instead of the three
    ``(r, 4C)`` blobs (the caller expands the whole minibatch at once).
    """
    train, fg_quota = cfg.TRAIN, fg_rois_per_image(cfg)
    max_overlaps = np.asarray(entry["max_overlaps"])
    fg_inds = np.flatnonzero(max_overlaps >= train.FG_THRESH)
    bg_inds = np.flatnonzero((max_overlaps < train.BG_THRESH_HI)
                             & (max_overlaps >= train.BG_THRESH_LO))
    n_fg = int(min(fg_quota, fg_inds.size))
    n_bg = int(min(int(train.BATCH_SIZE_PER_IM) - n_fg, bg_inds.size))
    drawn = [rng_mod.choice(rng, inds, size=n, replace=False) if inds.size else inds
             for inds, n in ((fg_inds, n_fg), (bg_inds, n_bg))]  # fg first, as Detectron
    keep = np.concatenate([d.ravel() for d in drawn]).astype(np.int64, copy=False)
    labels = np.asarray(entry["max_classes"]).take(keep).astype(np.int32)
    labels[n_fg:] = 0
    sampled_boxes = np.asarray(entry["boxes"], dtype=np.float32).take(keep, axis=0)
    target_data = np.asarray(entry["bbox_targets"], dtype=np.float32).take(keep, axis=0)
    scale = float(im_scale)
    blob = {"rois": rois_blob(sampled_boxes * scale, batch_idx), "labels_int32": labels}
    blob.update(_expanded_targets(target_data, cfg) if expand_targets
                else {"_bbox_target_data": target_data})
    if cfg.MODEL.MASK_ON:
        add_mask_rcnn_blobs(blob, sampled_boxes, entry, scale, batch_idx, cfg, expand=False)
    if cfg.MODEL.KEYPOINTS_ON:
        add_keypoint_rcnn_blobs(blob, entry, fg_quota, scale, batch_idx, cfg, rng)
    return blob


def add_fast_rcnn_blobs(blobs: MutableMapping[str, Any], im_scales: Sequence[float],
                        entries: Sequence[Mapping[str, Any]], cfg: Any, rng: rng_mod.RNG, *,
                        alloc: Any = None, compact_masks: bool = False) -> bool:
    """Add the Fast R-CNN blob family (Detectron semantics: blob names) to ``blobs``; return
    validity.

    Per image :func:`sample_rois` (``batch_idx`` = position in ``entries``), then
    concatenation in image order, FPN distribution (Detectron semantics: FPN RoI levels) and
    keypoint finalisation. Keys are written in :func:`get_fast_rcnn_blob_names` order
    (existing keys, e.g. pre-created by ``get_minibatch``, keep their place).

    Args:
        blobs: dict to fill (may already hold ``data``); im_scales: one scale per entry.
        entries: roidb-style entries with ``boxes``, ``max_overlaps``, ``max_classes``,
            ``bbox_targets``, ``box_to_gt_ind_map``, ``gt_classes``, ``is_crowd`` and, when
            enabled, ``segms`` / ``gt_keypoints``.
        cfg: the Detectron config; rng: generator for the RoI (and keypoint) draws.
        alloc: optional ``(shape, dtype) -> array`` for the largest blob (class-specific
            ``masks_int32``), e.g. shared memory in a DataLoader worker.
        compact_masks: keep class-specific ``masks_int32`` as ``(n, M*M)`` and add
            ``mask_class_int32`` (n,); :func:`lit_roidata.minibatch.device.expand_masks_on_device`
            restores Detectron's blob on the device.

    Returns:
        ``False`` only for a keypoint minibatch that fails the validity rule (Detectron
        semantics: minibatch validity).
    """
    if len(im_scales) != len(entries):
        raise ValueError(f"{len(entries)} entries but {len(im_scales)} scales")
    per_image = [sample_rois(e, s, i, cfg, rng, expand_targets=False)
                 for i, (e, s) in enumerate(zip(entries, im_scales))]
    # One expansion for the minibatch: no per-image (r, 4C) copies.
    expanded = (_expanded_targets(np.concatenate([b.pop("_bbox_target_data") for b in per_image]),
                                  cfg) if per_image else {})
    for name in get_fast_rcnn_blob_names(cfg):
        if name in expanded:
            blobs[name] = expanded[name]
        elif name == "masks_int32" and cfg.MRCNN.CLS_SPECIFIC_MASK:
            masks = np.concatenate([b[name] for b in per_image])
            classes = np.concatenate([b["_mask_class_labels"] for b in per_image])
            if compact_masks:
                blobs[name] = masks
                blobs["mask_class_int32"] = classes.astype(np.int32)
            else:
                blobs[name] = expand_class_specific_masks(masks, classes,
                                                          int(cfg.MODEL.NUM_CLASSES), alloc=alloc)
        elif per_image and name in per_image[0]:
            blobs[name] = np.concatenate([b[name] for b in per_image])
        elif name not in blobs or isinstance(blobs[name], list):
            blobs[name] = []  # filled below (FPN / keypoint finalisation)
    if cfg.FPN.FPN_ON and cfg.FPN.MULTILEVEL_ROIS:
        add_multilevel_rois(blobs, cfg)
    return finalize_keypoint_minibatch(blobs, True, cfg) if cfg.MODEL.KEYPOINTS_ON else True
