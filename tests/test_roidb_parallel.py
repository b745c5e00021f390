"""The cold build's worker processes: the same tables, caches and errors as one process.

``load_coco_json`` hands windows of the ``images`` / ``annotations`` arrays to forked
workers (:class:`lit_roidata.roidb.coco.ParallelWindows`) when the file spans a few
windows. Whatever the layout, window size and worker count, the table must equal the
one-process table, a malformed record must raise the same named error, and a worker
that dies or refuses a window must only cost time (the main process redoes it).
"""

from __future__ import annotations

import os
import signal
import time

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_roidata.roidb import coco as coco_mod
from lit_roidata.roidb.coco import load_coco_json
from lit_roidata.roidb.info import RoIDBInputError
from lit_roidata.roidb.workers import OrderedWorkers, WorkerDied, WorkerFailed, build_workers
from roidb_fixtures import make_coco
from test_roidb_chunked import _cache_files, assert_tables_equal, files


def _load(path, workers: int, monkeypatch, **kw):
    monkeypatch.setenv("LIT_ROIDATA_BUILD_WORKERS", str(workers))
    return load_coco_json(str(path), name="x", **kw)


def _outcome(path, workers, monkeypatch, **kw):
    try:
        return _load(path, workers, monkeypatch, **kw)
    except RoIDBInputError as exc:
        return exc


