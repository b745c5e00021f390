"""Proposal files → per-image proposal rows merged into the roidb (Detectron semantics)."""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from lit_roidata.boxes import box_areas, iou_kernel
from lit_roidata.roidb.cache import ArrayWriter, npy_header
from lit_roidata.roidb.info import RoIDBInputError
from lit_roidata.roidb.proposal_files import ProposalSource, convert_proposals, read_proposal_file
from lit_roidata.roidb.segms import offsets
from lit_roidata.roidb.workers import build_workers, map_ordered

__all__ = ["ProposalTable", "ProposalSource", "read_proposal_file", "convert_proposals",
           "build_proposal_table", "unique_box_keep", "iof_pairs", "ProposalColumns",
           "proposal_dtypes", "PROPOSAL_COLUMNS"]

logger = logging.getLogger(__name__)

_CHUNK_BOXES = 1 << 18  # proposals per vectorised chunk: small, reused temporaries


@dataclass
class ProposalTable:
    """Proposal rows of one dataset, aligned with its images (sorted by id): ``off`` (n+1,)
    row ranges, the four :data:`PROPOSAL_COLUMNS` (float32 boxes and overlaps; classes and
    ``gt_map``, -1 where no gt overlaps, int32 or narrow), ``counts`` (what was removed, by
    reason) and ``columns``: the shared :class:`ProposalColumns` the rows went to (then the
    four arrays are ``None``)."""

    off: np.ndarray
    boxes: Optional[np.ndarray]
    max_overlaps: Optional[np.ndarray]
    max_classes: Optional[np.ndarray]
    gt_map: Optional[np.ndarray]
    counts: Counter
    columns: Optional["ProposalColumns"] = None


def align_records(src: ProposalSource, image_ids: np.ndarray, counts: Counter) -> np.ndarray:
    """Record index for each image (sorted ids), as Detectron aligns them."""
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
    return order[np.searchsorted(ids[order], image_ids)]


