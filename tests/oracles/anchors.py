"""Test oracle: lit_roidata.minibatch.anchors of main before the RPN rewrite (verbatim).

Kept so that tests can compare the package to it on many inputs.
"""


from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from lit_roidata.boxes import bbox_overlaps_pairs

__all__ = [
    "scaled_noncrowd_gt",
    "FieldOfAnchors",
    "generate_anchors",
    "field_size",
    "get_field_of_anchors",
    "rpn_fields",
    "retinanet_fields",
    "concat_fields",
    "level_offsets",
    "anchor_gt_overlaps",
    "inside_mask",
]


def generate_anchors(
    stride: float = 16,
    sizes: Sequence[float] = (32, 64, 128, 256, 512),
    aspect_ratios: Sequence[float] = (0.5, 1, 2),
) -> np.ndarray:
    """Cell anchors ``(len(ratios) * len(sizes), 4)`` float64, ratio-major (Detectron semantics:
    minibatch primitives).

    The base window is ``(0, 0, stride-1, stride-1)``. For each ratio ``r = h/w``:
    ``w_r = round(sqrt(stride^2 / r))``, ``h_r = round(w_r * r)`` (NumPy's round half
    to even), then for each size ``s`` the window is scaled by ``s / stride`` about the
    base centre. The arithmetic follows Detectron's ``generate_anchors.py`` step by step
    so the results are bit-identical.

    Example:
        >>> generate_anchors(4, (32,), (0.5, 1, 2)).tolist()[0]
        [-22.0, -10.0, 25.0, 13.0]
    """
    scales = np.asarray(sizes, dtype=np.float64) / stride
    ratios = np.asarray(aspect_ratios, dtype=np.float64)
    base = np.array([1, 1, stride, stride], dtype=np.float64) - 1
    w, h, cx, cy = _whctrs(base)
    ws = np.round(np.sqrt(w * h / ratios))
    hs = np.round(ws * ratios)
    ratio_anchors = _mkanchors(ws, hs, cx, cy)
    out = [_mkanchors(*_scaled(ratio_anchors[i], scales)) for i in range(len(ratios))]
    return np.vstack(out) if out else np.zeros((0, 4), dtype=np.float64)


def _whctrs(anchor: np.ndarray) -> tuple[Any, Any, Any, Any]:
    w = anchor[2] - anchor[0] + 1
    h = anchor[3] - anchor[1] + 1
    return w, h, anchor[0] + 0.5 * (w - 1), anchor[1] + 0.5 * (h - 1)


def _scaled(anchor: np.ndarray, scales: np.ndarray) -> tuple[Any, Any, Any, Any]:
    w, h, cx, cy = _whctrs(anchor)
    return w * scales, h * scales, cx, cy


def _mkanchors(ws: np.ndarray, hs: np.ndarray, cx: float, cy: float) -> np.ndarray:
    ws = ws[:, None]
    hs = hs[:, None]
    return np.hstack((cx - 0.5 * (ws - 1), cy - 0.5 * (hs - 1),
                      cx + 0.5 * (ws - 1), cy + 0.5 * (hs - 1)))


@dataclass(frozen=True)
class FieldOfAnchors:
    """All anchors of one stride on the fixed ``F x F`` grid (Detectron's ``FieldOfAnchors``).

    Attributes:
        field_of_anchors: float32 ``(F*F*A, 4)``, enumerated ``(y, x, a)`` with ``a``
            fastest; read-only (shared by every caller in the process).
        num_cell_anchors: ``A``.
        stride: the level's stride in input pixels.
        field_size: ``F``.
        octave, aspect: RetinaNet's octave and aspect index of this field (else None).
        key: the memoisation key (stride, sizes, ratios, coarsest stride, max size).
    """

    field_of_anchors: np.ndarray
    num_cell_anchors: int
    stride: float
    field_size: int
    octave: int | None = None
    aspect: int | None = None
    key: tuple[Any, ...] = ()


