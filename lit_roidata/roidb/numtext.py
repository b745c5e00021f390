"""JSON lists of numbers, as raw text, → NumPy columns without a Python object per number."""

from __future__ import annotations

from itertools import chain
from typing import Any, Optional, Sequence

import msgspec
import numpy as np

__all__ = ["parse_number_lists"]

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
                  has_dot: bool, has_neg: bool, has_exp: bool
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Values of the tokens ``-?digits[.digits]`` of at most 8 characters (sign aside);
    ``(values, ok)``, ``ok`` False for the tokens left to msgspec."""
    m = ends - starts
    if has_neg:
        neg = buf.take(starts) == 45  # '-'
        m -= neg
    ok = m <= 8
    np.minimum(m, 8, out=m)
    w = (words[ends - 8] ^ _ASCII0) & _KEEP.take(m)
    if has_dot:
        # the point (now 0x1E): SWAR zero-byte search on w ^ 0x1E.. (exact), byte q → r
        x = w ^ _DOTS
        z = ~(((x & _LOW7) + _LOW7) | x) & _HIGH1
        r = (((z >> _S7) * _R_OF_Q) >> _S56).astype(np.intp)
        w = (w & _ABOVE.take(r)) | ((w << _S8) & _BELOW.take(r))
    if has_exp:  # every byte a digit (0..9): no exponent, no second sign
        ok &= ((w | (w + _OVER9)) & _HIGH1) == 0
    # eight digits → integer (simdjson's parse_eight_digits_unrolled)
    w = (w * _TEN) + (w >> _S8)
    w = (((w & _MASK8) * _MUL1) + (((w >> _S16) & _MASK8) * _MUL2)) >> _S32
    if not (has_dot or has_neg):
        return w.astype(np.float64), ok
    if has_neg:
        # msgspec (and orjson) read the integer token "-0" as the integer 0, i.e. +0.0
        neg &= ((r != 0) | (w != 0)) if has_dot else (w != 0)
        r = (r + 9 * neg) if has_dot else 9 * neg
    return w.astype(np.float64) / _DIV.take(r), ok


#: bytes that end a number in valid JSON (outside strings)
_SEPARATORS = frozenset(b",[]{}: \t\n\r\"")


def parse_number_lists(raws: Sequence[Any], *, slow_type: Any
                       ) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """Parse JSON texts that are each a list of numbers, all at once.

    Args:
        raws: the JSON texts (bytes-like, e.g. :class:`msgspec.Raw`), each valid JSON
            (msgspec checked the syntax while decoding).
        slow_type: the msgspec type of a list of the tokens the fast path leaves
            (``list[float]``, or ``list[Union[int, float]]``): their values are exactly
            msgspec's for that type, converted with ``np.fromiter``.

    Returns:
        ``(counts, values)``: int64 numbers per text, float64 values in text order;
        ``None`` if a text is not a list of numbers or holds a number msgspec refuses.
    """
    # one copy: the texts separated by spaces (so no two tokens merge), between zero bytes
    text = b" ".join(chain((bytes(_LEAD - 1),), raws, (bytes(7),)))
    size = len(text) - _LEAD - 8
    buf = np.frombuffer(text, np.uint8)
    words = np.ndarray((buf.size - 7,), _U, text, 0, (1,))
    # at most one number more than commas per list (a wrong text is refused below)
    values = np.empty(text.count(b",") + len(raws), np.float64)
    brackets, before, slow = [], [], []
    ntok = pos = 0
    while pos < size:
        end = min(pos + _BLOCK, size)
        while end < size and buf[_LEAD + end - 1] not in _SEPARATORS:  # not within a number
            end += 1
        c = buf[_LEAD + pos:_LEAD + end]
        # outside strings valid JSON holds whitespace, , [ ] { } :, numbers (digits + - .
        # e E) and the literals true/false/null: a '"', '{' or a lowercase letter other
        # than 'e' means something else than numbers (uppercase: only 'E' is valid)
        high = c >= 0x60
        has_exp = bool(high.any())
        if has_exp:
            if (high & (c != 0x65)).any():
                return None
        else:
            has_exp = bool((c == 0x45).any())
        if (c == 0x22).any():
            return None
        isnum = np.zeros(c.size + 2, bool)
        # + , - . / 0-9 (no '/' outside strings), not ','; and e/E
        np.logical_and((c - np.uint8(0x2B)) <= 14, c != 0x2C, out=isnum[1:-1])
        if has_exp:
            isnum[1:-1] |= (c | np.uint8(0x20)) == 0x65
        edges = np.flatnonzero(isnum[1:] != isnum[:-1])
        starts = edges[0::2] + (_LEAD + pos)
        ends = edges[1::2] + (_LEAD + pos)
        if ntok + starts.size > values.size:
            return None  # more numbers than lists of numbers can hold: not such lists
        values[ntok:ntok + starts.size], ok = _fast_numbers(
            buf, words, starts, ends, bool((c == 0x2E).any()), bool((c == 0x2D).any()),
            has_exp)
        if not ok.all():
            bad = np.flatnonzero(~ok)
            slow.append((bad + ntok, starts[bad], ends[bad]))
        b = np.flatnonzero((c | np.uint8(6)) == 0x5F)  # '[' 0x5B, ']' 0x5D
        brackets.append(c[b] == 0x5B)
        before.append(np.searchsorted(starts, b + (_LEAD + pos)) + ntok)
        ntok += starts.size
        pos = end
    values = values[:ntok]
    if slow and not _slow_numbers(text, values, slow, slow_type):
        return None
    opening = np.concatenate(brackets) if brackets else np.zeros(0, bool)
    before_all = np.concatenate(before) if before else np.zeros(0, np.int64)
    # each text one flat list: brackets alternate [ ] [ ] ..., one pair per text, and
    # every number sits inside a pair
    if opening.size != 2 * len(raws) or not opening[0::2].all() or opening[1::2].any():
        return None
    first, last = before_all[0::2], before_all[1::2]
    if (first[1:] != last[:-1]).any() or (ntok and (first[0] != 0 or last[-1] != ntok)):
        return None
    return (last - first).astype(np.int64), values


def _slow_numbers(text: bytes, values: np.ndarray, slow: list, slow_type: Any) -> bool:
    """Decode the tokens the fast path left with msgspec into ``values``; False if refused."""
    idx, a, b = (np.concatenate(c) for c in zip(*slow))
    toks = [text[i:j] for i, j in zip(a.tolist(), b.tolist())]
    try:
        got = msgspec.json.decode(b"[" + b",".join(toks) + b"]", type=slow_type)
        values[idx] = np.fromiter(got, np.float64, len(got))
    except (msgspec.ValidationError, msgspec.DecodeError, OverflowError):
        return False  # out of range (1e400); OverflowError: an integer beyond a double
    return True
