"""Anchors: Detectron's cell anchors and the fixed ``F x F`` field per stride (Detectron semantics:
minibatch primitives).

The RPN and RetinaNet target builders label a *field* of anchors that covers the
largest padded image any minibatch can hold, the same for every image, so the blobs
have fixed shapes (``(n, A, F, F)``, the "wide" blobs) and the network crops them to its
feature map. Fields are memoised per process and shared read-only by every call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from lit_roidata.boxes import bbox_overlaps, bbox_overlaps_pairs, bbox_transform_targets

__all__ = ["scaled_noncrowd_gt", "FieldOfAnchors", "generate_anchors", "field_size",
           "get_field_of_anchors", "rpn_fields", "retinanet_fields", "concat_fields",
           "level_offsets", "anchor_gt_overlaps", "inside_mask", "InsideAnchors",
           "inside_anchors", "rpn_overlaps", "build_anchor_caches", "anchor_targets", "stack_rows"]

Keys = tuple[tuple[Any, ...], ...]  # the memoisation keys of a list of fields


def generate_anchors(stride: float = 16, sizes: Sequence[float] = (32, 64, 128, 256, 512),
                     aspect_ratios: Sequence[float] = (0.5, 1, 2)) -> np.ndarray:
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
    w, h, cx, cy = _whctrs(_mkanchors(ws, hs, cx, cy).T)  # each ratio's window, then scaled
    n = len(scales)  # about its centre, ratio-major
    return _mkanchors((w[:, None] * scales).ravel(), (h[:, None] * scales).ravel(),
                      np.repeat(cx, n), np.repeat(cy, n))


def _whctrs(anchor: np.ndarray) -> tuple[Any, Any, Any, Any]:
    w = anchor[2] - anchor[0] + 1
    h = anchor[3] - anchor[1] + 1
    return w, h, anchor[0] + 0.5 * (w - 1), anchor[1] + 0.5 * (h - 1)


def _mkanchors(ws: np.ndarray, hs: np.ndarray, cx: Any, cy: Any) -> np.ndarray:
    return np.stack((cx - 0.5 * (ws - 1), cy - 0.5 * (hs - 1),
                     cx + 0.5 * (ws - 1), cy + 0.5 * (hs - 1)), axis=1)


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
    f = field_size(stride, coarsest_stride, max_size)
    shifts = np.arange(0, f) * stride
    shift_x, shift_y = (s.ravel() for s in np.meshgrid(shifts, shifts))
    shifts4 = np.stack((shift_x, shift_y, shift_x, shift_y), axis=1)  # (F*F, 4), x fastest
    field = (cell[None] + shifts4[:, None]).reshape((-1, 4)).astype(np.float32)
    field.setflags(write=False)
    return field, cell.shape[0], f


def get_field_of_anchors(stride: float, sizes: Sequence[float], aspect_ratios: Sequence[float],
                         *, coarsest_stride: int, max_size: int, octave: int | None = None,
                         aspect: int | None = None) -> FieldOfAnchors:
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
        k_min, start = cfg.FPN.RPN_MIN_LEVEL, cfg.FPN.RPN_ANCHOR_START_SIZE
        return [get_field_of_anchors(2.0 ** lvl, (start * 2.0 ** (lvl - k_min),),
                                     cfg.FPN.RPN_ASPECT_RATIOS, **kw)
                for lvl in range(k_min, cfg.FPN.RPN_MAX_LEVEL + 1)]
    return [get_field_of_anchors(cfg.RPN.STRIDE, cfg.RPN.SIZES, cfg.RPN.ASPECT_RATIOS, **kw)]


def retinanet_fields(cfg: Any) -> list[FieldOfAnchors]:
    """RetinaNet's fields in (level, octave, aspect) order, one anchor each (Detectron semantics:
    RetinaNet targets).

    Size ``2**l * 2**(octave / SCALES_PER_OCTAVE) * ANCHOR_SCALE``, ratio
    ``RETINANET.ASPECT_RATIOS[aspect]``.
    """
    r = cfg.RETINANET
    kw = dict(coarsest_stride=cfg.FPN.COARSEST_STRIDE, max_size=cfg.TRAIN.MAX_SIZE)
    per_octave = float(r.SCALES_PER_OCTAVE)
    strides = [2.0 ** lvl for lvl in range(cfg.FPN.RPN_MIN_LEVEL, cfg.FPN.RPN_MAX_LEVEL + 1)]
    return [get_field_of_anchors(st, (st * 2 ** (octave / per_octave) * r.ANCHOR_SCALE,), (ratio,),
                                 octave=octave, aspect=idx, **kw)
            for st in strides for octave in range(r.SCALES_PER_OCTAVE)
            for idx, ratio in enumerate(r.ASPECT_RATIOS)]


@functools.lru_cache(maxsize=16)
def _concat(keys: Keys) -> np.ndarray:
    arrays = [_field_array(*k)[0] for k in keys]
    out = np.concatenate(arrays) if arrays else np.zeros((0, 4), np.float32)
    out.setflags(write=False)
    return out


def build_anchor_caches(cfg: Any) -> None:
    """Build now the memoised anchor arrays that ``cfg``'s RPN or RetinaNet targets use
    (the fields, their concatenation and the per-shape tables: ~14 MB for FPN at
    ``MAX_SIZE`` 1333); a no-op for Fast R-CNN.

    Called in the main process before DataLoader workers fork, every worker shares one
    read-only copy instead of building its own.
    """
    from lit_roidata.minibatch.model_type import blob_family

    family = blob_family(cfg)
    if family in ("rpn", "retinanet"):
        fields = rpn_fields(cfg) if family == "rpn" else retinanet_fields(cfg)
        concat_fields(fields)
        _table(tuple(f.key for f in fields))


def concat_fields(fields: Sequence[FieldOfAnchors]) -> np.ndarray:
    """All anchors of ``fields`` concatenated in order (read-only, memoised)."""
    return _concat(tuple(f.key for f in fields))


def level_offsets(fields: Sequence[FieldOfAnchors]) -> np.ndarray:
    """Start index of each field in :func:`concat_fields`, plus the total at the end."""
    sizes = [f.field_of_anchors.shape[0] for f in fields]
    return np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)


def anchor_gt_overlaps(fields: Sequence[FieldOfAnchors], all_anchors: np.ndarray,
                       inside: np.ndarray, gt: np.ndarray, below: float = 0.0
                       ) -> tuple[np.ndarray, np.ndarray]:
    """IoU of the anchors of the bool mask ``inside`` (over ``all_anchors``) against ``gt``,
    without the dense ``K x G`` product: ``(cand, overlaps)``, the ascending indices of
    the anchors with a computed IoU and their ``(len(cand), G)`` float32 IoUs. Every
    non-zero IoU is computed (with :func:`~lit_roidata.boxes.iou_kernel`, bit for bit the
    dense matrix's entry); ``below`` is accepted for compatibility. The target builders
    use the tighter :func:`rpn_overlaps`.
    """
    cand, overlaps = rpn_overlaps(fields, all_anchors, inside_anchors(fields, 0, 0, -1.0), gt, 0.0)
    keep = np.asarray(inside, bool)[cand]
    return cand[keep], overlaps[keep]


@functools.lru_cache(maxsize=16)
def _table(keys: Keys) -> dict[str, np.ndarray]:
    """Per cell-anchor shape (field by field, ``a`` fastest): first index ``base``,
    ``stride``, F ``size``, A ``n_a``, ``field`` ordinal, the field's first index
    ``start``, ``a``, ``cell`` box and ``area``; its anchors' x1, x2 along the first grid
    row and y1, y2 down the first column (float32, concatenated, shape ``s`` from
    ``seg[s]``). Per field: ``fstart``, ``ff`` (F), ``fa`` (A), first global grid row
    ``row_off`` (the fields' rows one after the other); per global row: ``row_field``."""
    shapes, cells, per_field = [], [], []
    edges: dict[str, list[np.ndarray]] = {"x1": [], "x2": [], "y1": [], "y2": []}
    start = row = 0
    for fi, k in enumerate(keys):
        field, n_a, f = _field_array(*k)
        grid = field.reshape(f, f, n_a, 4)
        shapes += [(start + a, f, n_a, fi, start, a) for a in range(n_a)]
        cells.append(field[:n_a])  # the first cell's anchors; then each shape's edges, a-major
        for name, line in (("x1", grid[0, :, :, 0]), ("x2", grid[0, :, :, 2]),
                           ("y1", grid[:, 0, :, 1]), ("y2", grid[:, 0, :, 3])):
            edges[name].append(line.T.ravel())
        per_field.append((start, f, n_a, row))
        start += field.shape[0]
        row += f
    out = dict(zip(("base", "size", "n_a", "field", "start", "a"),
                   np.array(shapes, np.int64).reshape(-1, 6).T))
    out.update(zip(("fstart", "ff", "fa", "row_off"), np.array(per_field, np.int64).T))
    out.update({k: np.concatenate(v) for k, v in edges.items()})
    c = np.concatenate(cells).astype(np.float64)
    out.update(cell=c, area=(c[:, 2] - c[:, 0] + 1.0) * (c[:, 3] - c[:, 1] + 1.0),
               stride=np.array([keys[fi][0] for fi in out["field"]], np.float64),
               seg=np.concatenate(([0], np.cumsum(out["size"])[:-1])).astype(np.int64),
               row_field=np.repeat(np.arange(len(keys)), out["ff"]))
    return out


def inside_mask(fields: Sequence[FieldOfAnchors], im_h: float, im_w: float,
                straddle: float) -> np.ndarray:
    """Bool mask over the concatenated fields of the anchors kept by the straddle test
    ``x1 >= -t, y1 >= -t, x2 < W + t, y2 < H + t`` (Detectron semantics: RPN targets
    step 3; all anchors if ``t < 0``): the rectangles of :func:`inside_anchors`, written
    out (read-only, memoised)."""
    return _inside_mask(tuple(f.key for f in fields), float(im_h), float(im_w), float(straddle))


@functools.lru_cache(maxsize=32)
def _inside_mask(keys: Keys, im_h: float, im_w: float, t: float) -> np.ndarray:
    tab = _table(keys)
    out = np.zeros(len(_concat(keys)), dtype=bool)
    for (x0, x1, y0, y1), start, f, n_a, a in zip(_inside_anchors(keys, im_h, im_w, t).rects,
                                                 tab["start"], tab["size"], tab["n_a"], tab["a"]):
        out[start:start + f * f * n_a].reshape(f, f, n_a)[y0:y1, x0:x1, a] = True
    out.setflags(write=False)  # memoised: images of one size share it
    return out


@dataclass(frozen=True)
class InsideAnchors:
    """The anchors kept by the straddle test, as one rectangle of grid cells per cell-anchor
    shape: the set :func:`inside_mask` marks, without the K-long mask.

    An anchor's x coordinates grow with its column and its y coordinates with its row, so
    the straddle test keeps, per shape, the cells ``[x0, x1) x [y0, y1)``. Ranks and
    selections in the set's ascending index order are computed from the rectangles.

    Attributes:
        rects: int64 ``(shapes, 4)`` ``(x0, x1, y0, y1)`` per cell-anchor shape of the
            fields (field by field, ``a`` fastest); empty when ``x1 == x0`` or ``y1 == y0``.
        count: the number of inside anchors.
        key: the fields' memoisation keys.
        field_rects: ``rects`` by field and cell anchor ``(fields, max A, 4)``.
        field_counts: inside anchors in the fields before each field.
        row_starts: position of the first inside anchor of each grid row (the fields'
            rows one after the other), plus the total at the end.
    """

    rects: np.ndarray
    count: int
    key: Keys
    field_rects: np.ndarray
    field_counts: np.ndarray
    row_starts: np.ndarray

    def rank(self, idx: np.ndarray) -> np.ndarray:
        """Position of each inside anchor ``idx`` (indices into the concatenated fields) in
        the ascending list of inside anchors."""
        rows = _table(self.key)
        idx = np.asarray(idx, np.int64)
        f = np.searchsorted(rows["fstart"], idx, side="right") - 1
        cell, a = np.divmod(idx - rows["fstart"][f], rows["fa"][f])
        y, x = np.divmod(cell, rows["ff"][f])
        # (Q, A) each: the rectangles of the anchor's field
        x0, x1, y0, y1 = np.moveaxis(self.field_rects[f], -1, 0)
        wx = x1 - x0
        yc, xc = y[:, None], x[:, None]
        rows_before = (np.minimum(np.maximum(yc - y0, 0), y1 - y0) * wx).sum(axis=1)
        act = (y0 <= yc) & (yc < y1)
        in_row = (np.minimum(np.maximum(xc - x0, 0), wx) * act).sum(axis=1)
        in_cell = (act & (x0 <= xc) & (xc < x1) & (np.arange(x0.shape[1]) < a[:, None])).sum(axis=1)
        return self.field_counts[f] + rows_before + in_row + in_cell

    def select(self, pos: np.ndarray) -> np.ndarray:
        """The inside anchors at positions ``pos`` of the ascending list (the inverse of
        :meth:`rank`), in the order of ``pos``."""
        rows = _table(self.key)
        pos = np.asarray(pos, np.int64)
        if not len(pos):
            return np.zeros(0, np.int64)
        g = np.searchsorted(self.row_starts, pos, side="right") - 1
        f = rows["row_field"][g]
        y = g - rows["row_off"][f]
        off = pos - self.row_starts[g]
        x0, x1, y0, y1 = np.moveaxis(self.field_rects[f], -1, 0)  # (Q, A) each
        act = (y0 <= y[:, None]) & (y[:, None] < y1)
        wx = (x1 - x0) * act  # shapes not in this row contribute nothing
        # (anchors of the row left of column x) = sum_a clip(x - x0_a, 0, wx_a): piecewise
        # linear, the slope is the number of shapes whose run holds x. The column is
        # found from the last breakpoint b (a run's start or end) with count(b) <= off.
        bp = np.concatenate((x0, x0 + wx), axis=1)  # (Q, 2A)
        left = np.minimum(np.maximum(bp[:, :, None] - x0[:, None, :], 0),
                          wx[:, None, :]).sum(axis=2)
        b = np.where(left <= off[:, None], bp, -1).max(axis=1)
        in_run = (x0 <= b[:, None]) & (b[:, None] < x0 + wx)  # the same runs up to the column
        rest = off - np.minimum(np.maximum(b[:, None] - x0, 0), wx).sum(axis=1)
        n_run = in_run.sum(axis=1)
        lo, k = np.divmod(rest, n_run)
        lo += b
        a = (np.cumsum(in_run, axis=1) > k[:, None]).argmax(axis=1)
        return rows["fstart"][f] + (y * rows["ff"][f] + lo) * rows["fa"][f] + a


def inside_anchors(fields: Sequence[FieldOfAnchors], im_h: float, im_w: float,
                   straddle: float) -> InsideAnchors:
    """The anchors kept by the straddle test as rectangles (see :class:`InsideAnchors`):
    the same set as :func:`inside_mask`, computed on one row and one column per field."""
    return _inside_anchors(tuple(f.key for f in fields), float(im_h), float(im_w), float(straddle))


@functools.lru_cache(maxsize=256)
def _inside_anchors(keys: Keys, im_h: float, im_w: float, t: float) -> InsideAnchors:
    tab = _table(keys)
    if t < 0:
        r = np.stack([np.zeros_like(tab["size"]), tab["size"]] * 2, axis=1)
    else:
        # the comparisons of _inside_mask, on one row (column) of every shape; each is
        # monotone in the column (row), so the kept columns of a shape are one run: from
        # the number failing the lower test to the number passing the upper test
        x0, x1, y0, y1 = (np.add.reduceat(kept, tab["seg"], dtype=np.int64) for kept in (
            ~(tab["x1"] >= -t), tab["x2"] < im_w + t, ~(tab["y1"] >= -t), tab["y2"] < im_h + t))
        r = np.stack([x0, np.maximum(x1, x0), y0, np.maximum(y1, y0)], axis=1)
    field_rects = np.zeros((len(keys), int(tab["n_a"].max(initial=1)), 4), np.int64)
    field_rects[tab["field"], tab["a"]] = r
    x0, x1, y0, y1 = r.T
    area = (x1 - x0) * (y1 - y0)
    per_field = np.bincount(tab["field"], weights=area, minlength=len(keys)).astype(np.int64)
    n_rows = len(tab["row_field"])
    base = tab["row_off"][tab["field"]]
    wx = (x1 - x0).astype(np.float64)  # a shape's run adds wx anchors to rows y0 .. y1-1
    diff = (np.bincount(base + y0, weights=wx, minlength=n_rows + 1)
            - np.bincount(base + y1, weights=wx, minlength=n_rows + 1))
    per_row = np.cumsum(diff[:n_rows]).astype(np.int64)
    out = InsideAnchors(r, int(area.sum()), keys, field_rects,
                        np.concatenate(([0], np.cumsum(per_field)[:-1])),
                        np.concatenate(([0], np.cumsum(per_row))))
    for arr in (r, out.field_rects, out.field_counts, out.row_starts):
        arr.setflags(write=False)
    return out


def rpn_overlaps(fields: Sequence[FieldOfAnchors], all_anchors: np.ndarray, inside: InsideAnchors,
                 gt: np.ndarray, below: float) -> tuple[np.ndarray, np.ndarray]:
    """IoUs of inside anchors against gt boxes, only where they can reach a threshold or
    a gt's best match (RPN and RetinaNet labelling).

    Per gt ``g`` let ``t_g = min(below, L_g)``, ``L_g`` a lower bound of its best IoU
    (the inside anchor of each shape nearest the gt's centre). A pair with IoU >= ``t_g``
    has ``inter >= t_g / (1 + t_g) * (area_a + area_g)``, so per shape the anchors that
    can reach ``t_g`` form a rectangle of cells (1-pixel margin; ``t_g`` lowered by a
    relative 1e-4 against float32 rounding), intersected with the shape's inside
    rectangle. Every IoU >= ``t_g`` (so every anchor whose max IoU reaches ``below``, and
    every best match of every gt with its ties) is computed with
    :func:`~lit_roidata.boxes.iou_kernel`, bit for bit the dense matrix's entry; the
    others are left 0.

    Returns:
        ``(cand, overlaps)``: ascending indices of the anchors with a computed IoU, and
        their ``(len(cand), G)`` float32 IoUs.
    """
    tab = _table(inside.key)
    g = gt.astype(np.float64)
    n_g = g.shape[0]
    rx0, rx1, ry0, ry1 = (c[:, None] for c in inside.rects.T)
    cell, st = tab["cell"], tab["stride"][:, None]
    # lower bound of each gt's best IoU: the inside anchor of each shape nearest its centre
    nonempty = (rx1 > rx0) & (ry1 > ry0)  # (S, 1)
    n_a, size = tab["n_a"][:, None], tab["size"][:, None]
    hx = np.minimum(np.maximum(rx1 - 1, rx0), size - 1)  # (an empty rectangle: any cell)
    hy = np.minimum(np.maximum(ry1 - 1, ry0), size - 1)
    x, y = (np.clip(np.round(((g[:, k] + g[:, k + 2])[None]
                              - (cell[:, k] + cell[:, k + 2])[:, None]) / (2 * st)), lo, hi)
            .astype(np.int64) for k, lo, hi in ((0, rx0, hx), (1, ry0, hy)))
    near = (tab["base"][:, None] + (y * size + x) * n_a).ravel()
    iou = bbox_overlaps_pairs(all_anchors[near], np.tile(gt, (len(cell), 1)))
    lower = (iou.reshape(len(cell), n_g) * nonempty).max(axis=0).astype(np.float64)
    # slack: float32 anchor coordinates make an anchor's area differ from its cell's by
    # ~1e-7 of its coordinates, and the IoU is rounded to float32
    t = np.maximum(np.minimum(lower, below), 0.0) / (1 + 1e-4)  # (G,)
    g_w, g_h = g[:, 2] - g[:, 0] + 1.0, g[:, 3] - g[:, 1] + 1.0
    a_w, a_h = (cell[:, 2] - cell[:, 0] + 1.0)[:, None], (cell[:, 3] - cell[:, 1] + 1.0)[:, None]
    a_area, g_area = tab["area"][:, None], (g_w * g_h)[None]
    useful = np.minimum(a_area, g_area) >= t * np.maximum(a_area, g_area)  # (S, G)
    inter = t / (1 + t) * (a_area + g_area)
    # (a degenerate gt, height or width <= 0, has IoU 0 with every anchor: huge bounds)
    iw = inter / np.maximum(np.minimum(a_h, g_h[None]), 1e-6)
    ih = inter / np.maximum(np.minimum(a_w, g_w[None]), 1e-6)
    x0 = np.clip(np.ceil((g[None, :, 0] + iw - 2 - cell[:, 2:3]) / st), rx0, rx1)
    x1 = np.clip(np.floor((g[None, :, 2] - iw + 2 - cell[:, 0:1]) / st) + 1, rx0, rx1)
    y0 = np.clip(np.ceil((g[None, :, 1] + ih - 2 - cell[:, 3:4]) / st), ry0, ry1)
    y1 = np.clip(np.floor((g[None, :, 3] - ih + 2 - cell[:, 1:2]) / st) + 1, ry0, ry1)
    # (anchor, gt) of every cell of the (shape, gt) rectangles [x0, x1) x [y0, y1) where
    # useful, enumerated with repeat/divmod, no loop over boxes
    x0, x1, y0, y1 = (v.astype(np.int64).ravel() for v in (x0, x1, y0, y1))
    wx = np.maximum(x1 - x0, 0)
    counts = wx * np.maximum(y1 - y0, 0) * useful.ravel()
    sg = np.repeat(np.arange(counts.size), counts)  # which (shape, gt) each pair is from
    dy, dx = np.divmod(np.arange(len(sg)) - np.repeat(np.cumsum(counts) - counts, counts), wx[sg])
    si, gid = np.divmod(sg, n_g)
    gidx = tab["base"][si] + ((y0[sg] + dy) * tab["size"][si] + x0[sg] + dx) * tab["n_a"][si]
    iou = bbox_overlaps_pairs(all_anchors[gidx], gt[gid])
    cand, row = np.unique(gidx, return_inverse=True)
    overlaps = np.zeros((len(cand), n_g), dtype=np.float32)
    overlaps[row, gid] = iou
    return cand, overlaps


def anchor_targets(anchors: np.ndarray, gt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each anchor's gt (the exact dense argmax, ties to the lowest gt) and its regression
    targets with unit weights: the positives of RPN and RetinaNet."""
    assigned = bbox_overlaps(anchors, gt).argmax(axis=1) if len(anchors) else np.zeros(0, np.int64)
    return assigned, bbox_transform_targets(anchors, gt[assigned], (1.0, 1.0, 1.0, 1.0))


def stack_rows(parts: Sequence[np.ndarray], width: int, dtype: Any) -> np.ndarray:
    """The per-image row blocks ``parts`` concatenated as ``dtype`` (``(0, width)`` if none)."""
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros((0, width), dtype)


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
    return (np.asarray(entry["boxes"])[keep] * scale).astype(np.float32), keep
