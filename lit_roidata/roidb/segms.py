"""Columnar storage of COCO segmentations, and their (flipped) view per entry.

Polygons are stored as one flat float64 coordinate array with two offset levels
(object → polygons → coordinates); RLEs keep their JSON representation (uncompressed
integer counts or the compressed string) so an entry returns exactly what the JSON held.
Flipping happens on access (Detectron semantics: flipping): polygons ``x' = W - x - 1``;
RLE masks are decoded with ``pycocotools.mask``, mirrored column-wise and re-encoded in
the same representation. Detectron crashes on compressed RLE here (Detectron quirk Q12,
docs/detectron_quirks.md); we do not.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from itertools import chain
from typing import Any, Sequence

import numpy as np

__all__ = ["SegmColumns", "decode_segms", "POLY", "RLE_LIST", "RLE_STR", "offsets",
           "concat", "concat_offsets", "rle_columns", "rle_string_counts", "take_ranges"]

POLY, RLE_LIST, RLE_STR = 0, 1, 2


@dataclass
class SegmColumns:
    """Segmentations of ``G`` gt rows as flat arrays (see module docstring)."""

    kind: np.ndarray        # int8 (G,)  POLY / RLE_LIST / RLE_STR
    poly_off: np.ndarray    # int64 (G+1,) polygon range per row
    coord_off: np.ndarray   # int64 (NP+1,) coordinate range per polygon
    coords: np.ndarray      # float64 (NC,)
    rle_idx: np.ndarray     # int32 (G,) row → RLE index, -1 for polygons
    rle_size: np.ndarray    # int64 (NR, 2) (h, w)
    rle_int_off: np.ndarray  # int64 (NR+1,) into rle_ints (RLE_LIST)
    rle_ints: np.ndarray    # int64
    rle_str_off: np.ndarray  # int64 (NR+1,) into rle_bytes (RLE_STR)
    rle_bytes: np.ndarray   # uint8

    FIELDS = ("kind", "poly_off", "coord_off", "coords", "rle_idx", "rle_size",
              "rle_int_off", "rle_ints", "rle_str_off", "rle_bytes")

    def arrays(self, prefix: str = "segm_") -> dict[str, np.ndarray]:
        """The columns keyed by ``prefix + field`` (for the cache)."""
        return {prefix + f: getattr(self, f) for f in self.FIELDS}

    @classmethod
    def from_arrays(cls, arrays: Any, prefix: str = "segm_") -> "SegmColumns":
        """Inverse of :meth:`arrays` (``arrays`` may hold memory maps)."""
        return cls(**{f: arrays[prefix + f] for f in cls.FIELDS})

    @staticmethod
    def concat(parts: Sequence["SegmColumns"]) -> "SegmColumns":
        """Concatenate the segms of several tables, rebasing offsets."""
        if len(parts) == 1:
            return parts[0]
        cat = np.concatenate
        rle_base = np.cumsum([0] + [len(p.rle_size) for p in parts[:-1]]).tolist()
        return SegmColumns(
            cat([p.kind for p in parts]).astype(np.int8),
            concat_offsets([p.poly_off for p in parts]),
            concat_offsets([p.coord_off for p in parts]), cat([p.coords for p in parts]),
            cat([np.where(p.rle_idx >= 0, p.rle_idx + n, -1).astype(np.int32)
                 for p, n in zip(parts, rle_base)]),
            cat([p.rle_size for p in parts]).reshape(-1, 2),
            concat_offsets([p.rle_int_off for p in parts]), cat([p.rle_ints for p in parts]),
            concat_offsets([p.rle_str_off for p in parts]),
            cat([p.rle_bytes for p in parts]).astype(np.uint8))


def rle_columns(rows: Sequence[int], rles: Sequence[tuple[int, int, Any]], kind: np.ndarray,
                rle_idx: np.ndarray) -> dict[str, np.ndarray]:
    """The ``rle_*`` columns of :class:`SegmColumns` for the RLE segmentations ``rles``
    (``(h, w, counts)``, counts a list of ints or ASCII bytes) of gt rows ``rows``; marks
    those rows in ``kind`` (``RLE_LIST`` / ``RLE_STR``) and ``rle_idx`` in place."""
    ints: list = []
    strs: list[bytes] = []
    for r, (_, _, counts) in zip(rows, rles):
        rle_idx[r], is_list = len(ints), isinstance(counts, list)
        kind[r] = RLE_LIST if is_list else RLE_STR
        ints.append(counts if is_list else ())
        strs.append(b"" if is_list else counts)
    return dict(rle_size=np.asarray([(h, w) for h, w, _ in rles], np.int64).reshape(-1, 2),
                rle_int_off=offsets(np.fromiter(map(len, ints), np.int64, len(ints))),
                rle_ints=np.fromiter(chain.from_iterable(ints), np.int64, sum(map(len, ints))),
                rle_str_off=offsets(np.fromiter(map(len, strs), np.int64, len(strs))),
                rle_bytes=np.frombuffer(b"".join(strs), np.uint8).copy())


def offsets(counts: np.ndarray) -> np.ndarray:
    """int64 ``(n+1,)`` start offsets of ``n`` consecutive runs of ``counts`` items (the
    last one is the total)."""
    out = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def concat(arrays: Sequence[np.ndarray], dtype: Any = None) -> np.ndarray:
    """``np.concatenate`` that does not copy a single array (columns can be GBs); an
    empty ``dtype`` array for none."""
    if not arrays:
        return np.zeros(0, dtype)
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def concat_offsets(offs: Sequence[np.ndarray]) -> np.ndarray:
    """One offset array for the concatenation of the columns each of ``offs`` indexes."""
    out, base = [np.zeros(1, np.int64)], 0
    for o in offs:
        out.append(np.asarray(o[1:], np.int64) + base)
        base += int(o[-1])
    return np.concatenate(out)


def decode_segms(cols: SegmColumns, g0: int, g1: int, *, flipped: bool = False,
                 width: int = 0, height: int = 0) -> list:
    """Segms of gt rows ``g0:g1`` as Detectron's entry holds them (Detectron semantics: roidb
    building; flipping).

    Returns:
        One item per row: a list of polygons (lists of floats) or an RLE dict
        ``{"size": [h, w], "counts": list | str}``; mirrored if ``flipped``.
    """
    out: list = []
    if g1 <= g0:
        return out
    kind = np.asarray(cols.kind[g0:g1])
    poly_off = np.asarray(cols.poly_off[g0:g1 + 1])
    p0, p1 = int(poly_off[0]), int(poly_off[-1])
    coord_off = np.asarray(cols.coord_off[p0:p1 + 1])
    c0 = int(coord_off[0])
    coords = np.array(cols.coords[c0:int(coord_off[-1])], dtype=np.float64)
    if flipped and coords.size:
        # even positions within each polygon are x
        xs = (np.arange(coords.size) - np.repeat(coord_off[:-1] - c0, np.diff(coord_off))) % 2 == 0
        coords[xs] = width - coords[xs] - 1
    flat = coords.tolist()
    bounds = (coord_off - c0).tolist()
    for j in range(g1 - g0):
        if kind[j] == POLY:
            a, b = int(poly_off[j]) - p0, int(poly_off[j + 1]) - p0
            out.append([flat[bounds[k]:bounds[k + 1]] for k in range(a, b)])
        else:
            out.append(_rle(cols, int(cols.rle_idx[g0 + j]), int(kind[j]), flipped))
    return out


def _rle(cols: SegmColumns, r: int, kind: int, flipped: bool) -> dict:
    if kind == RLE_LIST:
        ints = cols.rle_ints[cols.rle_int_off[r]:cols.rle_int_off[r + 1]]
        counts: Any = np.asarray(ints).tolist()
    else:
        counts = bytes(np.asarray(cols.rle_bytes[cols.rle_str_off[r]:cols.rle_str_off[r + 1]])
                       ).decode("ascii")
    rle = {"size": [int(v) for v in cols.rle_size[r]], "counts": counts}
    return flip_rle(rle) if flipped else rle


def flip_rle(rle: dict) -> dict:
    """Mirror an RLE mask column-wise, keeping its representation (Detectron semantics: flipping,
    Detectron quirk Q12 (docs/detectron_quirks.md))."""
    from pycocotools import mask as mask_util

    h, w = (int(v) for v in rle["size"])
    counts = rle["counts"]
    with warnings.catch_warnings():  # pycocotools' NumPy 2 copy= deprecation
        warnings.simplefilter("ignore", DeprecationWarning)
        m = mask_util.decode(mask_util.frPyObjects(rle, h, w) if isinstance(counts, list) else
                             {"size": [h, w], "counts": counts.encode("ascii")
                              if isinstance(counts, str) else counts})
    m = np.asfortranarray(m[:, ::-1])
    if isinstance(counts, list):
        return {"size": [h, w], "counts": mask_to_uncompressed_counts(m)}
    enc = mask_util.encode(m)["counts"]
    return {"size": [h, w], "counts": enc.decode("ascii") if isinstance(counts, str) else enc}


def mask_to_uncompressed_counts(mask: np.ndarray) -> list[int]:
    """COCO uncompressed RLE counts (column-major runs, starting with zeros)."""
    flat = np.asarray(mask, dtype=np.uint8).ravel(order="F")
    if flat.size == 0:
        return []
    change = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    runs = np.diff(np.concatenate([[0], change, [flat.size]])).tolist()
    return ([0] + runs) if flat[0] else runs


def take_ranges(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + l)`` for every ``(s, l)`` pair, vectorised."""
    starts = np.asarray(starts, np.int64)
    lens = np.asarray(lens, np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    first = np.cumsum(lens) - lens
    return np.arange(total, dtype=np.int64) + np.repeat(starts - first, lens)


def rle_string_counts(strs: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode COCO compressed RLE strings to their run lengths, all strings at once.

    The format of pycocotools' ``rleFrString``: characters ``'0'..'o'`` carry 5 bits
    each plus a continuation bit, the last chunk of a value is sign-extended, and from
    the fourth value on each value is a delta to the value two places before.

    Returns:
        ``(counts, off, bad)``: int64 run lengths, int64 (n+1,) offsets per string, and
        bool per string: a character outside ``'0'..'o'``, a truncated value, a value
        over 32 bits or a negative run (such a string's counts are meaningless).
    """
    n = len(strs)
    lens = np.fromiter(map(len, strs), np.int64, n)
    soff = offsets(lens)
    v = np.frombuffer(b"".join(strs), np.uint8).astype(np.int64) - 48
    owner = np.repeat(np.arange(n), lens)
    bad = np.zeros(n, bool)
    np.logical_or.at(bad, owner[(v < 0) | (v > 63)], True)
    more = (v & 0x20) != 0
    last = soff[1:][lens > 0] - 1
    bad[np.flatnonzero(lens > 0)[more[last]]] = True
    if bad.any():  # decode only the well-formed strings
        ok = [s for s, b in zip(strs, bad.tolist()) if not b]
        c_ok, off_ok, bad_ok = rle_string_counts(ok)
        per = np.zeros(n, np.int64)
        per[~bad] = np.diff(off_ok)
        off = offsets(per)
        bad[np.flatnonzero(~bad)[bad_ok]] = True
        return c_ok, off, bad
    if v.size == 0:
        return np.zeros(0, np.int64), np.zeros(n + 1, np.int64), bad
    tok_end = np.flatnonzero(~more)
    tok_start = np.concatenate([[0], tok_end[:-1] + 1]).astype(np.int64)
    klen = tok_end - tok_start + 1
    # v is not empty and every string ends a value (checked above): tokens exist
    tok_str = owner[tok_start]
    np.logical_or.at(bad, tok_str[klen > 7], True)
    k = np.arange(v.size, dtype=np.int64) - np.repeat(tok_start, klen)
    x = np.add.reduceat((v & 0x1F) << (5 * np.minimum(k, 6)), tok_start)
    neg = (v[tok_end] & 0x10) != 0
    x = np.where(neg, x - (np.int64(1) << (5 * np.minimum(klen, 7))), x)
    ntok = np.bincount(tok_str, minlength=n).astype(np.int64)
    off = offsets(ntok)
    m = np.arange(x.size, dtype=np.int64) - off[:-1][tok_str]
    chain_ = np.where(m == 0, 0, np.where(m % 2 == 1, 1, 2))
    key = tok_str * 3 + chain_
    order = np.argsort(key, kind="stable")
    xs = x[order]
    cs = np.cumsum(xs)
    ks = key[order]
    first = np.ones(ks.size, bool)
    first[1:] = ks[1:] != ks[:-1]
    base = np.maximum.accumulate(np.where(first, np.arange(ks.size), 0))
    before = np.concatenate([[0], cs])[base]
    c = np.empty_like(x)
    c[order] = cs - before
    np.logical_or.at(bad, tok_str[(c < 0) | (c >= 2 ** 32)], True)
    return c, off, bad