def field_size(stride: float, coarsest_stride: int, max_size: int) -> int:
    """``F = ceil(COARSEST_STRIDE * ceil(MAX_SIZE / COARSEST_STRIDE) / stride)`` (Detectron
    semantics: minibatch primitives, Detectron quirk Q29 (docs/detectron_quirks.md)).

    ``FPN.COARSEST_STRIDE`` sizes the field even when FPN is off, as in Detectron.
    """
    fpn_max_size = coarsest_stride * np.ceil(max_size / float(coarsest_stride))
    return int(np.ceil(fpn_max_size / float(stride)))


@functools.lru_cache(maxsize=64)
def _field_array(stride: float, sizes: tuple[float, ...], ratios: tuple[float, ...],
                 coarsest_stride: int, max_size: int) -> tuple[np.ndarray, int, int]:
    cell = generate_anchors(stride=stride, sizes=sizes, aspect_ratios=ratios)
    num_a = cell.shape[0]
    f = field_size(stride, coarsest_stride, max_size)
    shifts = np.arange(0, f) * stride
    shift_x, shift_y = np.meshgrid(shifts, shifts)
    shift_x, shift_y = shift_x.ravel(), shift_y.ravel()
    shifts4 = np.vstack((shift_x, shift_y, shift_x, shift_y)).transpose()
    field = cell.reshape((1, num_a, 4)) + shifts4.reshape((1, -1, 4)).transpose((1, 0, 2))
    field = field.reshape((-1, 4)).astype(np.float32)
    field.setflags(write=False)
    return field, num_a, f


def get_field_of_anchors(
    stride: float,
    sizes: Sequence[float],
    aspect_ratios: Sequence[float],
    *,
    coarsest_stride: int,
    max_size: int,
    octave: int | None = None,
    aspect: int | None = None,
) -> FieldOfAnchors:
    """The memoised field of anchors for one stride (Detectron semantics: minibatch primitives).

    ``anchor[(y*F + x)*A + a] = cell[a] + (x*s, y*s, x*s, y*s)``. Memoised per process
    on all parameters (Detectron keys on ``stride, sizes, ratios`` only, per thread;
    including ``COARSEST_STRIDE`` and ``MAX_SIZE`` makes a config change safe).

    Args:
        stride: grid step ``s`` (``2**level`` with FPN, ``RPN.STRIDE`` without).
        sizes, aspect_ratios: forwarded to :func:`generate_anchors`.
        coarsest_stride: ``FPN.COARSEST_STRIDE``; max_size: ``TRAIN.MAX_SIZE``.
        octave, aspect: RetinaNet bookkeeping carried on the result.
    """
    key = (float(stride), tuple(float(s) for s in sizes),
           tuple(float(r) for r in aspect_ratios), int(coarsest_stride), int(max_size))
    field, num_a, f = _field_array(*key)
    return FieldOfAnchors(field, num_a, float(stride), f, octave, aspect, key)


def rpn_fields(cfg: Any) -> list[FieldOfAnchors]:
    """The RPN's fields: one per FPN level ``RPN_MIN..RPN_MAX``, or the single level (Detectron
    semantics: RPN targets).

    FPN level ``l`` uses stride ``2**l``, one size ``RPN_ANCHOR_START_SIZE *
    2**(l - RPN_MIN_LEVEL)`` and ``FPN.RPN_ASPECT_RATIOS`` (A = 3 by default); the
    single level uses ``RPN.STRIDE``, ``RPN.SIZES``, ``RPN.ASPECT_RATIOS`` (A = 12).
    """
    kw = dict(coarsest_stride=cfg.FPN.COARSEST_STRIDE, max_size=cfg.TRAIN.MAX_SIZE)
    if cfg.FPN.FPN_ON and cfg.FPN.MULTILEVEL_RPN:
        k_min, k_max = cfg.FPN.RPN_MIN_LEVEL, cfg.FPN.RPN_MAX_LEVEL
        return [get_field_of_anchors(2.0 ** lvl,
                                     (cfg.FPN.RPN_ANCHOR_START_SIZE * 2.0 ** (lvl - k_min),),
                                     cfg.FPN.RPN_ASPECT_RATIOS, **kw)
                for lvl in range(k_min, k_max + 1)]
    return [get_field_of_anchors(cfg.RPN.STRIDE, cfg.RPN.SIZES, cfg.RPN.ASPECT_RATIOS, **kw)]


