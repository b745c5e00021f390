"""Oracle for the proposal-table equivalence tests: ``lit_roidata/roidb/proposals.py`` as
it was before the filtered IoU merge (commit 75594ff), verbatim below this docstring, so
the new code is compared with the old on random inputs (kept in tests/, not in the
package)."""
# ruff: noqa


from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from lit_roidata.boxes import box_areas, iou_kernel
from lit_roidata.roidb.info import RoIDBInputError
from lit_roidata.roidb.proposal_files import ProposalSource, convert_proposals
from lit_roidata.roidb.proposal_files import read_proposal_file

__all__ = ["ProposalTable", "ProposalSource", "read_proposal_file", "convert_proposals",
           "build_proposal_table", "unique_box_keep", "iof_pairs"]

logger = logging.getLogger(__name__)

_CHUNK_BOXES = 2_000_000  # proposals processed per vectorised chunk (bounds peak memory)


@dataclass
class ProposalTable:
    """Proposal rows of one dataset, aligned with its images (sorted by id).

    Attributes:
        off: int64 (n+1,) proposal row range per image.
        boxes: float32 (P, 4); max_overlaps float32; max_classes int32;
        gt_map: int32 ``box_to_gt_ind_map`` (-1 where no gt overlaps).
        counts: what the processing removed, by reason.
    """

    off: np.ndarray
    boxes: np.ndarray
    max_overlaps: np.ndarray
    max_classes: np.ndarray
    gt_map: np.ndarray
    counts: Counter


def align_records(src: ProposalSource, image_ids: np.ndarray, counts: Counter) -> np.ndarray:
    """Record index for each image (sorted ids), as Detectron aligns them (Detectron semantics:
    proposals).

    Records for ids not in the dataset are removed (counted); a missing or duplicated
    id is an error naming the ids.
    """
    ids = src.ids
    uniq, cnt = np.unique(ids, return_counts=True)
    if (cnt > 1).any():
        dup = uniq[cnt > 1]
        raise RoIDBInputError(f"{src.path}: {dup.size} image id(s) appear more than once: "
                              f"{dup[:10].tolist()}; each image needs exactly one record")
    extra = ~np.isin(ids, image_ids)
    if ids.size and extra.all():
        raise RoIDBInputError(
            f"{src.path}: none of its {ids.size} record ids (e.g. {ids[:5].tolist()}) is an "
            f"image id of this dataset (e.g. {image_ids[:5].tolist()}); is it the proposal "
            f"file of another dataset? Pass the file made for this dataset (one per dataset, "
            f"in the same order as the dataset names).")
    counts["proposal_records_not_in_dataset"] = int(extra.sum())
    if extra.any():
        logger.warning("%s: %d record(s) for image ids not in the dataset were removed (e.g. "
                       "%s)", src.path, int(extra.sum()), ids[extra][:5].tolist())
    missing = ~np.isin(image_ids, ids)
    if missing.any():
        raise RoIDBInputError(
            f"{src.path}: no proposals for {int(missing.sum())} of {image_ids.size} dataset "
            f"images (e.g. image ids {image_ids[missing][:10].tolist()}). The proposal file "
            f"must hold one record per image (an empty (0, 4) array is fine); regenerate it "
            f"for this dataset.")
    order = np.argsort(ids, kind="stable")
    pos = np.searchsorted(ids[order], image_ids)
    return order[pos]


