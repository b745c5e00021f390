"""Polygons and keypoints parsed from raw JSON text give exactly the old decoder's columns.

``decode_fast`` keeps ``segmentation`` and ``keypoints`` as raw JSON text and parses their
numbers with :func:`lit_roidata.roidb.numtext.parse_number_lists` (SWAR on the bytes,
msgspec for the rare long or exponent tokens). The reference is the previous decoder
(``tests/oracles/decode.py``), which built a Python number per value: on hypothesis-drawn
COCO files with hand-written number texts (ints and floats, exponents, ``-0``, long
mantissas, whitespace, empty lists, polygons under 6 coordinates, crowd RLEs of both
kinds, malformed values) both must refuse the same files and give bit-identical columns,
tables and errors otherwise.
"""

from __future__ import annotations

import json
from typing import Union

import msgspec
import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from oracles import coco as coco_oracle
from oracles import decode as decode_oracle
from lit_roidata.roidb import numtext
from lit_roidata.roidb.coco import table_from_raw
from lit_roidata.roidb.decode import decode_coco, decode_fast
from lit_roidata.roidb.info import RoIDBInputError
from lit_roidata.roidb.numtext import parse_number_lists
from roidb_fixtures import KEYPOINTS, make_coco

DIGITS = "0123456789"


@st.composite
def number_text(draw) -> str:
    """A JSON number as a file may spell it."""
    kind = draw(st.integers(0, 5))
    if kind == 0:  # COCO style: 2 decimals
        return f"{draw(st.floats(-2000, 2000)):.2f}"
    if kind == 1:  # a double's shortest repr (up to 17 significant digits)
        return repr(draw(st.floats(allow_nan=False, allow_infinity=False, width=64)))
    if kind == 2:  # a small integer (keypoints, visibility flags)
        return str(draw(st.integers(-3, 1000)))
    sign = draw(st.sampled_from(["", "-"]))
    lead = draw(st.sampled_from(["0", "1", "9"]))
    whole = "0" if lead == "0" else lead + draw(st.text(DIGITS, max_size=18))
    frac = draw(st.one_of(st.just(""), st.text(DIGITS, min_size=1, max_size=19).map(
        lambda s: "." + s)))
    exp = ""
    if kind == 5:
        exp = (draw(st.sampled_from("eE")) + draw(st.sampled_from(["", "+", "-"]))
               + str(draw(st.integers(0, 330))))
    return sign + whole + frac + exp


def _ws(draw) -> str:
    return draw(st.sampled_from(["", "", "", " ", "\n  ", "\t"]))


@st.composite
def number_list(draw, min_size: int = 0, max_size: int = 14) -> str:
    nums = draw(st.lists(number_text(), min_size=min_size, max_size=max_size))
    sep = "," + _ws(draw)
    return "[" + _ws(draw) + sep.join(nums) + _ws(draw) + "]"


@st.composite
def segmentation_text(draw, original: object) -> str:
    kind = draw(st.integers(0, 12))
    if kind == 0 and isinstance(original, dict):
        return json.dumps(original)  # crowd RLE (either counts kind), kept
    if kind == 1:
        return "null"
    if kind == 2:  # malformed: a flat list, a string, a nested list, true
        return draw(st.sampled_from(["[1, 2, 3, 4, 5, 6]", "[1.5,2.25,3.0,4.0,5.0,6.0]", '[[1, "2", 3, 4, 5, 6]]',
                                     "[[[1, 2, 3, 4, 5, 6]]]", "true", "[[1, 2, null]]",
                                     '"polygon"', "7", "[[1e400, 2, 3, 4, 5, 6]]"]))
    polys = draw(st.lists(number_list(), max_size=3))
    return "[" + _ws(draw) + ("," + _ws(draw)).join(polys) + "]"