def retinanet_fields(cfg: Any) -> list[FieldOfAnchors]:
    """RetinaNet's fields in (level, octave, aspect) order, one anchor each (Detectron semantics:
    RetinaNet targets).

    Size ``2**l * 2**(octave / SCALES_PER_OCTAVE) * ANCHOR_SCALE``, ratio
    ``RETINANET.ASPECT_RATIOS[aspect]``.
    """
    r = cfg.RETINANET
    kw = dict(coarsest_stride=cfg.FPN.COARSEST_STRIDE, max_size=cfg.TRAIN.MAX_SIZE)
    out = []
    for lvl in range(cfg.FPN.RPN_MIN_LEVEL, cfg.FPN.RPN_MAX_LEVEL + 1):
        stride = 2.0 ** lvl
        for octave in range(r.SCALES_PER_OCTAVE):
            octave_scale = 2 ** (octave / float(r.SCALES_PER_OCTAVE))
            for idx, ratio in enumerate(r.ASPECT_RATIOS):
                out.append(get_field_of_anchors(
                    stride, (stride * octave_scale * r.ANCHOR_SCALE,), (ratio,),
                    octave=octave, aspect=idx, **kw))
    return out


@functools.lru_cache(maxsize=16)
def _concat(keys: tuple[tuple[Any, ...], ...]) -> np.ndarray:
    arrays = [_field_array(*k)[0] for k in keys]
    out = np.concatenate(arrays) if arrays else np.zeros((0, 4), np.float32)
    out.setflags(write=False)
    return out


def concat_fields(fields: Sequence[FieldOfAnchors]) -> np.ndarray:
    """All anchors of ``fields`` concatenated in order (read-only, memoised)."""
    return _concat(tuple(f.key for f in fields))


def level_offsets(fields: Sequence[FieldOfAnchors]) -> np.ndarray:
    """Start index of each field in :func:`concat_fields`, plus the total at the end."""
    sizes = [f.field_of_anchors.shape[0] for f in fields]
    return np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)


