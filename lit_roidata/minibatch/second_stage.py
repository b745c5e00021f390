"""Second-stage labels for end-to-end training, from the model's own proposals (Detectron
semantics: end-to-end training; docs/rpn_retinanet.md, "Second-stage labels at training
time").

Detectron's ``GenerateProposalLabels`` / ``CollectAndDistributeFpnRpnProposals``: (1) with
FPN, the top ``RPN_POST_NMS_TOP_N * RPN_COLLECT_SCALE`` proposals by score over the whole
minibatch (Detectron quirk Q26); (2) ``add_proposals``: per image, the proposals divided by
the image scale are merged into the entry (crowd rows included, **no** crowd filter) and
classes assigned; (3) regression targets, then ``add_fast_rcnn_blobs``, whose ``valid`` is
ignored (Detectron quirk Q7). Steps 1-3 run in torch on the proposals' device, vectorised
over all images; the sampling and mask/keypoint targets are the loader's own
:func:`~lit_roidata.minibatch.fast_rcnn.add_fast_rcnn_blobs`, so both paths give the same
blobs for the same proposals and seed.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from lit_roidata import rng as rng_mod
from lit_roidata.boxes import bbox_overlaps_torch, bbox_transform_targets_torch
from lit_roidata.minibatch.fast_rcnn import add_fast_rcnn_blobs
from lit_roidata.minibatch.roidb_blob import deserialize_roidb

__all__ = ["proposal_labels", "collect_top_proposals", "merge_proposals"]

# Per-entry keys carried into the merged entries unchanged.
_PASS_THROUGH = ("segms", "gt_keypoints", "has_visible_keypoints", "id", "image", "width",
                 "height", "flipped", "dataset")


def proposal_labels(rois: Any, entries: Any, im_scales: Any, cfg: Any, rng: rng_mod.RNG, *,
                    scores: Any = None) -> dict[str, Any]:
    """The Fast R-CNN / Mask / Keypoint blobs for a minibatch's RPN proposals.

    Args:
        rois: ``(N, 5)`` proposals ``(batch_idx, x1, y1, x2, y2)`` in the scaled input
            frame, a torch tensor on any device or a NumPy array; ``batch_idx`` is the
            image's position in ``entries``.
        entries: the minibatch's roidb entries (Mappings with Detectron's field names),
            or the loader's ``roidb`` blob (array or tensor), which is deserialized.
        im_scales: one scale per image (``im_info[:, 2]``; sequence, array or tensor).
        cfg: the ``DetectronConfig``.
        rng: generator for the RoI and keypoint sampling (``lit_roidata.rng``).
        scores: optional ``(N,)`` objectness of ``rois``. With ``FPN.FPN_ON`` and
            ``FPN.MULTILEVEL_RPN`` the top ``RPN_POST_NMS_TOP_N * RPN_COLLECT_SCALE``
            by score over the whole minibatch are kept first (Detectron quirk Q26,
            docs/detectron_quirks.md); otherwise ignored
            (single-level RPN applies its top-N per image while generating proposals).

    Returns:
        Blob name -> array, names and order of
        :func:`lit_roidata.minibatch.names.get_fast_rcnn_blob_names`. torch tensors on
        ``rois.device`` for tensor input (int32 / float32), NumPy arrays for NumPy input.

    Raises:
        ValueError: shapes disagree (``rois`` not ``(N, 5)``, a scale per image missing,
            ``batch_idx`` outside the minibatch).
    """
    as_numpy = not isinstance(rois, torch.Tensor)
    rois_t = torch.as_tensor(np.asarray(rois)) if as_numpy else rois.detach()
    if isinstance(entries, (np.ndarray, torch.Tensor)):
        entries = deserialize_roidb(entries)
    scales = [float(s) for s in (im_scales.tolist() if hasattr(im_scales, "tolist")
                                 else im_scales)]
    if scores is not None and cfg.FPN.FPN_ON and cfg.FPN.MULTILEVEL_RPN:
        rois_t = collect_top_proposals(
            rois_t, scores, int(cfg.TRAIN.RPN_POST_NMS_TOP_N * cfg.FPN.RPN_COLLECT_SCALE))
    blobs: dict[str, Any] = {}
    # valid is ignored end to end (Detectron quirk Q7, docs/detectron_quirks.md)
    add_fast_rcnn_blobs(blobs, scales, merge_proposals(rois_t, entries, scales, cfg), cfg, rng)
    if as_numpy:
        return blobs
    return {k: torch.from_numpy(v if v.flags.c_contiguous else v.copy()).to(rois_t.device)
            for k, v in blobs.items()}


def collect_top_proposals(rois: torch.Tensor, scores: Any, top_n: int) -> torch.Tensor:
    """The ``top_n`` rows of ``rois`` by descending score, over all images (Detectron quirk Q26,
    docs/detectron_quirks.md).

    Detectron sorts with ``np.argsort(-scores)`` (an unstable sort); a stable sort is
    used here, so equal scores keep their input order.
    """
    s = torch.as_tensor(np.asarray(scores)) if not isinstance(scores, torch.Tensor) else scores
    s = s.detach().reshape(-1).to(rois.device)
    if s.numel() != rois.shape[0]:
        raise ValueError(f"scores has {s.numel()} values for {rois.shape[0]} rois")
    return rois[torch.sort(-s.to(torch.float64), stable=True).indices[:top_n]]


def merge_proposals(rois: torch.Tensor, entries: Sequence[Mapping[str, Any]],
                    im_scales: Sequence[float], cfg: Any) -> list[dict[str, Any]]:
    """Detectron's ``add_proposals`` (crowd_thresh 0) plus the bounding-box regression
    targets, as new entry dicts (Detectron semantics: proposals).

    Proposal rows of image ``i`` (in ``rois`` order) are multiplied by ``1 / scale_i``
    in float32, as Detectron does, and appended after the entry's rows. The results
    carry ``boxes, gt_classes, is_crowd, seg_areas, box_to_gt_ind_map, max_overlaps,
    max_classes, bbox_targets`` (NumPy, CPU) and the entry's ``segms``/``gt_keypoints``;
    ``gt_overlaps`` is not rebuilt (``max_overlaps``/``max_classes`` hold its content).
    """
    if rois.ndim != 2 or rois.shape[1] != 5:
        raise ValueError("rois must be (N, 5) (batch_idx, x1, y1, x2, y2), got "
                         f"{tuple(rois.shape)}")
    if len(im_scales) != len(entries):
        raise ValueError(f"{len(entries)} entries but {len(im_scales)} image scales")
    dev = rois.device
    img = rois[:, 0].round().to(torch.int64)
    if img.numel() and (img.min() < 0 or img.max() >= len(entries)):
        raise ValueError(f"rois batch_idx must lie in [0, {len(entries)}), got "
                         f"[{int(img.min())}, {int(img.max())}]")
    inv = torch.tensor([np.float32(1.0 / s) for s in im_scales], dtype=torch.float32, device=dev)
    props = rois[:, 1:].to(torch.float32) * inv[img][:, None]
    order = torch.sort(img, stable=True).indices  # image-major, score order within
    img, props = img[order], props[order]
    cols = [_entry_columns(e, dev) for e in entries]
    # every image's gt rows (gt_classes > 0, crowd included), with image and row ids
    gt_rows = [torch.nonzero(c["gt_classes"] > 0).reshape(-1) for c in cols]
    gt = {"boxes": [c["boxes"][r] for c, r in zip(cols, gt_rows)],
          "cls": [c["gt_classes"][r].to(torch.int64) for c, r in zip(cols, gt_rows)],
          "crowd": [c["is_crowd"][r] for c, r in zip(cols, gt_rows)], "row": gt_rows,
          "img": [torch.full_like(r, i) for i, r in enumerate(gt_rows)]}
    gt = {k: torch.cat(v) if v else torch.zeros(0, device=dev) for k, v in gt.items()}
    # per proposal: max IoU, its gt's class and roidb row (0, 0, -1 if none; Detectron
    # semantics: class assignment)
    n = props.shape[0]
    if n == 0 or gt["boxes"].shape[0] == 0:
        new = {"max_overlaps": torch.zeros(n, device=dev),
               "max_classes": torch.zeros(n, dtype=torch.int64, device=dev),
               "box_to_gt_ind_map": torch.full((n,), -1, dtype=torch.int32, device=dev)}
    else:
        best, arg = _masked_iou(props, img, gt["boxes"], gt["img"]).max(dim=1)  # first on ties
        hit = best > 0
        new = {"max_overlaps": torch.where(hit, best, torch.zeros_like(best)),
               "max_classes": torch.where(hit, gt["cls"][arg], torch.zeros_like(arg)),
               "box_to_gt_ind_map": torch.where(hit, gt["row"][arg],
                                                torch.full_like(arg, -1)).to(torch.int32)}
    new["boxes"] = props
    # image by image, the entry's rows, then its proposal rows (their own values in `new`;
    # zero in the other columns)
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in (
        "img", "boxes", "gt_classes", "is_crowd", "seg_areas", "box_to_gt_ind_map",
        "max_overlaps", "max_classes")}
    counts, start = torch.bincount(img, minlength=len(entries)).tolist(), 0
    for i, (c, p) in enumerate(zip(cols, counts)):
        parts["img"].append(torch.full((c["n"] + p,), i, dtype=torch.int64, device=dev))
        for k in list(parts)[1:]:
            tail = (new[k][start:start + p] if k in new
                    else torch.zeros(p, dtype=c[k].dtype, device=dev))
            parts[k].append(torch.cat([c[k], tail]))
        start += p
    rows = {k: torch.cat(v) for k, v in parts.items()}
    # regression targets of the merged rows: towards the best non-crowd gt of the same image
    targets = torch.zeros((rows["boxes"].shape[0], 5), dtype=torch.float32, device=dev)
    ok = ~gt["crowd"].to(torch.bool) if gt["boxes"].shape[0] else None
    ex = torch.nonzero(rows["max_overlaps"] >= cfg.TRAIN.BBOX_THRESH).reshape(-1)
    if ok is not None and bool(ok.any()) and ex.numel() != 0:
        iou = _masked_iou(rows["boxes"][ex], rows["img"][ex], gt["boxes"], gt["img"], ok)
        # all-zero rows -> the image's first non-crowd gt (Detectron quirk Q8)
        best, arg = iou.max(dim=1)
        ex, arg = ex[best >= 0], arg[best >= 0]  # images without a non-crowd gt: all zero
        cls = (torch.ones_like(ex) if cfg.MODEL.CLS_AGNOSTIC_BBOX_REG else rows["max_classes"][ex])
        targets[ex, 0] = cls.to(torch.float32)
        targets[ex, 1:] = bbox_transform_targets_torch(
            rows["boxes"][ex], gt["boxes"][arg], tuple(cfg.MODEL.BBOX_REG_WEIGHTS))
    rows["bbox_targets"] = targets
    host = {k: v.cpu().numpy() for k, v in rows.items()}
    starts = np.concatenate(([0], np.cumsum([c["n"] + p for c, p in zip(cols, counts)])))
    out = []
    for e, a, b in zip(entries, starts[:-1], starts[1:]):
        merged = {k: v[a:b] for k, v in host.items() if k != "img"}
        merged["boxes"] = merged["boxes"].astype(np.float32)
        out.append({**merged, **{k: e[k] for k in _PASS_THROUGH if k in e}})
    return out


def _entry_columns(e: Mapping[str, Any], dev: torch.device) -> dict[str, Any]:
    """The entry's own rows as tensors, with their class assignment (Detectron semantics: class
    assignment)."""
    gt_classes = np.asarray(e["gt_classes"])
    if "max_overlaps" in e and "max_classes" in e:
        mo, mc = np.asarray(e["max_overlaps"]), np.asarray(e["max_classes"])
    elif "gt_overlaps" in e:
        dense = e["gt_overlaps"].toarray() if hasattr(e["gt_overlaps"], "toarray") else \
            np.asarray(e["gt_overlaps"])
        mo = dense.max(axis=1) if dense.size else np.zeros(len(gt_classes), np.float32)
        mc = dense.argmax(axis=1) if dense.size else np.zeros(len(gt_classes), np.int64)
    else:
        raise ValueError(f"entry {e.get('id', '?')}: needs max_overlaps/max_classes or "
                         "gt_overlaps to merge proposals into it (a roidb entry or a "
                         "deserialized roidb blob has them)")

    def t(x: Any, dtype: torch.dtype) -> torch.Tensor:
        # Roidb columns are read-only memory maps; copy (a few gt rows) rather than
        # wrap them in a tensor that torch would consider writable.
        return torch.tensor(np.asarray(x), dtype=dtype, device=dev)

    return {"n": len(gt_classes), "boxes": t(e["boxes"], torch.float32),
            "gt_classes": t(gt_classes, torch.int32), "is_crowd": t(e["is_crowd"], torch.bool),
            "seg_areas": t(e["seg_areas"], torch.float32),
            "box_to_gt_ind_map": t(e["box_to_gt_ind_map"], torch.int32),
            "max_overlaps": t(mo, torch.float32), "max_classes": t(mc, torch.int64)}


def _masked_iou(a: torch.Tensor, a_img: torch.Tensor, b: torch.Tensor, b_img: torch.Tensor,
                b_ok: torch.Tensor | None = None) -> torch.Tensor:
    """IoU with pairs from different images (or ``~b_ok`` columns) set to -1."""
    iou = bbox_overlaps_torch(a, b)
    same = a_img[:, None] == b_img[None, :]
    if b_ok is not None:
        same &= b_ok[None, :]
    return torch.where(same, iou, torch.full_like(iou, -1.0))
