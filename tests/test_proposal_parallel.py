"""Proposal chunks computed by forked workers: the same table, counts and first error as
one process, and a worker that dies only costs time."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from lit_roidata.roidb import proposals as P
from lit_roidata.roidb.info import RoIDBInputError
from lit_roidata.roidb.proposal_files import ProposalSource
from test_proposal_merge_equivalence import tables

FIELDS = ("off", "boxes", "max_overlaps", "max_classes", "gt_map")


def _table(src, gt, monkeypatch, workers, chunk=40, **kw):
    """The table, and whether the chunks went to worker processes."""
    monkeypatch.setenv("LIT_ROIDATA_BUILD_WORKERS", str(workers))
    monkeypatch.setattr(P, "_CHUNK_BOXES", chunk)
    used = []
    real = P.map_ordered

    def spy(fn, tasks, n, **k):
        used.append(n > 1)
        return real(fn, tasks, n, **k)

    monkeypatch.setattr(P, "map_ordered", spy)
    t = P.build_proposal_table(src, **gt, **kw)
    monkeypatch.setattr(P, "map_ordered", real)
    return t, bool(used and used[0])


def _same(a, b) -> None:
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), f
    assert dict(a.counts) == dict(b.counts) and list(a.counts) == list(b.counts)


@settings(deadline=None, max_examples=25,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=tables())
def test_workers_give_the_one_process_table(monkeypatch, data):
    src, gt = data
    kw = dict(min_proposal_size=2, proposal_limit=5, crowd_filter_thresh=0.7)
    many, parallel = _table(src, gt, monkeypatch, 2, chunk=7, **kw)
    one, _ = _table(src, gt, monkeypatch, 0, chunk=7, **kw)
    _same(many, one)
    # the chunks are cut over the records in image order (ids sorted), as the build cuts them
    rec = P.align_records(src, gt["image_ids"], Counter())
    assert parallel == (len(P._chunk_ranges(src.counts[rec])) >= 4)


def _source(n=40, per=30, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.arange(1, n + 1, dtype=np.int64)
    widths = np.full(n, 640, np.int64)
    heights = np.full(n, 480, np.int64)
    gt_off = np.arange(n + 1, dtype=np.int64) * 2
    gb = np.tile(np.array([[10, 10, 100, 100], [200, 200, 300, 260]], np.float32), (n, 1))
    recs = []
    for _ in range(n):
        b = rng.uniform(0, 400, (per, 4)).astype(np.float32)
        b[:, 2:] += b[:, :2]
        recs.append(b)
    counts = np.full(n, per, np.int64)
    off = np.concatenate([[0], np.cumsum(counts)])
    src = ProposalSource("p.npz", ids, counts, lambda k: recs[k], flat=np.concatenate(recs),
                         flat_off=off)
    gt = dict(image_ids=ids, widths=widths, heights=heights, gt_off=gt_off, gt_boxes=gb,
              gt_classes=np.ones(2 * n, np.int32), gt_is_crowd=np.zeros(2 * n, bool))
    return src, gt, recs


def test_an_error_in_a_late_chunk_is_the_one_process_error(monkeypatch):
    src, gt, recs = _source()
    recs[33][4, 1] = np.nan
    src.flat[33 * 30 + 4, 1] = np.nan
    errs = []
    for workers in (0, 2):
        with pytest.raises(RoIDBInputError) as ei:
            _table(src, gt, monkeypatch, workers, chunk=60)
        errs.append(str(ei.value))
    assert errs[0] == errs[1] and "image ids [34]" in errs[0]


def test_a_dying_worker_only_costs_time(monkeypatch):
    src, gt, _ = _source(seed=3)
    one, _ = _table(src, gt, monkeypatch, 0, chunk=60)
    parent, real = os.getpid(), P._chunk

    def chunk(src_, rec, i0, *a):
        if os.getpid() != parent and i0 >= 10:
            os._exit(5)  # a worker killed mid-build
        return real(src_, rec, i0, *a)

    monkeypatch.setattr(P, "_chunk", chunk)
    many, parallel = _table(src, gt, monkeypatch, 2, chunk=60)
    assert parallel
    _same(many, one)


def test_chunk_ranges_hold_about_a_chunk_of_boxes(monkeypatch):
    monkeypatch.setattr(P, "_CHUNK_BOXES", 10)
    n = np.array([3, 4, 0, 3, 12, 0, 0, 5, 5, 1], np.int64)
    # greedy from each start: 3+4+0+3 = 10 fits, 12 alone, 0+0+5+5 = 10, then 1
    assert P._chunk_ranges(n) == [(0, 4), (4, 5), (5, 9), (9, 10)]
    assert P._chunk_ranges(np.zeros(0, np.int64)) == []