def unique_box_keep(boxes: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Keep-mask of first occurrences of Detectron's box hash within each group (Detectron
    semantics: proposals).

    The hash is Detectron's float64 ``round(x1) + 1e3 round(y1) + 1e6 round(x2) + 1e9
    round(y2)`` (which can collide for coordinates >= 1000, Detectron quirk Q13
    (docs/detectron_quirks.md), and rounds away low digits beyond 2**53); order is
    preserved.
    """
    if boxes.shape[0] == 0:
        return np.zeros(0, bool)
    r = np.round(boxes)
    if r.size and float(np.abs(r).max()) < 2.0**53 / 1.002e9:
        # every partial sum is an integer below 2**53, hence exact in any summation
        # order: a float64 BLAS product (np.dot of float32 rows by a float64 vector
        # takes a slow generic loop) gives Detectron's values exactly
        hf = r.astype(np.float64) @ np.array([1, 1e3, 1e6, 1e9])
    else:
        hf = r.dot(np.array([1, 1e3, 1e6, 1e9]))  # Detectron's expression
    del r
    g = group - group.min()
    lo, hi = float(hf.min()), float(hf.max())
    if not (-2.0**53 < lo and hi < 2.0**53):  # huge coordinates: compare the floats
        order = np.lexsort((hf, g))
        new = np.ones(order.size, bool)
        new[1:] = (hf[order][1:] != hf[order][:-1]) | (g[order][1:] != g[order][:-1])
        keep = np.zeros(boxes.shape[0], bool)
        keep[order[new]] = True
        return keep
    h = hf.astype(np.int64)  # exact: integral values below 2**53
    h -= int(lo)
    del hf
    g = group - group.min()
    span = int(h.max()) + 1
    if span * (int(g.max()) + 1) < 2**62:
        # Duplicates are rare: sort the keys' values (a SIMD sort, ~4x cheaper than an
        # argsort) to find the repeated ones, then settle first occurrences among the
        # boxes carrying a repeated key only (np.unique's stable return_index).
        key = g * span + h
        ks = np.sort(key)
        rep = ks[1:][ks[1:] == ks[:-1]]
        if rep.size == 0:
            return np.ones(boxes.shape[0], bool)
        rep = np.unique(rep)
        at = np.minimum(np.searchsorted(rep, key), rep.size - 1)
        cand = np.flatnonzero(rep[at] == key)
        _, first = np.unique(key[cand], return_index=True)
        keep = np.ones(boxes.shape[0], bool)
        keep[cand] = False
        keep[cand[first]] = True
        return keep
    else:
        order = np.lexsort((h, g))
        new = np.ones(order.size, bool)
        new[1:] = (h[order][1:] != h[order][:-1]) | (g[order][1:] != g[order][:-1])
        first = order[new]
    keep = np.zeros(boxes.shape[0], bool)
    keep[first] = True
    return keep


def iof_pairs(props: np.ndarray, crowd: np.ndarray) -> np.ndarray:
    """Row-wise ``pycocotools.mask.iou(.., iscrowd=1)`` of float32 xyxy boxes (Detectron semantics:
    proposals).

    Detectron converts to xywh in float32 (``w = x2 - x1 + 1``), then the COCO API
    computes ``intersection / area(proposal)`` in double.
    """
    pw = (props[:, 2] - props[:, 0] + 1).astype(np.float64)
    ph = (props[:, 3] - props[:, 1] + 1).astype(np.float64)
    gw = (crowd[:, 2] - crowd[:, 0] + 1).astype(np.float64)
    gh = (crowd[:, 3] - crowd[:, 1] + 1).astype(np.float64)
    px, py = props[:, 0].astype(np.float64), props[:, 1].astype(np.float64)
    gx, gy = crowd[:, 0].astype(np.float64), crowd[:, 1].astype(np.float64)
    w = np.minimum(pw + px, gw + gx) - np.maximum(px, gx)
    h = np.minimum(ph + py, gh + gy) - np.maximum(py, gy)
    ok = (w > 0) & (h > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ok, (w * h) / (pw * ph), 0.0)


def _segment_pairs(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segments of the given sizes: owner index and position within, per element."""
    total = int(counts.sum())
    owner = np.repeat(np.arange(counts.size), counts)
    starts = np.cumsum(counts) - counts
    within = np.arange(total) - np.repeat(starts, counts)
    return owner, within