@settings(deadline=None, max_examples=30,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(f=files(), window=st.integers(20, 600), workers=st.integers(2, 3),
       required=st.booleans())
def test_workers_give_the_one_process_table(tmp_path_factory, monkeypatch, f, window,
                                            workers, required):
    _, raw = f
    p = tmp_path_factory.mktemp("par") / "ann.json"
    p.write_bytes(raw)
    one = _outcome(p, 0, monkeypatch, window_bytes=window, keypoints_required=required)
    many = _outcome(p, workers, monkeypatch, window_bytes=window, keypoints_required=required)
    if isinstance(one, RoIDBInputError):
        assert isinstance(many, RoIDBInputError) and str(many) == str(one)
    else:
        assert_tables_equal(many, one)


def _big(tmp_path, n_images=80):
    data = make_coco(7, n_images=n_images, max_anns=6, keypoints=True)
    return data, tmp_path / "big.json"


@pytest.mark.parametrize("field,value", [("bbox", None), ("category_id", "dog"),
                                         ("area", "big"), ("segmentation", 7),
                                         ("segmentation", [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])])
@pytest.mark.parametrize("where", [5, -3])
def test_a_malformed_record_gives_the_same_error(tmp_path, monkeypatch, field, value, where):
    data, p = _big(tmp_path)
    a = data["annotations"][where]
    a[field] = value
    p.write_bytes(orjson.dumps(data))
    one = _outcome(p, 0, monkeypatch, window_bytes=300)
    many = _outcome(p, 2, monkeypatch, window_bytes=300)
    assert isinstance(one, RoIDBInputError), one
    assert type(many) is type(one) and str(many) == str(one)
    assert f"annotation id {a['id']}" in str(many)


def _dies_on_third_window(real):
    def task(path, gt_min_area, required, window, state):
        state["n"] = state.get("n", 0) + 1
        if state["n"] == 3:
            os._exit(3)  # a worker killed mid-build (out of memory, say)
        return real(path, gt_min_area, required, window, state)
    return task


def _refuses_annotations(real):
    def task(path, gt_min_area, required, window, state):
        if window[0] == "annotations" and window[1] % 2:
            raise ValueError("refused")
        return real(path, gt_min_area, required, window, state)
    return task


@pytest.mark.parametrize("fault", [_dies_on_third_window, _refuses_annotations])
def test_a_failing_worker_only_costs_time(tmp_path, monkeypatch, fault):
    data, p = _big(tmp_path, n_images=120)
    p.write_bytes(orjson.dumps(data))
    one = _load(p, 0, monkeypatch, window_bytes=400)
    monkeypatch.setattr(coco_mod, "_window_task", fault(coco_mod._window_task))
    many = _load(p, 2, monkeypatch, window_bytes=400)
    assert_tables_equal(many, one)


def test_windows_really_go_to_workers(tmp_path, monkeypatch):
    """The parallel path is taken (not the in-process fallback every time)."""
    data, p = _big(tmp_path, n_images=120)
    p.write_bytes(orjson.dumps(data))
    seen = []
    real = coco_mod.ParallelWindows.result

    def result(self):
        out = real(self)
        seen.append(os.getpid())
        return out

    monkeypatch.setattr(coco_mod.ParallelWindows, "result", result)
    _load(p, 2, monkeypatch, window_bytes=400)
    assert len(seen) > 10


@pytest.mark.parametrize("workers", ["0", "2"])
def test_cache_bytes_identical_with_and_without_workers(tmp_path, monkeypatch, workers):
    from lit_roidata.catalog import Catalog
    from lit_roidata.config import get_cfg
    from lit_roidata.roidb import build as build_mod
    from lit_roidata.roidb import combined_roidb_for_training

    monkeypatch.setattr(build_mod.load_coco_json, "__kwdefaults__",
                        dict(build_mod.load_coco_json.__kwdefaults__, window_bytes=700))
    data = make_coco(11, n_images=60, keypoints=True)
    ann = tmp_path / "kp.json"
    ann.write_bytes(orjson.dumps(data))
    cat = Catalog(builtins=False)
    cat.register("kp", str(tmp_path), str(ann))

    def build(root, n):
        monkeypatch.setenv("LIT_ROIDATA_BUILD_WORKERS", n)
        combined_roidb_for_training("kp", (), get_cfg(), str(root), catalog=cat,
                                    check_images=False, progress=False)
        return _cache_files(root)

    one, other = build(tmp_path / "one", "0"), build(tmp_path / "other", workers)
    assert len(one) > 20 and one == other


# ----------------------------------------------------------------------- the workers
def _square(x, state):
    time.sleep(0.02 * ((x * 7) % 3))  # out-of-order finishing across workers
    return x * x + state.get("add", 0)


def test_ordered_workers_keep_submission_order_and_state():
    with OrderedWorkers(_square, 3) as w:
        for x in range(10):
            w.submit(x)
        got = [w.result() for _ in range(10)]
        w.broadcast({"add": 1})
        for x in range(4):
            w.submit(x)
        got2 = [w.result() for _ in range(4)]
    assert got == [x * x for x in range(10)] and got2 == [x * x + 1 for x in range(4)]


def _fails_on_two(x, state):
    if x == 2:
        raise KeyError("two")
    return x


def test_a_task_error_comes_back_with_its_cause_and_the_workers_go_on():
    with OrderedWorkers(_fails_on_two, 2) as w:
        for x in range(4):
            w.submit(x)
        assert [w.result(), w.result()] == [0, 1]
        with pytest.raises(WorkerFailed) as ei:
            w.result()
        assert isinstance(ei.value.__cause__, KeyError)
        assert w.result() == 3
        w.submit(5)
        assert w.result() == 5


def _sleep(x, state):
    time.sleep(x)
    return x


def test_a_killed_worker_is_reported_not_waited_for():
    w = OrderedWorkers(_sleep, 2)
    try:
        w.submit(30)
        os.kill(w._procs[0].pid, signal.SIGKILL)
        t = time.monotonic()
        with pytest.raises(WorkerDied):
            w.result()
        assert time.monotonic() - t < 10
        w.submit(0)  # goes to the live worker
        assert w.result() == 0
        with pytest.raises(WorkerDied):  # the dead one
            w.submit(0)
            w.result()
    finally:
        w.close()


def test_close_ends_busy_workers_and_discard_drains():
    w = OrderedWorkers(_sleep, 2)
    w.submit(0)
    w.submit(0)
    assert w.discard() and w.pending == 0
    w.submit(60)
    procs = list(w._procs)
    t = time.monotonic()
    w.close()
    assert time.monotonic() - t < 15 and not any(p.is_alive() for p in procs)


def test_build_workers_from_the_environment(monkeypatch):
    monkeypatch.setenv("LIT_ROIDATA_BUILD_WORKERS", "0")
    assert build_workers() == 0
    monkeypatch.setenv("LIT_ROIDATA_BUILD_WORKERS", "1")
    assert build_workers() == 0
    monkeypatch.setenv("LIT_ROIDATA_BUILD_WORKERS", "3")
    assert build_workers() == 3
    monkeypatch.setenv("LIT_ROIDATA_BUILD_WORKERS", "many")
    with pytest.raises(ValueError, match="LIT_ROIDATA_BUILD_WORKERS"):
        build_workers()
    monkeypatch.delenv("LIT_ROIDATA_BUILD_WORKERS")
    assert build_workers() == (0 if len(os.sched_getaffinity(0)) < 2
                               else min(len(os.sched_getaffinity(0)), 8))