def unique_box_keep(boxes: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Keep-mask of first occurrences of Detectron's float64 box hash ``round(x1) + 1e3
    round(y1) + 1e6 round(x2) + 1e9 round(y2)`` within each group (it can collide,
    Detectron quirk Q13)."""
    if boxes.shape[0] == 0:
        return np.zeros(0, bool)
    r = np.round(boxes)
    if r.size and float(np.abs(r).max()) < 2.0**53 / 1.002e9:
        # every partial sum is an integer below 2**53, exact in any order: four float64
        # column products give Detectron's values (np.dot takes a slow generic loop)
        r64 = r.astype(np.float64)
        hf = r64[:, 3] * 1e9 + r64[:, 2] * 1e6 + r64[:, 1] * 1e3 + r64[:, 0]
        del r64
    else:
        hf = r.dot(np.array([1, 1e3, 1e6, 1e9]))  # Detectron's expression
    del r
    g = group - group.min()
    lo, hi = float(hf.min()), float(hf.max())
    exact = -2.0**53 < lo and hi < 2.0**53  # else (huge coordinates) compare the floats
    if exact:
        h = hf.astype(np.int64)  # exact: integral values below 2**53
        h -= int(lo)
        del hf
        span = int(h.max()) + 1
    if exact and span * (int(g.max()) + 1) < 2**62:
        # Duplicates are rare: a (SIMD) sort finds the repeated keys, then first
        # occurrences are settled among their boxes only (np.unique's stable return_index)
        key = g * span + h
        ks = np.sort(key)
        rep = ks[1:][ks[1:] == ks[:-1]]
        if rep.size == 0:
            return np.ones(boxes.shape[0], bool)
        rep = np.unique(rep)
        # a 2**20-bit table of the repeated keys' low bits narrows them down first
        seen = np.zeros(1 << 20, bool)
        seen[rep & 0xFFFFF] = True
        cand = np.flatnonzero(seen[key & 0xFFFFF])
        at = np.minimum(np.searchsorted(rep, key[cand]), rep.size - 1)
        cand = cand[rep[at] == key[cand]]
        _, first = np.unique(key[cand], return_index=True)
        keep = np.ones(boxes.shape[0], bool)
        keep[cand] = False
        keep[cand[first]] = True
        return keep
    v = h if exact else hf
    order = np.lexsort((v, g))
    new = np.ones(order.size, bool)
    new[1:] = (v[order][1:] != v[order][:-1]) | (g[order][1:] != g[order][:-1])
    keep = np.zeros(boxes.shape[0], bool)
    keep[order[new]] = True
    return keep


def iof_pairs(props: np.ndarray, crowd: np.ndarray) -> np.ndarray:
    """Row-wise ``pycocotools.mask.iou(.., iscrowd=1)`` of float32 xyxy boxes."""
    # widths and heights in the boxes' dtype (+1), then float64, as pycocotools gets them
    pw, ph, gw, gh = ((x[:, k + 2] - x[:, k] + 1).astype(np.float64)
                      for x in (props, crowd) for k in (0, 1))
    px, py, gx, gy = (x[:, k].astype(np.float64) for x in (props, crowd) for k in (0, 1))
    w = np.minimum(pw + px, gw + gx) - np.maximum(px, gx)
    h = np.minimum(ph + py, gh + gy) - np.maximum(py, gy)
    ok = (w > 0) & (h > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ok, (w * h) / (pw * ph), 0.0)


def _segment_pairs(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segments of the given sizes: owner index and position within, per element."""
    starts = np.cumsum(counts) - counts
    return (np.repeat(np.arange(counts.size), counts),
            np.arange(int(counts.sum())) - np.repeat(starts, counts))


def build_proposal_table(src: ProposalSource, *, image_ids: np.ndarray, widths: np.ndarray,
                         heights: np.ndarray, gt_off: np.ndarray, gt_boxes: np.ndarray,
                         gt_classes: np.ndarray, gt_is_crowd: np.ndarray,
                         min_proposal_size: int = 2, proposal_limit: int = -1,
                         crowd_filter_thresh: float = 0.0,
                         progress: Optional[Callable[[int], None]] = None,
                         out: Optional["ProposalColumns"] = None) -> ProposalTable:
    """Process a proposal file (:func:`read_proposal_file`) for one dataset (its gt table,
    images sorted by id) exactly as Detectron does: clip, de-duplicate, drop boxes not
    larger than ``min_proposal_size``, keep ``proposal_limit`` (if > 0), merge, crowd
    filter (``crowd_filter_thresh`` > 0). ``progress(n)`` after each chunk; with ``out``
    the rows go to that :class:`ProposalColumns` (the table's arrays are then ``None``).
    RoIDBInputError: missing/duplicate ids, NaN or infinite coordinates.
    """
    counts: Counter = Counter()
    rec = align_records(src, image_ids, counts)
    # Each chunk's rows are appended to four files (the cache's final files, else scratch
    # files the table maps): first-touching GBs of anonymous memory costs several times
    # more CPU than writing into the page cache, and nothing writes the columns twice.
    own = out is None
    out = ProposalColumns(None, persistent=False) if own else out
    off, pos = np.zeros(image_ids.size + 1, np.int64), 0
    chunks = _chunk_ranges(src.counts[rec])
    gt = (image_ids, widths, heights, gt_off, gt_boxes, gt_classes, gt_is_crowd)

    def one_chunk(task: tuple, state: dict) -> tuple:
        return _chunk(src, rec, *task, gt, min_proposal_size, proposal_limit, crowd_filter_thresh)

    # chunks are independent (rules are per image): forked workers compute them in order
    workers = build_workers() if len(chunks) >= 4 else 0
    if workers:
        out.writer.wait()  # no writer threads while forking (a previous dataset's)
    try:
        for (start, stop), (res, c) in zip(chunks, map_ordered(one_chunk, chunks, workers)):
            per_img, b, mo, mc, gmap = res
            counts.update(c)
            out.append(b, mo, mc, gmap)
            off[start + 1:stop + 1] = np.cumsum(per_img) + pos
            pos += b.shape[0]
            if progress is not None:
                progress(stop - start)
        if own:
            arrays = out.finish()
    except BaseException:
        out.close()
        raise
    counts["proposals_kept"] = int(off[-1])
    rows = [arrays[name] if own else None for name, _ in PROPOSAL_COLUMNS]
    return ProposalTable(off, *rows, counts, columns=None if own else out)


def _chunk_ranges(n_boxes: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive image ranges of about :data:`_CHUNK_BOXES` boxes (at least one image)."""
    n, cum, out, start = n_boxes.size, np.cumsum(n_boxes), [], 0
    while start < n:
        base = int(cum[start - 1]) if start else 0
        # the last image whose running total from ``start`` stays within the chunk
        stop = min(n, max(start + 1, int(np.searchsorted(cum, base + _CHUNK_BOXES, "right"))))
        out.append((start, stop))
        start = stop
    return out


#: The cache's proposal columns, in order: name, row shape.
PROPOSAL_COLUMNS = (("prop_boxes", (4,)), ("prop_max_overlaps", ()), ("prop_max_classes", ()),
                    ("prop_gt_map", ()))


def proposal_dtypes(num_classes: int, max_gt: int) -> tuple[np.dtype, np.dtype]:
    """The narrowest dtypes of ``(prop_max_classes, prop_gt_map)``."""
    nc, g = int(num_classes), int(max_gt)
    mc = np.uint8 if nc <= 1 << 8 else np.int16 if nc <= 1 << 15 else np.int32
    gm = np.int8 if g <= 1 << 7 else np.int16 if g <= 1 << 15 else np.int32
    return np.dtype(mc), np.dtype(gm)


class ProposalColumns:
    """The four proposal columns of a roidb, each written once, chunk by chunk, into
    ``directory`` (``persistent`` named ``.npy`` files, else unlinked scratch files);
    ``num_classes`` / ``max_gt`` choose the dtypes (:func:`proposal_dtypes`; ``None``: int32).
    """

    def __init__(self, directory: Optional[str], *, num_classes: Optional[int] = None,
                 max_gt: Optional[int] = None, persistent: bool = True) -> None:
        mc, gm = proposal_dtypes(2**31 if num_classes is None else num_classes,  # None: int32
                                 2**31 if max_gt is None else max_gt)
        self.spec = tuple((name, np.dtype(dt), shape) for (name, shape), dt
                          in zip(PROPOSAL_COLUMNS, (np.float32, np.float32, mc, gm)))
        self.bounds = (np.iinfo(mc).max if num_classes is None else int(num_classes) - 1,
                       np.iinfo(gm).max if max_gt is None else int(max_gt) - 1)
        self.persistent, self.rows, self._reserved = persistent, 0, 0
        self.records: dict = {}
        if persistent:
            if directory is None:
                raise ValueError("persistent proposal columns need a directory")
            # every header this writer can need fits; .npy headers are padded to 64 bytes
            self._reserved = max(len(npy_header(dt, (np.iinfo(np.int64).max, *sh)))
                                 for _, dt, sh in self.spec)
            self.files = [open(os.path.join(directory, name + ".npy"), "w+b")
                          for name, _, _ in self.spec]
        else:
            if os.name == "nt":  # open files would block renaming the build directory
                directory = None
            self.files = [tempfile.TemporaryFile(prefix="lit-roidata-proposal-rows-",
                                                 dir=directory) for _ in self.spec]
        self.writer = ArrayWriter(directory, _WRITE_THREADS, durable=persistent,
                                  max_pending=_MAX_PENDING_WRITES)

    def append(self, boxes: np.ndarray, max_overlaps: np.ndarray, max_classes: np.ndarray,
               gt_map: np.ndarray) -> None:
        """Append one chunk's rows to every column (values checked against the bounds)."""
        if max_classes.size:
            for name, a, lo, hi, what in (("max_classes", max_classes, 0, self.bounds[0], "class"),
                                          ("gt_map", gt_map, -1, self.bounds[1], "gt")):
                if int(a.max()) > hi or int(a.min()) < lo:
                    raise RuntimeError(f"{name} values outside [{lo}, {hi}]: the {what} count "
                                       f"given to ProposalColumns is too small")
        for fh, arr, (_, dtype, shape) in zip(self.files, (boxes, max_overlaps, max_classes,
                                                           gt_map), self.spec):
            at = self._reserved + self.rows * dtype.itemsize * math.prod(shape)
            self.writer.write(fh.fileno(), at, np.ascontiguousarray(arr, dtype).reshape(-1))
        self.rows += int(boxes.shape[0])

    def finish(self) -> dict:
        """Close the columns: ``{name: read-only array}`` (memory maps of the files)."""
        n, out = self.rows, {}
        try:
            if self.persistent:
                for fh, (name, dtype, shape) in zip(self.files, self.spec):
                    self.writer.seal(name, fh.fileno(), dtype, (n, *shape), self._reserved)
                self.records = self.writer.finish([fh.fileno() for fh in self.files])
            else:
                self.writer.finish()
                for fh, (name, dtype, shape) in zip(self.files, self.spec):
                    out[name] = (np.zeros((0, *shape), dtype) if n == 0 else
                                 np.memmap(fh, dtype, "r", shape=(n, *shape)))
        finally:
            self.close()
        if self.persistent:
            for fh, (name, _, _) in zip(self.files, self.spec):
                out[name] = np.asarray(np.load(fh.name, mmap_mode="r", allow_pickle=False))
        return out

    def close(self) -> None:
        """Close the files (the maps keep their pages; scratch files are unlinked), after
        the writes in progress (those not started are dropped)."""
        self.writer.close()
        for fh in self.files:
            fh.close()


_WRITE_THREADS = 3
_MAX_PENDING_WRITES = 64  # column writes (16 chunks) queued before append waits


def _chunk(src, rec, i0, i1, gt, min_size, limit, crowd_thresh):
    counts: Counter = Counter()
    image_ids, widths, heights, gt_off, gt_boxes, gt_classes, gt_is_crowd = gt
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
    # 1. clip in the file's dtype, as Detectron does in place: min(W - 1, max(0, x))
    wm1, hm1 = ((x[i0:i1] - 1).astype(b.dtype) for x in (widths, heights))
    lim = np.repeat(np.stack([wm1, hm1, wm1, hm1], 1), cnt, axis=0)
    np.minimum(lim, np.maximum(0, b, out=b), out=b)
    del lim
    # 2. de-duplicate, then 3. min size (strict, +1 widths), applied in one compaction
    unique = unique_box_keep(b, img)
    big = (b[:, 2] - b[:, 0] + 1 > min_size) & (b[:, 3] - b[:, 1] + 1 > min_size)
    counts["proposals_duplicate"] += int(b.shape[0] - np.count_nonzero(unique))
    keep = unique & big
    counts["proposals_min_size"] += int(np.count_nonzero(unique) - np.count_nonzero(keep))
    if not keep.all():
        b, img = b.take(kept := np.flatnonzero(keep), axis=0), img.take(kept)
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
    return (np.bincount(img - i0, minlength=i1 - i0).astype(np.int64), b, mo, mc, gmap), counts


_IOU_BLOCK = 1 << 16  # padded proposal slots per merge block (the temporaries stay in cache)
_SAFE_COORD = 2.0**22  # below it, float32 thresholds +-2 around a gt edge are exact enough


def _merge(b, img, gt_off, gt_boxes, gt_classes):
    """IoU merge into overlaps: ``(max_overlaps, max_classes, gt_map)``, ``img``
    non-decreasing. Padded ``(images, P)`` blocks of ~64k float32 slots are tested against
    each gt box widened by 2 pixels (other pairs have IoU 0); candidates get Detectron's
    float64 IoU (:func:`lit_roidata.boxes.iou_kernel`) in a running maximum (ties keep the
    lowest gt index, as ``argmax``). Non-positive areas and coordinates of ``2**22`` or
    more go through :func:`_merge_blocks`."""
    n = b.shape[0]
    mo, mc, gmap = np.zeros(n, np.float32), np.zeros(n, np.int32), np.full(n, -1, np.int32)
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
    cols = [np.ascontiguousarray(b[:, c]) for c in range(4)]  # float32 x1, y1, x2, y2
    # box_areas' factors: the area is > 0 iff both are (no underflow from float32)
    wx = cols[2].astype(np.float64) - cols[0] + 1
    wy = cols[3].astype(np.float64) - cols[1] + 1
    big = max(float(np.abs(gt64).max()), float(np.abs(b).max()))
    if not ((ga > 0).all() and (wx > 0).all() and (wy > 0).all() and big < _SAFE_COORD):
        return _merge_blocks(b, img, gt_off, gt_boxes, gt_classes)
    del wx, wy
    gx1, gy1, gx2, gy2 = (np.ascontiguousarray(gt64[:, c]) for c in range(4))
    # float32 candidate thresholds: max(x1) > min(x2) + 1.75 means iw <= 0 (also in y);
    # below 2**22 the rounding of g +- 2 is at most 0.25
    thr = tuple((g + d).astype(np.float32) for g, d in ((gx2, 2), (gx1, -2), (gy2, 2), (gy1, -2)))
    gt_rows = (gx1, gy1, gx2, gy2, ga)
    best = mo  # zeros; only ever replaced by a strictly greater (positive) IoU
    arg = np.zeros(n, np.int32)
    pc = pcount.tolist()
    k0, m = 0, len(pc)
    while k0 < m:  # blocks of consecutive images, at most _IOU_BLOCK padded slots
        k1, p_max = k0 + 1, pc[k0]
        while k1 < m and max(p_max, pc[k1]) * (k1 + 1 - k0) <= _IOU_BLOCK:
            p_max = max(p_max, pc[k1])
            k1 += 1
        _merge_block(k0, k1, p_max, starts, pcount, g0 - r0, ng, cols, thr, gt_rows, best, arg)
        k0 = k1
    hit = np.flatnonzero(best > 0)
    gmap[hit] = a = arg[hit]
    own = np.repeat(g0 - r0, pcount)  # each proposal's first gt row
    mc[hit] = gt_classes[r0:r1][own[hit] + a]
    return mo, mc, gmap


def _merge_block(k0, k1, p_max, starts, pcount, g0, ng, cols, thr, gt_rows, best, arg) -> None:
    """One padded block of :func:`_merge`: images ``k0..k1`` (at most ``p_max`` proposals
    each), folded into the running maximum ``best`` / ``arg`` (indexed by proposal)."""
    gx1, gy1, gx2, gy2, ga = gt_rows
    hi_x, lo_x, hi_y, lo_y = thr
    k = k1 - k0
    s, e = int(starts[k0]), int(starts[k1 - 1] + pcount[k1 - 1])
    cnt = pcount[k0:k1]
    if e - s == k * p_max:  # every image has p_max proposals: views, no copy
        q = [c[s:e].reshape(k, p_max) for c in cols]
    else:
        valid = np.arange(p_max)[None, :] < cnt[:, None]
        q = []
        for c in cols:
            t = np.full((k, p_max), np.nan, np.float32)  # NaN pads are never candidates
            t[valid] = c[s:e]
            q.append(t)
    # rows by gt count, descending: the images with a gt slot j are a prefix
    perm = np.argsort(-ng[k0:k1], kind="stable")
    qx1, qy1, qx2, qy2 = (t[perm] for t in q)
    rows, gcount, row_start = (x[k0:k1][perm] for x in (g0, ng, starts))
    for j in range(int(gcount[0])):
        kj = int(np.count_nonzero(gcount > j))
        r = rows[:kj] + j
        cand = qx1[:kj] <= hi_x[r][:, None]
        cand &= qx2[:kj] >= lo_x[r][:, None]
        cand &= qy1[:kj] <= hi_y[r][:, None]
        cand &= qy2[:kj] >= lo_y[r][:, None]
        f = np.flatnonzero(cand)
        if f.size == 0:
            continue
        row, col = np.divmod(f, p_max)
        p = row_start[row] + col  # the candidates' proposal indices
        rr = r[row]
        px1, py1, px2, py2 = (c[p].astype(np.float64) for c in cols)
        pab = (px2 - px1 + 1) * (py2 - py1 + 1)  # box_areas' arithmetic, in float64
        ov = iou_kernel(px1, py1, px2, py2, pab, gx1[rr], gy1[rr], gx2[rr], gy2[rr], ga[rr],
                        positive_areas=True)  # union > 0: both areas are
        upd = ov > best[p]  # pairs left out have IoU 0 and never replace
        p = p[upd]
        best[p] = ov[upd]
        arg[p] = j


def _image_runs(img: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start row, row count and image index of each run of equal ``img`` (rows are
    grouped by image)."""
    starts = np.flatnonzero(np.r_[True, img[1:] != img[:-1]])
    return starts, np.diff(np.r_[starts, img.shape[0]]), img[starts]


def _merge_blocks(b, img, gt_off, gt_boxes, gt_classes):
    """:func:`_merge` by whole ``(images, P_max, G)`` IoU blocks and ``argmax`` (any box
    areas, including zero or negative ones)."""
    n = b.shape[0]
    mo, mc, gmap = np.zeros(n, np.float32), np.zeros(n, np.int32), np.full(n, -1, np.int32)
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
        mo[hit] = best[pos]
        gmap[hit] = arg[pos]
        mc[hit] = gt_classes[np.take_along_axis(rows, arg, axis=1)[pos]]
    return mo, mc, gmap


def _block_iou(p: np.ndarray, g: np.ndarray) -> np.ndarray:
    """IoU ``(k, P, G)`` of float64 proposals ``(k, P, 4)`` with gt ``(k, G, 4)`` of the
    same image (:func:`lit_roidata.boxes.iou_kernel` on the broadcast block)."""
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
    crowd_off = offsets(np.bincount(crowd_img, minlength=gt_off.size - 1))
    # only the proposals of images with a crowd box: (proposal, crowd row) pairs
    starts, pcount, uimg = _image_runs(img)
    c0 = crowd_off[uimg]
    cc = crowd_off[uimg + 1] - c0
    sel = np.flatnonzero(cc > 0)
    if sel.size == 0:
        return bad
    run, within = _segment_pairs(pcount[sel])
    props = starts[sel][run] + within
    k, cw = _segment_pairs(cc[sel][run])
    p = props[k]
    bad[p[iof_pairs(b[p], gt_boxes[crowd_rows[c0[sel][run][k] + cw]]) > thresh]] = True
    return bad


def empty_proposal_table(n: int) -> ProposalTable:
    """A table with no proposals for ``n`` images."""
    return ProposalTable(np.zeros(n + 1, np.int64), np.zeros((0, 4), np.float32),
                         np.zeros(0, np.float32), np.zeros(0, np.int32), np.zeros(0, np.int32),
                         Counter())