@st.composite
def keypoints_text(draw) -> str:
    kind = draw(st.integers(0, 10))
    if kind == 0:
        return "null"
    if kind == 1:
        return draw(st.sampled_from(['"none"', "[1, null, 2]", "[[1, 2, 3]]", "{}"]))
    if kind == 2:
        return "[]"
    # mostly values a keypoint table accepts (|v| < 2**31), sometimes any number
    value = st.one_of(st.integers(-5, 900).map(str), st.integers(0, 2).map(str),
                      st.floats(-5, 900).map(lambda v: f"{v:.1f}"),
                      st.floats(-5, 900).map(repr), st.just("-0"), st.just("-0.0"),
                      st.just("1.5e2"))
    wild = draw(st.integers(0, 4)) == 0
    vals = [draw(number_text()) if wild and draw(st.integers(0, 20)) == 0 else draw(value)
            for _ in range(3 * len(KEYPOINTS))]
    return "[" + ", ".join(vals) + "]"


@st.composite
def coco_text(draw) -> bytes:
    """A COCO file whose segmentation/keypoints texts are written by hand."""
    data = make_coco(draw(st.integers(0, 10_000)), n_images=draw(st.integers(1, 5)),
                     keypoints=draw(st.booleans()))
    texts = {}
    for i, a in enumerate(data["annotations"]):
        if draw(st.integers(0, 9)) == 0:
            a.pop("segmentation", None)
        else:
            texts[f"@@S{i}@@"] = draw(segmentation_text(a.get("segmentation")))
            a["segmentation"] = f"@@S{i}@@"
        if "keypoints" in a and draw(st.integers(0, 5)) != 0:
            texts[f"@@K{i}@@"] = draw(keypoints_text())
            a["keypoints"] = f"@@K{i}@@"
    if draw(st.booleans()):  # annotations grouped by ascending image id (COCO's usual)
        data["annotations"].sort(key=lambda a: a["image_id"])
    out = json.dumps(data, indent=draw(st.sampled_from([None, 1])))
    for k, v in texts.items():
        out = out.replace(f'"{k}"', v)
    return out.encode()


def assert_same(a, b) -> None:
    """Every field equal; arrays of the same dtype, shape and bytes (``-0.0`` != ``0.0``)."""
    assert vars(a).keys() == vars(b).keys()
    for k, va in vars(a).items():
        vb = getattr(b, k)
        if isinstance(va, np.ndarray):
            assert va.dtype == vb.dtype and va.shape == vb.shape, k
            assert va.tobytes() == vb.tobytes(), k
        else:
            assert va == vb, k


def _table_or_error(fn, raw, required):
    try:
        return fn(raw, name="x", keypoints_required=required), None
    except RoIDBInputError as exc:
        return None, str(exc)


@settings(deadline=None, max_examples=200)
@given(raw=coco_text(), required=st.booleans())
def test_raw_text_decoder_matches_the_object_decoder(raw, required):
    """Old decoder + old table code vs new decoder + new table code: same columns."""
    new = decode_fast(raw, "x.json")
    old = decode_oracle.decode_fast(raw, "x.json")
    assert (new is None) == (old is None)
    if new is None:
        return
    assert_same(new, old)
    ta, ea = _table_or_error(table_from_raw, new, required)
    tb, eb = _table_or_error(coco_oracle.table_from_raw, old, required)
    assert ea == eb
    if ta is None:
        return
    for k in ("ids", "widths", "heights", "gt_off", "boxes", "classes", "seg_areas",
              "is_crowd", "has_vis_kp", "keypoints"):
        va, vb = getattr(ta, k), getattr(tb, k)
        assert (va is None) == (vb is None), k
        if va is not None:
            assert va.dtype == vb.dtype and va.tobytes() == vb.tobytes(), k
    for f in ta.segms.FIELDS:
        va, vb = getattr(ta.segms, f), getattr(tb.segms, f)
        assert va.dtype == vb.dtype and va.tobytes() == vb.tobytes(), f
    assert ta.counts == tb.counts


