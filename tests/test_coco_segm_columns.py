"""``_segm_columns``' shortcut (every polygon kept, in file order: the coordinates are
taken as they are) gives exactly the general gather's columns."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.roidb.coco import _check_rles, _segm_columns
from lit_roidata.roidb.decode import decode_fast
from lit_roidata.roidb.segms import take_ranges
from roidb_fixtures import make_coco


@settings(deadline=None, max_examples=40)
@given(seed=st.integers(0, 10_000), drop=st.booleans())
def test_in_order_shortcut_equals_the_gather(seed, drop):
    data = make_coco(seed, n_images=4)
    raw = decode_fast(json.dumps(data).encode(), "x.json")
    n = raw.ann_id.size
    order = np.arange(n)
    if drop and n:
        order = order[order != seed % n]  # the general path
    known = np.ones(n, bool)
    h = np.full(n, -1.0)
    w = np.full(n, -1.0)
    for i, rle in raw.rles.items():  # the RLEs' own sizes: they pass the size check
        h[i], w[i] = rle["size"]
    cols, counts = _segm_columns(raw, order, _check_rles(raw, known, h, w))
    poly_off = np.concatenate([[0], np.cumsum(raw.poly_n)])
    coord_off = np.concatenate([[0], np.cumsum(raw.coord_n)])
    pidx = take_ranges(poly_off[order], raw.poly_n[order])
    pidx = pidx[raw.coord_n[pidx] >= 6]
    want = raw.coords[take_ranges(coord_off[pidx], raw.coord_n[pidx])]
    assert cols.coords.dtype == np.float64
    np.testing.assert_array_equal(cols.coords, want)
    np.testing.assert_array_equal(np.diff(cols.coord_off), raw.coord_n[pidx])
    assert counts["polygon_lt_6_coords"] == int((raw.coord_n[take_ranges(
        poly_off[order], raw.poly_n[order])] < 6).sum())