def build_proposal_table(src: ProposalSource, *, image_ids: np.ndarray, widths: np.ndarray,
                         heights: np.ndarray, gt_off: np.ndarray, gt_boxes: np.ndarray,
                         gt_classes: np.ndarray, gt_is_crowd: np.ndarray,
                         min_proposal_size: int = 2, proposal_limit: int = -1,
                         crowd_filter_thresh: float = 0.0,
                         progress: Optional[Callable[[int], None]] = None) -> ProposalTable:
    """Process a proposal file for one dataset exactly as Detectron does (Detectron semantics:
    proposals).

    Args:
        src: the opened file (:func:`read_proposal_file`).
        image_ids, widths, heights, gt_*: the dataset's gt table (images sorted by id).
        min_proposal_size: keep boxes with ``w > size`` and ``h > size`` (+1 widths).
        proposal_limit: keep the first ``limit`` per image if ``> 0``.
        crowd_filter_thresh: IoF threshold of the crowd filter; ``0`` disables it.
        progress: called with the number of images done after each chunk.

    Raises:
        RoIDBInputError: missing/duplicate ids, NaN or infinite coordinates.
    """
    counts: Counter = Counter()
    rec = align_records(src, image_ids, counts)
    n = image_ids.size
    n_boxes = src.counts[rec]
    # Outputs are allocated once for the file's box count and filled chunk by chunk: the
    # untouched tail (what the rules remove) is never paged in, and no concatenation
    # copies the columns (1000 proposals x 118k images is ~3 GiB of them).
    cap = int(n_boxes.sum())
    boxes = np.empty((cap, 4), np.float32)
    mo_all = np.empty(cap, np.float32)
    mc_all = np.empty(cap, np.int32)
    gm_all = np.empty(cap, np.int32)
    off = np.zeros(n + 1, np.int64)
    pos = 0
    start = 0
    while start < n:
        stop = start + 1
        acc = int(n_boxes[start])
        while stop < n and acc + int(n_boxes[stop]) <= _CHUNK_BOXES:
            acc += int(n_boxes[stop])
            stop += 1
        per_img, b, mo, mc, gmap = _chunk(
            src, rec, start, stop, image_ids, widths, heights, gt_off, gt_boxes, gt_classes,
            gt_is_crowd, min_proposal_size, proposal_limit, crowd_filter_thresh, counts)
        k = b.shape[0]
        boxes[pos:pos + k] = b
        mo_all[pos:pos + k] = mo
        mc_all[pos:pos + k] = mc
        gm_all[pos:pos + k] = gmap
        np.cumsum(per_img, out=off[start + 1:stop + 1])
        off[start + 1:stop + 1] += pos
        pos += k
        if progress is not None:
            progress(stop - start)
        start = stop
    table = ProposalTable(off=off, boxes=boxes[:pos], max_overlaps=mo_all[:pos],
                          max_classes=mc_all[:pos], gt_map=gm_all[:pos], counts=counts)
    counts["proposals_kept"] = int(off[-1])
    return table


