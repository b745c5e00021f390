"""Proposal pickles unpickled by a forked reader while the annotations decode (issue #28
item 6): the same source, table, errors and cache as reading them in the builder, and a
reader that dies or meets an unusual layout only costs time."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from lit_roidata.config import get_cfg
from lit_roidata.roidb import RoIDBInputError, combined_roidb_for_training
from lit_roidata.roidb import proposal_files as PF
from lit_roidata.roidb.proposal_files import FileRows, PickleReadAhead, read_proposal_file
from roidb_fixtures import make_coco, make_proposals, write_dataset


def _dump(path, obj) -> str:
    with open(path, "wb") as fh:
        pickle.dump(obj, fh, protocol=4)
    return str(path)


def _detectron_pickle(path, n=12, seed=0, dtypes=(np.float32,)) -> str:
    """Detectron's layout: one (P, 4) array per image, some empty; ``dtypes`` cycle."""
    rng = np.random.default_rng(seed)
    boxes, scores = [], []
    for k in range(n):
        p = 0 if k % 5 == 3 else int(rng.integers(1, 30))
        b = rng.uniform(0, 300, (p, 4))
        b[:, 2:] += b[:, :2]
        boxes.append(b.astype(dtypes[k % len(dtypes)]))
        scores.append(np.sort(rng.random(p).astype(np.float32))[::-1].copy())
    return _dump(path, {"boxes": boxes, "scores": scores, "ids": list(range(100, 100 + n))})


def _same_source(a, b) -> None:
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.counts, b.counts)
    for i in range(a.ids.size):
        x, y = np.asarray(a.boxes_of(i)).reshape(-1, 4), np.asarray(b.boxes_of(i)).reshape(-1, 4)
        assert x.tobytes() == y.tobytes(), i
    if a.flat is not None or b.flat is not None:
        n = int(a.counts.sum())
        assert np.asarray(a.flat[0:n]).tobytes() == np.asarray(b.flat[0:n]).tobytes()
        np.testing.assert_array_equal(a.flat_off, b.flat_off)


def _read_ahead(paths, monkeypatch, workers=2):
    monkeypatch.setenv("LIT_ROIDATA_BUILD_WORKERS", str(workers))
    return PickleReadAhead(paths, trust_pickle=True)


def test_the_reader_gives_the_source_read_here(tmp_path, monkeypatch):
    paths = [_detectron_pickle(tmp_path / f"p{k}.pkl", n=10 + k, seed=k) for k in range(2)]
    ahead = _read_ahead([paths[0], None, paths[1]], monkeypatch)
    try:
        assert ahead.proc is not None and len(ahead.todo) == 2  # both sent to the reader
        for k, p in enumerate(paths):
            got = ahead.source(p)
            assert isinstance(got.flat, FileRows)  # from the shared scratch file
            _same_source(got, read_proposal_file(p, trust_pickle=True, scores=False))
            # the reader ends once its last result is taken, not with the build
            assert ahead.proc.alive == (k < len(paths) - 1)
    finally:
        ahead.close()


def test_an_unusual_layout_is_read_here(tmp_path, monkeypatch):
    # records of two dtypes do not lie back to back in one dtype: the reader declines
    p = _detectron_pickle(tmp_path / "mixed.pkl", dtypes=(np.float32, np.float64))
    ahead = _read_ahead([p], monkeypatch)
    try:
        got = ahead.source(p)
    finally:
        ahead.close()
    assert got.flat is None
    _same_source(got, read_proposal_file(p, trust_pickle=True, scores=False))


def test_a_bad_pickle_gives_the_error_read_here(tmp_path, monkeypatch):
    good = _detectron_pickle(tmp_path / "good.pkl")
    bad = tmp_path / "bad.pkl"
    bad.write_bytes(open(good, "rb").read()[:-100])  # truncated
    with pytest.raises(RoIDBInputError) as here:
        read_proposal_file(str(bad), trust_pickle=True, scores=False)
    ahead = _read_ahead([str(bad)], monkeypatch)
    try:
        with pytest.raises(RoIDBInputError) as there:
            ahead.source(str(bad))
    finally:
        ahead.close()
    assert str(there.value) == str(here.value) and "truncated" in str(here.value)


def test_a_dying_reader_only_costs_time(tmp_path, monkeypatch):
    p = _detectron_pickle(tmp_path / "p.pkl")
    parent = os.getpid()

    def die(*a):
        if os.getpid() != parent:
            os._exit(7)  # the reader killed mid-read
        raise AssertionError("the reader runs in a child")

    monkeypatch.setattr(PF, "_read_ahead", die)
    ahead = _read_ahead([p], monkeypatch)
    try:
        got = ahead.source(p)
    finally:
        ahead.close()
    _same_source(got, read_proposal_file(p, trust_pickle=True, scores=False))


def test_no_reader_without_build_workers_or_for_npz(tmp_path, monkeypatch):
    p = _detectron_pickle(tmp_path / "p.pkl")
    for paths, workers in (([p], 0), ([None], 2)):
        ahead = _read_ahead(paths, monkeypatch, workers)
        assert ahead.proc is None and not ahead.todo
        ahead.close()
    ahead = _read_ahead([p], monkeypatch, 0)
    _same_source(ahead.source(p), read_proposal_file(p, trust_pickle=True, scores=False))


def test_builds_with_and_without_the_reader_are_identical(tmp_path, monkeypatch):
    """Two datasets, each with its pickle: the cache is byte-identical either way."""
    names, files, cat = [], [], None
    for k in range(2):
        data = make_coco(20 + k, n_images=7)
        name = f"d{k}"
        cat = write_dataset(str(tmp_path / name), name, data, catalog=cat)
        names.append(name)
        files.append(make_proposals(20 + k, data, str(tmp_path / f"{name}.pkl"), per_image=25))
    dbs = []
    for workers in (2, 0):
        monkeypatch.setenv("LIT_ROIDATA_BUILD_WORKERS", str(workers))
        dbs.append(combined_roidb_for_training(tuple(names), files, get_cfg(),
                                               str(tmp_path / f"cache{workers}"), catalog=cat,
                                               progress=False, trust_pickle=True))
    a, b = dbs
    assert sorted(a._a) == sorted(b._a)
    for k in a._a:
        x, y = np.asarray(a._a[k]), np.asarray(b._a[k])
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), k
    ra, rb = (({k: v for k, v in db.report.items() if k != "build_seconds"}) for db in dbs)
    assert ra == rb
    assert all(d["proposals"]["proposals_kept"] > 0 for d in ra["datasets"])
