"""JSON arrays of numbers, as raw text, → NumPy columns without a Python object per number.

The typed decoder (:mod:`lit_roidata.roidb.decode`) keeps every annotation's
``segmentation`` and ``keypoints`` as :class:`msgspec.Raw` (msgspec checks the JSON
syntax and skips the value without building objects). :func:`parse_number_lists` then
works on the concatenated text of all of them at once:

* the structure (which list each number belongs to, how many numbers per list) comes
  from the positions of brackets and number tokens, found with NumPy on the bytes;
* each number token of up to 8 characters (sign aside) made of digits and at most one
  ``.`` (COCO's ``239.97``, ``0``, ``-1.5``) is converted with SWAR arithmetic on one
  64-bit word per token: its digits give an integer mantissa ``m < 10**8`` and the value
  is ``m / 10**f`` (``f`` = digits after the point). Both are exactly representable
  doubles, so the one IEEE division is correctly rounded (Clinger's fast path): the
  same double as any correctly rounding parser, msgspec's included;
* every other token (exponents, more digits) is decoded by msgspec itself, with the
  element type the typed decoder used before, so its value is msgspec's by construction.

Anything that is not a well-formed list (of lists) of numbers returns ``None``: the
caller then falls back to the generic decoder, which names the record and the fix.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Optional, Sequence

import msgspec
import numpy as np

__all__ = ["parse_number_lists"]

# byte classes (the texts are valid JSON: msgspec checked them, numbers included)
_OTHER, _NUM, _EXP, _SEP, _OPEN, _CLOSE = 0, 1, 2, 3, 4, 5
_CLASS = np.zeros(256, np.uint8)
_CLASS[np.frombuffer(b"0123456789+-.", np.uint8)] = _NUM
_CLASS[np.frombuffer(b"eE", np.uint8)] = _EXP
_CLASS[np.frombuffer(b", \t\n\r", np.uint8)] = _SEP
_CLASS[ord("[")] = _OPEN
_CLASS[ord("]")] = _CLOSE

_U = np.uint64
_LEAD = 8  # zero bytes before the text: the 8 bytes ending at any token end are readable
_BLOCK = 1 << 20  # bytes per block: the temporaries stay small and in cache
_ASCII0 = _U(0x3030303030303030)  # xor: ASCII digits → their values 0..9, '.' → 0x1E
# right-aligned word of a token (its last character in the highest byte): keep its m
# characters; the bytes before them become 0 (leading zeros)
_KEEP = np.array([~((1 << (8 * (8 - m))) - 1) & (2 ** 64 - 1) for m in range(9)], _U)
# the decimal point at byte q (r = q + 1; r = 0: no point): the bytes below it move up
# one byte, over the point; byte 0 becomes a leading 0
_ABOVE = np.array([2 ** 64 - 1] + [~((1 << (8 * r)) - 1) & (2 ** 64 - 1)
                                   for r in range(1, 9)], _U)
_BELOW = np.array([0] + [((1 << (8 * (r - 1))) - 1) << 8 for r in range(1, 9)], _U)
# divisor 10 ** (digits after the point) by r, then the same negated (a negative number):
# exact doubles, and x / -d == -(x / d) exactly
_DIV = np.array([1.0] + [10.0 ** (8 - r) for r in range(1, 9)], np.float64)
_DIV = np.concatenate([_DIV, -_DIV])
_DOTS, _LOW7, _HIGH1 = _U(0x1E1E1E1E1E1E1E1E), _U(0x7F7F7F7F7F7F7F7F), _U(0x8080808080808080)
_R_OF_Q = _U(0x0102030405060708)  # byte j holds 8 - j: (bit 8q) * this >> 56 == q + 1
_OVER9 = _U(0x7676767676767676)  # byte + 0x76 has bit 7 set iff byte > 9
_MASK8, _MUL1, _MUL2 = _U(0x000000FF000000FF), _U(100 + (1000000 << 32)), _U(1 + (10000 << 32))
_S7, _S8, _S16, _S32, _S56 = (_U(k) for k in (7, 8, 16, 32, 56))
_TEN = _U(10)


def _fast_numbers(buf: np.ndarray, words: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                  check_digits: bool) -> tuple[np.ndarray, np.ndarray]:
    """Values of the tokens ``-?digits[.digits]`` of at most 8 characters (sign aside);
    ``(values, ok)``, ``ok`` False for the tokens left to msgspec.

    ``words[i]`` is the little-endian word of ``buf[i:i + 8]``; ``check_digits``: the
    tokens may hold an exponent (``e``/``E``), which sends them to msgspec.
    """
    neg = buf.take(starts) == 45  # '-'
    m = ends - starts - neg
    ok = m <= 8
    np.minimum(m, 8, out=m)
    w = (words[ends - 8] ^ _ASCII0) & _KEEP.take(m)  # (take() would copy words)
    # the point (now 0x1E): SWAR zero-byte search on w ^ 0x1E.. (exact), byte q → r = q + 1
    x = w ^ _DOTS
    z = ~(((x & _LOW7) + _LOW7) | x) & _HIGH1
    r = (((z >> _S7) * _R_OF_Q) >> _S56).astype(np.intp)
    w = (w & _ABOVE.take(r)) | ((w << _S8) & _BELOW.take(r))
    if check_digits:  # every byte a digit (0..9): no exponent, no second sign
        ok &= ((w | (w + _OVER9)) & _HIGH1) == 0
    # eight digits → integer (simdjson's parse_eight_digits_unrolled)
    w = (w * _TEN) + (w >> _S8)
    w = (((w & _MASK8) * _MUL1) + (((w >> _S16) & _MASK8) * _MUL2)) >> _S32
    # msgspec (and orjson) read the integer token "-0" as the integer 0, i.e. +0.0
    neg &= (r != 0) | (w != 0)
    r += 9 * neg
    return w.astype(np.float64) / _DIV.take(r), ok


def _block_end(cls_of: np.ndarray, buf: np.ndarray, end: int, size: int) -> int:
    """Move a block end forward until the byte before it is not part of a number."""
    while end < size and cls_of[buf[_LEAD + end - 1]] <= _EXP:
        end += 1
    return end


def parse_number_lists(raws: Sequence[Any], *, nested: bool, slow_type: Any
                       ) -> Optional[tuple[np.ndarray, Optional[np.ndarray], np.ndarray]]:
    """Parse JSON texts that are each a list of numbers (or, ``nested``, of lists of numbers).

    Args:
        raws: the JSON texts (bytes-like, e.g. :class:`msgspec.Raw`), each starting with
            ``[`` and valid JSON (msgspec checked the syntax while decoding).
        nested: ``[[x, ...], ...]`` (polygons) instead of ``[x, ...]`` (keypoints).
        slow_type: the msgspec type of a list of the tokens the fast path leaves
            (``list[float]``, or ``list[Union[int, float]]``): their values are exactly
            msgspec's for that type, converted with ``np.fromiter``.

    Returns:
        ``(outer_n, inner_n, values)``: int64 number of elements per text (inner lists
        when ``nested``, else numbers), int64 numbers per inner list (``None`` when not
        nested), float64 values in text order; ``None`` if a text is not of that shape
        or holds a number msgspec refuses.
    """
    text = b"".join(chain((bytes(_LEAD),), raws, (bytes(8),)))  # one copy, zero-padded
    size = len(text) - _LEAD - 8
    buf = np.frombuffer(text, np.uint8)
    words = np.ndarray((buf.size - 7,), _U, text, 0, (1,))
    vals, br, before, slow = [], [], [], []
    ntok = 0
    pos = 0
    while pos < size:
        end = _block_end(_CLASS, buf, min(pos + _BLOCK, size), size)
        cls = _CLASS[buf[_LEAD + pos:_LEAD + end]]
        if cls.min() == _OTHER:
            return None  # strings, objects, true/false/null: not a list of numbers
        isnum = np.zeros(cls.size + 2, bool)
        np.less_equal(cls, _EXP, out=isnum[1:-1])
        edges = np.flatnonzero(isnum[1:] != isnum[:-1])
        starts = edges[0::2] + (_LEAD + pos)
        ends = edges[1::2] + (_LEAD + pos)
        v, ok = _fast_numbers(buf, words, starts, ends, bool((cls == _EXP).any()))
        vals.append(v)
        if not ok.all():
            bad = np.flatnonzero(~ok)
            slow.append((bad + ntok, starts[bad] - _LEAD, ends[bad] - _LEAD))
        b = np.flatnonzero(cls >= _OPEN)
        br.append(cls[b] == _OPEN)
        before.append(np.searchsorted(starts, b + (_LEAD + pos)) + ntok)
        ntok += starts.size
        pos = end
    if not vals:
        values = np.zeros(0, np.float64)
        opening = np.zeros(0, bool)
        before_all = np.zeros(0, np.int64)
    else:
        values = np.concatenate(vals) if len(vals) > 1 else vals[0]
        opening = np.concatenate(br)
        before_all = np.concatenate(before)
    if slow and not _slow_numbers(text, values, slow, slow_type):
        return None
    depth = np.cumsum(np.where(opening, 1, -1))  # depth after each bracket
    want = 2 if nested else 1
    if depth.size and depth.max() > want:
        return None
    # the tokens between bracket j and j + 1 sit at depth[j]: all at the wanted depth
    between = np.diff(np.append(before_all, ntok))
    if (between[depth != want] != 0).any():
        return None
    top = opening & (depth == 1)
    if int(top.sum()) != len(raws):
        return None
    if not nested:
        return between[top].astype(np.int64), None, values
    inner = opening & (depth == 2)
    # inner lists per text: inner openings between consecutive top-level openings
    n_inner = np.cumsum(inner)
    at_top = n_inner[top] - inner[top]
    outer_n = np.diff(np.append(at_top, n_inner[-1] if n_inner.size else 0))
    return outer_n.astype(np.int64), between[inner].astype(np.int64), values


def _slow_numbers(text: bytes, values: np.ndarray, slow: list, slow_type: Any) -> bool:
    """Decode the tokens the fast path left with msgspec into ``values``; False if refused."""
    idx = np.concatenate([s[0] for s in slow])
    a = np.concatenate([s[1] for s in slow]).tolist()
    b = np.concatenate([s[2] for s in slow]).tolist()
    toks = [text[i + _LEAD:j + _LEAD] for i, j in zip(a, b)]
    try:
        got = msgspec.json.decode(b"[" + b",".join(toks) + b"]", type=slow_type)
        values[idx] = np.fromiter(got, np.float64, len(got))
    except (msgspec.ValidationError, msgspec.DecodeError, OverflowError):
        return False  # out of range (1e400); OverflowError: an integer beyond a double
    return True
