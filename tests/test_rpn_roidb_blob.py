"""The ``roidb`` blob round-trips (Detectron semantics: RPN targets; tested invariants)."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.minibatch.roidb_blob import (
    EXTRA_KEYS, ROIDB_BLOB_KEYS, deserialize_roidb, serialize_roidb)

_coord = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@st.composite
def _entries(draw):
    r = draw(st.integers(0, 6))
    g = draw(st.integers(0, r))
    c = draw(st.integers(2, 5))
    boxes = np.array(draw(st.lists(st.lists(_coord, min_size=4, max_size=4),
                                   min_size=r, max_size=r)), np.float32).reshape(r, 4)
    ov = np.zeros((r, c), np.float32)
    for i in range(r):
        if draw(st.booleans()):
            ov[i, draw(st.integers(0, c - 1))] = draw(st.floats(-1, 1, width=32))
    poly = st.lists(st.lists(_coord, min_size=6, max_size=8), min_size=1, max_size=2)
    rle = st.fixed_dictionaries({"size": st.lists(st.integers(1, 50), min_size=2, max_size=2),
                                 "counts": st.one_of(st.lists(st.integers(0, 99), max_size=6),
                                                     st.binary(max_size=8))})
    e = {"boxes": boxes, "gt_classes": np.arange(r, dtype=np.int32),
         "seg_areas": np.ones(r, np.float32), "gt_overlaps": scipy.sparse.csr_matrix(ov),
         "is_crowd": np.array(draw(st.lists(st.booleans(), min_size=r, max_size=r)), bool),
         "box_to_gt_ind_map": np.full(r, -1, np.int32),
         "segms": draw(st.lists(st.one_of(poly, rle), min_size=g, max_size=g)),
         "has_visible_keypoints": draw(st.booleans()),
         "ignored_field": "not carried", "id": draw(st.integers(0, 2**40)),
         "width": 640, "height": 480, "flipped": draw(st.booleans()), "image": "/d/ü 1.jpg"}
    if draw(st.booleans()):
        e["gt_keypoints"] = np.array(draw(st.lists(st.integers(-5, 500), min_size=g * 6,
                                                    max_size=g * 6)), np.int32).reshape(g, 3, 2)
    return e


def _assert_same(a, b):
    assert set(b) == set(a) & set(ROIDB_BLOB_KEYS + EXTRA_KEYS)
    for k, v in b.items():
        if k == "gt_overlaps":
            assert scipy.sparse.issparse(v)
            np.testing.assert_array_equal(v.toarray(), a[k].toarray())
        elif isinstance(v, np.ndarray):
            assert v.dtype == a[k].dtype and v.shape == a[k].shape
            np.testing.assert_array_equal(v, a[k])
        else:
            assert v == a[k]


@settings(deadline=None, max_examples=50)
@given(st.lists(_entries(), min_size=0, max_size=3))
def test_round_trip(entries):
    blob = serialize_roidb(entries)
    assert blob.dtype == np.float32 and blob.ndim == 1
    assert ((blob >= 0) & (blob <= 255) & (blob == np.round(blob))).all()
    back = deserialize_roidb(blob)
    assert len(back) == len(entries)
    for a, b in zip(entries, back):
        _assert_same(a, b)


def test_torch_input_and_bad_blob():
    torch = pytest.importorskip("torch")
    e = {"boxes": np.ones((2, 4), np.float32), "segms": [[[1.5, 2.0, 3.0, 4.0, 5.0, 6.0]]]}
    back = deserialize_roidb(torch.from_numpy(serialize_roidb([e])))
    np.testing.assert_array_equal(back[0]["boxes"], e["boxes"])
    assert back[0]["segms"] == e["segms"]
    with pytest.raises(ValueError, match="bad magic"):
        deserialize_roidb(np.zeros(20, np.float32))