def _chunk(src, rec, i0, i1, image_ids, widths, heights, gt_off, gt_boxes, gt_classes,
           gt_is_crowd, min_size, limit, crowd_thresh, counts):
    recs = rec[i0:i1]
    if src.flat is not None and recs.size and np.all(np.diff(recs) == 1):
        b = np.asarray(src.flat[src.flat_off[recs[0]]:src.flat_off[recs[-1] + 1]])
    else:
        arrays = [src.boxes_of(int(r)) for r in recs]
        b = np.concatenate(arrays) if arrays else np.zeros((0, 4), np.float32)
    if not np.issubdtype(b.dtype, np.floating):
        b = b.astype(np.float32)
    if b.base is not None or not (b.flags.writeable and b.flags.c_contiguous):
        b = np.array(b, copy=True)  # a view of the source: clipped in place below
    b = b.reshape(-1, 4)
    cnt = src.counts[recs]
    img = np.repeat(np.arange(i0, i1), cnt)
    counts["proposals_in_file"] += int(b.shape[0])
    if b.size and not (np.isfinite(b.min()) and np.isfinite(b.max())):  # NaN/inf propagate
        finite = np.isfinite(b).all(axis=1)
        bad = np.unique(image_ids[img[~finite]])
        raise RoIDBInputError(
            f"{src.path}: {int((~finite).sum())} proposal(s) have NaN or infinite coordinates "
            f"(image ids {bad[:10].tolist()}{' ...' if bad.size > 10 else ''}). Regenerate the "
            f"proposals or drop those boxes.")
    # 1. clip (in the file's dtype, as Detectron does in place: min(W - 1, max(0, x))),
    # all four columns in one contiguous pass against per-box [W-1, H-1, W-1, H-1] rows
    wm1 = (widths[i0:i1] - 1).astype(b.dtype)
    hm1 = (heights[i0:i1] - 1).astype(b.dtype)
    lim = np.repeat(np.stack([wm1, hm1, wm1, hm1], 1), cnt, axis=0)
    np.minimum(lim, np.maximum(0, b, out=b), out=b)
    del lim
    # 2. de-duplicate, then 3. min size (strict, +1 widths, in the file's dtype); the size
    # rule looks at each box alone, so both masks are applied in one compaction
    unique = unique_box_keep(b, img)
    w = b[:, 2] - b[:, 0] + 1
    h = b[:, 3] - b[:, 1] + 1
    big = (w > min_size) & (h > min_size)
    counts["proposals_duplicate"] += int(b.shape[0] - np.count_nonzero(unique))
    keep = unique & big
    counts["proposals_min_size"] += int(np.count_nonzero(unique) - np.count_nonzero(keep))
    b, img = b[keep], img[keep]
    # 4. optional limit (file order = descending score)
    if limit > 0 and img.size:
        _, rank = _segment_pairs(np.bincount(img - i0, minlength=i1 - i0))
        keep = rank < limit
        counts["proposals_limit"] += int((~keep).sum())
        b, img = b[keep], img[keep]
    b = b.astype(np.float32, copy=False)
    mo, mc, gmap = _merge(b, img, gt_off, gt_boxes, gt_classes)
    if crowd_thresh > 0:
        bad = _crowd_filter(b, img, gt_off, gt_boxes, gt_is_crowd, crowd_thresh)
        counts["proposals_crowd_filtered"] += int(bad.sum())
        mo[bad] = -1.0
        mc[bad] = 0
    per_img = np.bincount(img - i0, minlength=i1 - i0).astype(np.int64)
    return per_img, b, mo, mc, gmap


