"""The two COCO decoders agree, and malformed input always ends in a named error.

``decode_fast`` (msgspec, typed) must give exactly the columns ``decode_generic``
(orjson) gives on every input it accepts, and refuse (``None``) everything the strict
schema does not type-check, so that ``decode_coco`` falls back to the generic decoder,
whose errors name the file, the record and the fix. Also: the vectorised decoder of
compressed RLE strings against pycocotools.
"""

from __future__ import annotations

import json

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.roidb.coco import table_from_raw
from lit_roidata.roidb.decode import decode_coco, decode_fast, decode_generic
from lit_roidata.roidb.info import RoIDBInputError
from lit_roidata.roidb.segms import mask_to_uncompressed_counts, rle_string_counts
from roidb_fixtures import KEYPOINTS, make_coco

coord = st.one_of(st.integers(-50, 700), st.floats(-50, 700, allow_nan=False).map(
    lambda v: round(v, 2)), st.floats(-50, 700, allow_nan=False), st.floats(1e-7, 1e-3))
polygon = st.lists(coord, min_size=0, max_size=14)


def assert_same(a, b):
    for k, va in vars(a).items():
        vb = getattr(b, k)
        if k == "decoder":
            continue
        if isinstance(va, np.ndarray):
            assert va.dtype == vb.dtype and va.shape == vb.shape, k
            np.testing.assert_array_equal(va, vb, err_msg=k)
        else:
            assert va == vb, k


@st.composite
def coco(draw):
    seed = draw(st.integers(0, 10_000))
    data = make_coco(seed, n_images=draw(st.integers(1, 6)), keypoints=draw(st.booleans()))
    for a in data["annotations"]:
        if isinstance(a.get("segmentation"), list) and draw(st.booleans()):
            a["segmentation"] = draw(st.lists(polygon, max_size=3))
        if "keypoints" in a and draw(st.booleans()):
            a["keypoints"] = [draw(st.integers(-5, 900)) if i % 3 != 2 else
                              draw(st.integers(0, 2)) for i in range(3 * len(KEYPOINTS))]
        if draw(st.integers(0, 9)) == 0:
            a.pop("segmentation", None)
        if draw(st.integers(0, 9)) == 0:
            a.pop("id", None)
    return data


@settings(deadline=None, max_examples=60)
@given(data=coco(), pretty=st.booleans())
def test_fast_and_generic_decoders_give_identical_tables(data, pretty):
    raw = (json.dumps(data, indent=1) if pretty else json.dumps(data)).encode()
    fast = decode_fast(raw, "x.json")
    generic = decode_generic(orjson.loads(raw), "x.json")
    assert fast is not None and fast.decoder == "fast"
    assert_same(fast, generic)
    try:
        ta = table_from_raw(fast, name="x")
    except RoIDBInputError as exc:  # a random polygon of odd length etc.: same error
        with pytest.raises(RoIDBInputError) as ei:
            table_from_raw(generic, name="x")
        assert str(ei.value) == str(exc)
        return
    tb = table_from_raw(generic, name="x")
    for k in ("ids", "widths", "heights", "gt_off", "boxes", "classes", "seg_areas", "is_crowd",
              "has_vis_kp"):
        np.testing.assert_array_equal(getattr(ta, k), getattr(tb, k), err_msg=k)
    for f in ta.segms.FIELDS:
        np.testing.assert_array_equal(getattr(ta.segms, f), getattr(tb.segms, f), err_msg=f)
    assert (ta.keypoints is None) == (tb.keypoints is None)
    if ta.keypoints is not None:
        np.testing.assert_array_equal(ta.keypoints, tb.keypoints)
    assert ta.counts == tb.counts


BAD_VALUES = [
    ("segmentation", [[1.0, None, 3.0, 4.0, 5.0, 6.0]]),
    ("segmentation", [[1.0, "2", 3.0, 4.0, 5.0, 6.0]]),
    ("segmentation", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
    ("segmentation", 7),
    ("category_id", None), ("category_id", "dog"), ("category_id", 2.5),
    ("image_id", "1"), ("bbox", [1, 2, 3]), ("bbox", [1, None, 3, 4]), ("area", "big"),
    ("iscrowd", "no"), ("keypoints", [1, None, 2] * 17), ("keypoints", "none"),
]


@pytest.mark.parametrize("field,value", BAD_VALUES)
def test_malformed_values_fall_back_to_a_named_error(tmp_path, field, value):
    data = make_coco(3, keypoints=True)
    a = data["annotations"][0]
    a[field] = value
    p = tmp_path / "ann.json"
    p.write_bytes(orjson.dumps(data))
    assert decode_fast(p.read_bytes(), str(p)) is None  # the strict schema refuses it
    with pytest.raises(RoIDBInputError) as ei:
        t = decode_coco(str(p))
        table_from_raw(t, name="x")
    msg = str(ei.value)
    assert str(p) in msg and f"annotation id {a['id']}" in msg
    assert f"image id {a['image_id']}" in msg or field == "image_id"


def test_missing_field_is_named(tmp_path):
    data = make_coco(4)
    a = data["annotations"][1]
    del a["category_id"]
    p = tmp_path / "ann.json"
    p.write_bytes(orjson.dumps(data))
    with pytest.raises(RoIDBInputError, match=rf"ann\.json: annotation id {a['id']} \(image id "
                                              rf"{a['image_id']}\) has no 'category_id'"):
        decode_coco(str(p))


def test_widths_as_floats_take_the_generic_path(tmp_path):
    data = make_coco(5)
    for im in data["images"]:
        im["width"] = float(im["width"])
    p = tmp_path / "ann.json"
    p.write_bytes(orjson.dumps(data))
    raw = decode_coco(str(p))
    assert raw.decoder == "generic"
    assert table_from_raw(raw, name="x").widths.dtype == np.int32


@settings(deadline=None, max_examples=60)
@given(h=st.integers(1, 40), w=st.integers(1, 40), p=st.floats(0, 1), seed=st.integers(0, 99))
def test_rle_string_decoder_matches_pycocotools(h, w, p, seed):
    from pycocotools import mask as mask_util

    m = (np.random.default_rng(seed).random((h, w)) < p).astype(np.uint8)
    enc = mask_util.encode(np.asfortranarray(m))["counts"]
    counts, off, bad = rle_string_counts([enc, b"", enc])
    assert not bad[0] and not bad[2]
    assert counts[off[0]:off[1]].tolist() == mask_to_uncompressed_counts(m)
    assert counts[off[2]:off[3]].tolist() == mask_to_uncompressed_counts(m)
    assert off[1] == off[2]  # the empty string has no runs


@pytest.mark.parametrize("s", [b"\x7f", b"4032\x00", b"a", b"~~~~~~~~0", b"oooooooo0"])
def test_rle_string_decoder_flags_garbage(s):
    _, _, bad = rle_string_counts([s])
    assert bad[0]
