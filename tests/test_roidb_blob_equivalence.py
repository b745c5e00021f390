"""``serialize_roidb`` (orjson header) against main's (``tests/oracles/roidb_blob.py``):
the same array section byte for byte and the same decoded content, on entries with the
awkward values too (NaN/Infinity, integers beyond 64 bits, NumPy scalars and arrays in
JSON fields, tuples, bytes, non-ASCII text, nested mappings, None)."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
from oracles import roidb_blob as oracle_roidb_blob
import scipy.sparse
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.minibatch.roidb_blob import deserialize_roidb, serialize_roidb

_floats = st.floats(allow_nan=True, allow_infinity=True)
_scalars = st.one_of(_floats, st.integers(-2**70, 2**70), st.booleans(), st.none(),
                     st.text(max_size=5), _floats.map(np.float32), st.integers(-9, 9).map(np.int64))
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.lists(inner, max_size=3).map(tuple),
                            st.binary(max_size=6),
                            st.dictionaries(st.text(max_size=3), inner, max_size=3),
                            st.lists(_floats, max_size=4).map(np.array)),
    max_leaves=12)


@st.composite
def _entries(draw):
    r = draw(st.integers(0, 5))
    polys = st.lists(st.lists(st.floats(-1e4, 1e4, allow_nan=False), min_size=6, max_size=12),
                     min_size=1, max_size=3)
    rle = st.fixed_dictionaries({"size": st.lists(st.integers(1, 50), min_size=2, max_size=2),
                                 "counts": st.one_of(st.binary(max_size=8), st.text(max_size=8))})
    e = {"boxes": np.asarray(draw(st.lists(st.lists(st.floats(-1e4, 1e4, width=32), min_size=4,
                                                    max_size=4), min_size=r, max_size=r)),
                             np.float32).reshape(r, 4),
         "gt_classes": np.arange(r, dtype=np.int32),
         "gt_overlaps": scipy.sparse.csr_matrix(np.eye(r, 3, dtype=np.float32)),
         "segms": draw(st.lists(st.one_of(polys, rle, _json), max_size=r)),
         "has_visible_keypoints": draw(st.one_of(st.booleans(), _json)),
         "id": draw(st.one_of(st.integers(0, 2**70), _json)),
         "image": draw(st.text(max_size=10)), "width": 640, "height": 480,
         "flipped": draw(st.booleans())}
    return e


def _split(blob):
    raw = np.asarray(blob).astype(np.uint8).tobytes()
    (hlen,) = struct.unpack("<I", raw[5:9])
    return raw[:5], json.loads(raw[9:9 + hlen]), raw[9 + hlen:]


def _equal(a, b):
    """Deep equality where NaN equals NaN and types must match."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict):
        return list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if scipy.sparse.issparse(a):
        return _equal(a.toarray(), b.toarray())
    return a == b


@settings(deadline=None, max_examples=300)
@given(st.lists(_entries(), max_size=3))
def test_same_content_as_main(entries):
    new, old = serialize_roidb(entries), oracle_roidb_blob.serialize_roidb(entries)
    assert new.dtype == old.dtype == np.float32
    (m_new, h_new, a_new), (m_old, h_old, a_old) = _split(new), _split(old)
    assert m_new == m_old and a_new == a_old
    assert _equal(h_new, h_old)
    assert _equal(deserialize_roidb(new), deserialize_roidb(old))


def test_plain_polygons_take_the_fast_encoder_nan_falls_back():
    e = {"segms": [[[1.5, 2.0, 3.25, 4.0, 5.0, 1e-05]]], "id": 3}
    blob = serialize_roidb([e])
    assert b"1e-05" not in _raw_head(blob)  # json would write 1e-05, orjson 0.00001
    assert deserialize_roidb(blob)[0]["segms"] == e["segms"]
    e = {"segms": [[[float("nan"), 2.0, 3.0, 4.0, 5.0, 6.0]]]}
    head = _raw_head(serialize_roidb([e]))
    assert b"NaN" in head and b"null" not in head
    assert math.isnan(deserialize_roidb(serialize_roidb([e]))[0]["segms"][0][0][0])


def _raw_head(blob):
    raw = np.asarray(blob).astype(np.uint8).tobytes()
    (hlen,) = struct.unpack("<I", raw[5:9])
    return raw[9:9 + hlen]