def _pairs_with_gt(img: np.ndarray, gt_off: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Proposal × gt-row pairs of the same image: (proposal idx, gt row)."""
    g0 = gt_off[img]
    p, within = _segment_pairs(gt_off[img + 1] - g0)
    return p, g0[p] + within


_IOU_BLOCK = 1 << 15  # proposals per IoU block: the float64 temporaries stay in cache


def _merge(b, img, gt_off, gt_boxes, gt_classes):
    """IoU merge into overlaps (Detectron semantics: proposals): ``(max_overlaps, max_classes,
    gt_map)``.

    Images are ordered by gt count ``G``, then by proposal count; consecutive images of
    one ``G`` form small padded ``(images, P)`` blocks (a few 10k proposals, so the
    float64 temporaries stay in the CPU cache), and the IoU with gt slot ``j = 0..G-1``
    is one broadcast per slot, folded into a running maximum (strictly greater replaces,
    so ties keep the lowest gt index, as ``argmax`` does). The per-pair arithmetic is
    :func:`lit_roidata.boxes.iou_kernel` (float64, rounded once to float32). ``img`` must be
    non-decreasing (proposals of one image contiguous), as :func:`_chunk` produces.
    Boxes of zero or negative area (possible only with ``min_proposal_size < 0`` or
    degenerate gt) go through :func:`_merge_blocks`, whose NaN handling matches
    ``argmax``'s.
    """
    n = b.shape[0]
    mo, mc, gmap = _merge_outputs(n)
    if n == 0:
        return mo, mc, gmap
    starts, pcount, uimg = _image_runs(img)
    g0 = gt_off[uimg]
    ng = (gt_off[uimg + 1] - g0).astype(np.int64)
    if not ng.any():
        return mo, mc, gmap
    r0, r1 = int(gt_off[uimg[0]]), int(gt_off[uimg[-1] + 1])
    gt64 = gt_boxes[r0:r1].astype(np.float64)  # the chunk's gt rows, from row r0
    ga = box_areas(gt64)
    if not (ga > 0).all():
        return _merge_blocks(b, img, gt_off, gt_boxes, gt_classes)
    cols = b.T  # a view: each block gathers its own rows
    gx1, gy1, gx2, gy2 = (np.ascontiguousarray(gt64[:, c]) for c in range(4))
    order = np.lexsort((-pcount, ng))
    order = order[ng[order] > 0]
    ng_o = ng[order]
    bounds = np.flatnonzero(np.r_[True, ng_o[1:] != ng_o[:-1], True])
    for gs, ge in zip(bounds[:-1], bounds[1:]):
        g = int(ng_o[gs])
        k0 = gs
        while k0 < ge:
            p_max = int(pcount[order[k0]])
            k1 = min(ge, k0 + max(1, _IOU_BLOCK // p_max))
            sel = order[k0:k1]
            k0 = k1
            if not _merge_block(sel, starts, pcount, p_max, g0 - r0, g, cols, gx1, gy1, gx2,
                                gy2, ga, gt_classes[r0:r1], mo, mc, gmap):
                return _merge_blocks(b, img, gt_off, gt_boxes, gt_classes)
    return mo, mc, gmap


def _merge_block(sel, starts, pcount, p_max, g0, g, cols, gx1, gy1, gx2, gy2, ga,
                 gt_classes, mo, mc, gmap) -> bool:
    """One padded block of :func:`_merge`: images ``sel`` (``g`` gt each, at most
    ``p_max`` proposals), written into ``mo``/``mc``/``gmap``. ``False`` (nothing
    written) when a proposal's area is not positive."""
    cnt = pcount[sel]
    ar = np.arange(p_max)
    valid = ar[None, :] < cnt[:, None]
    idx = starts[sel][:, None] + np.minimum(ar[None, :], cnt[:, None] - 1)
    px1, py1, px2, py2 = (c[idx].astype(np.float64) for c in cols)
    pab = px2 - px1
    pab += 1
    tmp = py2 - py1
    tmp += 1
    pab *= tmp  # box_areas' arithmetic, in float64
    if not (pab > 0).all():
        return False
    rows = g0[sel]
    shape = idx.shape
    work = (np.empty(shape), np.empty(shape), tmp)  # iou_kernel's float64 scratch, reused
    ov = np.empty(shape, np.float32)
    best = np.zeros(shape, np.float32)
    arg = np.zeros(shape, np.int32)
    upd = np.empty(shape, bool)
    for j in range(g):
        r = (rows + j)[:, None]
        iou_kernel(px1, py1, px2, py2, pab, gx1[r], gy1[r], gx2[r], gy2[r], ga[r],
                   out=ov, work=work, positive_areas=True)  # union > 0: both areas are
        if j == 0:
            best[...] = ov
            continue
        np.greater(ov, best, out=upd)
        np.copyto(best, ov, where=upd)
        np.copyto(arg, j, where=upd)
    pos = valid & (best > 0)
    hit = idx[pos]
    a = arg[pos]
    mo[hit] = best[pos]
    gmap[hit] = a
    mc[hit] = gt_classes[rows[:, None].repeat(p_max, 1)[pos] + a]
    return True


def _merge_outputs(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Zeroed ``max_overlaps``/``max_classes`` and an all ``-1`` ``box_to_gt_ind_map``."""
    return np.zeros(n, np.float32), np.zeros(n, np.int32), np.full(n, -1, np.int32)


def _image_runs(img: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start row, row count and image index of each run of equal ``img`` (rows are
    grouped by image)."""
    starts = np.flatnonzero(np.r_[True, img[1:] != img[:-1]])
    return starts, np.diff(np.r_[starts, img.shape[0]]), img[starts]


def _merge_blocks(b, img, gt_off, gt_boxes, gt_classes):
    """:func:`_merge` by whole ``(images, P_max, G)`` IoU blocks and ``argmax`` (any box
    areas, including zero or negative ones)."""
    n = b.shape[0]
    mo, mc, gmap = _merge_outputs(n)
    if n == 0:
        return mo, mc, gmap
    starts, pcount, uimg = _image_runs(img)
    ng = (gt_off[uimg + 1] - gt_off[uimg]).astype(np.int64)
    for g in np.unique(ng):
        if g == 0:
            continue
        sel = np.flatnonzero(ng == g)
        cnt = pcount[sel]
        ar = np.arange(int(cnt.max()))
        valid = ar[None, :] < cnt[:, None]
        idx = np.where(valid, starts[sel][:, None] + ar[None, :], starts[sel][:, None])
        rows = gt_off[uimg[sel]][:, None] + np.arange(g)[None, :]
        ov = _block_iou(b[idx].astype(np.float64), gt_boxes[rows].astype(np.float64))
        arg = ov.argmax(axis=2)
        best = np.take_along_axis(ov, arg[..., None], axis=2)[..., 0]
        pos = valid & (best > 0)
        hit = idx[pos]
        a = arg[pos]
        mo[hit] = best[pos]
        gmap[hit] = a
        mc[hit] = gt_classes[np.take_along_axis(rows, arg, axis=1)[pos]]
    return mo, mc, gmap


def _block_iou(p: np.ndarray, g: np.ndarray) -> np.ndarray:
    """IoU ``(k, P, G)`` of float64 proposals ``(k, P, 4)`` with gt ``(k, G, 4)`` of the
    same image: :func:`lit_roidata.boxes.iou_kernel` on the broadcast block.
    """
    pa, ga = box_areas(p), box_areas(g)
    return iou_kernel(p[:, :, None, 0], p[:, :, None, 1], p[:, :, None, 2], p[:, :, None, 3],
                      pa[:, :, None], g[:, None, :, 0], g[:, None, :, 1], g[:, None, :, 2],
                      g[:, None, :, 3], ga[:, None, :],
                      positive_areas=bool((pa > 0).all() and (ga > 0).all()))


def _crowd_filter(b, img, gt_off, gt_boxes, gt_is_crowd, thresh):
    """Proposals whose IoF with some crowd box of their image exceeds ``thresh``."""
    bad = np.zeros(b.shape[0], bool)
    crowd_rows = np.flatnonzero(gt_is_crowd)
    if crowd_rows.size == 0 or b.shape[0] == 0:
        return bad
    crowd_img = np.searchsorted(gt_off, crowd_rows, side="right") - 1
    crowd_off = np.zeros(gt_off.size, np.int64)
    np.cumsum(np.bincount(crowd_img, minlength=gt_off.size - 1), out=crowd_off[1:])
    p, c = _pairs_with_gt(img, crowd_off)
    if p.size == 0:
        return bad
    iof = iof_pairs(b[p], gt_boxes[crowd_rows[c]])
    bad[p[iof > thresh]] = True
    return bad


def empty_proposal_table(n: int) -> ProposalTable:
    """A table with no proposals for ``n`` images."""
    return ProposalTable(np.zeros(n + 1, np.int64), np.zeros((0, 4), np.float32),
                         np.zeros(0, np.float32), np.zeros(0, np.int32),
                         np.zeros(0, np.int32), Counter())