def anchor_gt_overlaps(
    fields: Sequence[FieldOfAnchors], all_anchors: np.ndarray, inside: np.ndarray,
    gt: np.ndarray, below: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """IoU of inside anchors against gt boxes, without the dense ``K x G`` product.

    Labelling needs, per anchor, whether its max IoU reaches the thresholds, and per gt
    its best anchors; IoUs that are provably below both ``below`` and the gt's best
    IoU cannot change either, so they are skipped (left 0):

    * per field and cell anchor shape, the grid cells whose anchor can touch gt ``g``
      form a rectangle (2-pixel margin), enumerated without a loop over boxes;
    * a whole (shape, gt) rectangle is skipped when the area-ratio bound
      ``min(area)/max(area)`` on its IoU is below ``below`` and below a lower bound of
      the gt's best IoU (from the inside anchor nearest to the gt's centre).

    IoUs come from :func:`lit_roidata.boxes.iou_kernel` (via ``bbox_overlaps_pairs``),
    so every kept entry equals the dense matrix's entry bit for bit, every maximum and
    every best-match tie is the dense one, and the row argmax may differ only where the
    row max is below ``below`` (callers recompute it where they need it).

    Args:
        inside: bool mask over ``all_anchors`` of the anchors that take part.
        below: ``min(RPN_NEGATIVE_OVERLAP, RPN_POSITIVE_OVERLAP)``; 0 disables skipping.

    Returns:
        ``(cand, overlaps)``: ascending indices into ``all_anchors`` of the inside
        anchors whose IoU was computed, and their ``(len(cand), G)`` IoUs.
    """
    tab = _shape_table(tuple(f.key for f in fields))
    g = gt.astype(np.float64)
    lower = _best_iou_lower_bound(tab, all_anchors, inside, gt)
    g_area = (g[:, 2] - g[:, 0] + 1.0) * (g[:, 3] - g[:, 1] + 1.0)
    a_area = tab["area"][:, None]
    bound = np.minimum(a_area, g_area[None]) / np.maximum(a_area, g_area[None])
    useful = bound >= np.minimum(lower, below) / (1 + 1e-6)  # (shapes, G)
    gidx, gid = _candidate_pairs(tab, g, useful)
    keep = inside[gidx]
    gidx, gid = gidx[keep], gid[keep]
    iou = bbox_overlaps_pairs(all_anchors[gidx], gt[gid])
    is_cand = np.zeros(all_anchors.shape[0], dtype=bool)
    is_cand[gidx] = True
    cand = np.flatnonzero(is_cand)
    row = np.empty(all_anchors.shape[0], dtype=np.int64)  # only read at cand
    row[cand] = np.arange(len(cand))
    overlaps = np.zeros((len(cand), len(gt)), dtype=np.float32)
    overlaps[row[gidx], gid] = iou
    return cand, overlaps


def _best_iou_lower_bound(tab: dict[str, np.ndarray], all_anchors: np.ndarray,
                          inside: np.ndarray, gt: np.ndarray) -> np.ndarray:
    """Per gt, the best IoU among the inside anchors of each shape nearest its centre."""
    base, stride, size, n_a, cell = tab["base"], tab["stride"], tab["size"], tab["n_a"], tab["cell"]
    g = gt.astype(np.float64)
    x = np.clip(np.round(((g[:, 0] + g[:, 2])[None] - (cell[:, 0] + cell[:, 2])[:, None])
                         / (2 * stride[:, None])), 0, size[:, None] - 1).astype(np.int64)
    y = np.clip(np.round(((g[:, 1] + g[:, 3])[None] - (cell[:, 1] + cell[:, 3])[:, None])
                         / (2 * stride[:, None])), 0, size[:, None] - 1).astype(np.int64)
    near = (base[:, None] + (y * size[:, None] + x) * n_a[:, None]).ravel()
    iou = bbox_overlaps_pairs(all_anchors[near], np.tile(gt, (len(base), 1))) * inside[near]
    return iou.reshape(len(base), len(gt)).max(axis=0).astype(np.float64)


def _candidate_pairs(tab: dict[str, np.ndarray], g: np.ndarray,
                     useful: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(anchor index, gt index) of every anchor of shape ``s`` that can touch gt ``j``,
    for the ``useful[s, j]`` combinations: the cells ``[x0, x1) x [y0, y1)`` of each
    rectangle (2-pixel margin) enumerated with ``repeat``/``divmod``, no loop over boxes."""
    base, stride, size, n_a, cell = tab["base"], tab["stride"], tab["size"], tab["n_a"], tab["cell"]
    hi, st = size[:, None], stride[:, None]
    x0 = np.clip(np.ceil((g[None, :, 0] - 2 - cell[:, 2:3]) / st), 0, hi).astype(np.int64)
    x1 = np.clip(np.floor((g[None, :, 2] + 2 - cell[:, 0:1]) / st) + 1, 0, hi).astype(np.int64)
    y0 = np.clip(np.ceil((g[None, :, 1] - 2 - cell[:, 3:4]) / st), 0, hi).astype(np.int64)
    y1 = np.clip(np.floor((g[None, :, 3] + 2 - cell[:, 1:2]) / st) + 1, 0, hi).astype(np.int64)
    wx = np.maximum(x1 - x0, 0).ravel()
    counts = wx * np.maximum(y1 - y0, 0).ravel() * useful.ravel()
    total = int(counts.sum())
    sg = np.repeat(np.arange(counts.size), counts)  # which (shape, gt) each pair is from
    dy, dx = np.divmod(np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts), wx[sg])
    si, n_g = sg // g.shape[0], g.shape[0]
    gidx = base[si] + ((y0.ravel()[sg] + dy) * size[si] + x0.ravel()[sg] + dx) * n_a[si]
    return gidx, sg % n_g


@functools.lru_cache(maxsize=16)
def _shape_table(keys: tuple[tuple[Any, ...], ...]) -> dict[str, np.ndarray]:
    """Per cell-anchor shape of the fields: index base, stride, F, A, cell box, area."""
    rows = []
    start = 0
    for k in keys:
        field, n_a, f = _field_array(*k)
        for a in range(n_a):
            c = field[a].astype(np.float64)
            rows.append((start + a, k[0], f, n_a, c, (c[2] - c[0] + 1.0) * (c[3] - c[1] + 1.0)))
        start += field.shape[0]
    return {"base": np.array([r[0] for r in rows], np.int64),
            "stride": np.array([r[1] for r in rows], np.float64),
            "size": np.array([r[2] for r in rows], np.int64),
            "n_a": np.array([r[3] for r in rows], np.int64),
            "cell": np.array([r[4] for r in rows], np.float64).reshape(-1, 4),
            "area": np.array([r[5] for r in rows], np.float64)}


def inside_mask(fields: Sequence[FieldOfAnchors], im_h: float, im_w: float,
                straddle: float) -> np.ndarray:
    """Bool mask over the concatenated fields of the anchors kept by the straddle test.

    ``x1 >= -t, y1 >= -t, x2 < W + t, y2 < H + t`` (Detectron semantics: RPN targets step 3; all
    anchors if
    ``t < 0``). An anchor's x coordinates depend only on its column and shape, its y
    coordinates only on its row, so the test is run on one row and one column of each
    field (the same float32 values) and combined as an outer product.
    """
    return _inside_mask(tuple(f.key for f in fields), float(im_h), float(im_w), float(straddle))


@functools.lru_cache(maxsize=32)
def _inside_mask(keys: tuple[tuple[Any, ...], ...], im_h: float, im_w: float,
                 t: float) -> np.ndarray:
    fields = [get_field_of_anchors(k[0], k[1], k[2], coarsest_stride=k[3], max_size=k[4])
              for k in keys]
    if t < 0:
        out = np.ones(sum(f.field_of_anchors.shape[0] for f in fields), dtype=bool)
        out.setflags(write=False)
        return out
    out = np.empty(sum(f.field_of_anchors.shape[0] for f in fields), dtype=bool)
    start = 0
    for f in fields:
        n_f, a = f.field_size, f.num_cell_anchors
        grid = f.field_of_anchors.reshape(n_f, n_f, a, 4)
        row, col = grid[0], grid[:, 0]  # (F, A, 4): x varies / y varies
        x_ok = (row[..., 0] >= -t) & (row[..., 2] < im_w + t)
        y_ok = (col[..., 1] >= -t) & (col[..., 3] < im_h + t)
        # out[y, x, a] = y_ok[y, a] & x_ok[x, a]. Coordinates grow with the index, so each
        # shape's kept columns (rows) are one contiguous run: the mask is a rectangle per
        # cell anchor, written as one slice on a cleared field.
        part = out[start:start + n_f * n_f * a].reshape(n_f, n_f, a)
        part.fill(False)
        for k in range(a):
            xs, ys = np.flatnonzero(x_ok[:, k]), np.flatnonzero(y_ok[:, k])
            if not (len(xs) and len(ys)):
                continue
            if xs[-1] - xs[0] + 1 == len(xs) and ys[-1] - ys[0] + 1 == len(ys):
                part[ys[0]:ys[-1] + 1, xs[0]:xs[-1] + 1, k] = True
            else:  # not a rectangle (cannot happen for a regular grid): the outer product
                part[:, :, k] = y_ok[:, k, None] & x_ok[None, :, k]
        start += n_f * n_f * a
    out.setflags(write=False)  # memoised: images of one size share it
    return out


def scaled_noncrowd_gt(entry: Any, scale: float, family: str,
                       what_detectron_does: str) -> tuple[np.ndarray, np.ndarray]:
    """The entry's non-crowd gt boxes in the scaled frame, and their row mask.

    RPN and RetinaNet label anchors against these (Detectron semantics: RPN targets step 2,
    Detectron semantics: RetinaNet targets). An image
    without one cannot be labelled; Detectron fails there (``what_detectron_does``),
    we raise a ``ValueError`` naming the image.
    """
    keep = (np.asarray(entry["gt_classes"]) > 0) & ~np.asarray(entry["is_crowd"], bool)
    if not keep.any():
        raise ValueError(
            f"{family} targets: image id {entry.get('id')} ({entry.get('image')}) has no "
            f"non-crowd gt box; {what_detectron_does}. Keep filter_for_training on, or "
            "drop images without annotations.")
    gt = (np.asarray(entry["boxes"])[keep] * scale).astype(np.float32)
    return gt, keep