@settings(deadline=None, max_examples=200)
@given(nums=st.lists(number_text(), max_size=40), ints=st.booleans())
def test_numbers_match_msgspec_bit_for_bit(nums, ints):
    """Every token's double is msgspec's (the old decoder's), ``-0`` vs ``-0.0`` included."""
    slow = list[Union[int, float]] if ints else list[float]
    text = ("[" + ",".join(nums) + "]").encode()
    try:
        ref = np.fromiter(msgspec.json.decode(text, type=slow), np.float64)
    except msgspec.ValidationError:  # out of range: both refuse
        assert parse_number_lists([text], slow_type=slow) is None
        return
    counts, vals = parse_number_lists([text], slow_type=slow)
    assert counts.tolist() == [len(nums)]
    assert vals.dtype == np.float64 and vals.tobytes() == ref.tobytes()


@pytest.mark.parametrize("block", [1, 3, 7, 16, 64])
@settings(deadline=None, max_examples=40)
@given(lists=st.lists(number_list(), max_size=12))
def test_block_boundaries_do_not_change_the_parse(block, lists):
    """Blocks of any size (a token never split) give the single-block parse."""
    texts = [t.encode() for t in lists]
    whole = parse_number_lists(texts, slow_type=list[float])
    old = numtext._BLOCK
    numtext._BLOCK = block
    try:
        split = parse_number_lists(texts, slow_type=list[float])
    finally:
        numtext._BLOCK = old
    assert (whole is None) == (split is None)
    if whole is not None:
        for a, b in zip(whole, split):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        assert whole[0].tolist() == [len(json.loads(t)) for t in lists]


@pytest.mark.parametrize("texts,expect", [
    ([b"[1,2,3,4,5,6]", b"[]", b"[7]"], [6, 0, 1]),
    ([b"[ 1 ,\n2 ]", b"[\t]"], [2, 0]),
    ([], []),
    ([b"[[1,2]]"], None),                # a list where numbers belong
    ([b"[1]", b"2"], None),              # a number where a list belongs
    ([b"3", b"[1]"], None),
    ([b"1.5", b"2.5"], None),            # numbers, not lists (no two tokens merge)
    ([b'["1"]'], None),                  # a string
    ([b"[true]"], None),
    ([b"null"], None),
    ([b'{"a": [1]}'], None),
    ([b"[1e400]"], None),                # msgspec refuses it: out of range
])
def test_shapes_and_refusals(texts, expect):
    got = parse_number_lists(texts, slow_type=list[float])
    if expect is None:
        assert got is None
    else:
        assert got[0].tolist() == expect


def test_bad_polygon_values_still_name_the_record(tmp_path):
    """A refused raw text falls back to the generic decoder and its named error."""
    data = make_coco(3, keypoints=True)
    a = data["annotations"][0]
    a["segmentation"] = [[1.0, "2", 3.0, 4.0, 5.0, 6.0]]
    p = tmp_path / "ann.json"
    p.write_bytes(orjson.dumps(data))
    assert decode_fast(p.read_bytes(), str(p)) is None
    with pytest.raises(RoIDBInputError, match=rf"annotation id {a['id']} \(image id "
                                              rf"{a['image_id']}\)"):
        decode_coco(str(p))


def test_build_asks_for_no_huge_pages_and_restores_the_setting():
    """The builder turns transparent huge pages off for its process (a public Linux
    prctl, no NumPy internals) and restores the setting after, also when the build fails."""
    import ctypes

    from lit_roidata.osutil import no_transparent_hugepages

    try:
        prctl = ctypes.CDLL(None).prctl
    except (OSError, AttributeError):
        pytest.skip("no prctl here (not Linux)")
    before = prctl(42, 0, 0, 0, 0)  # PR_GET_THP_DISABLE
    if before < 0:
        pytest.skip("this kernel has no PR_GET_THP_DISABLE")
    with pytest.raises(RuntimeError):
        with no_transparent_hugepages() as ok:
            inside = prctl(42, 0, 0, 0, 0)
            raise RuntimeError("a failed build")
    assert ok and inside == 1
    assert prctl(42, 0, 0, 0, 0) == before
