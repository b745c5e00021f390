"""The on-disk cache: reuse, invalidation, damage detection, one builder, shared memory."""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest
from filelock import FileLock

from lit_roidata.config import get_cfg
from lit_roidata.roidb import RoIDB, combined_roidb_for_training
from lit_roidata.roidb.cache import CacheError
from roidb_fixtures import make_coco, make_proposals, write_dataset


@pytest.fixture
def ds(tmp_path):
    data = make_coco(21, n_images=10)
    cat = write_dataset(str(tmp_path), "d", data)
    return cat, data, tmp_path


def _build(cat, tmp_path, cfg=None, cache="c", **kw):
    return combined_roidb_for_training("d", kw.pop("proposals", ()), cfg or get_cfg(),
                                       str(tmp_path / cache), catalog=cat, **kw, trust_pickle=True)


def test_warm_open_reuses_cache(ds, caplog):
    cat, _, tmp = ds
    with caplog.at_level(logging.INFO, logger="lit_roidata.roidb"):
        a = _build(cat, tmp)
        b = _build(cat, tmp)
    assert a.path == b.path
    msgs = [r.getMessage() for r in caplog.records if "entries (" in r.getMessage()]
    assert msgs[0].startswith("roidb built") and msgs[1].startswith("roidb opened from cache")
    boxes = a._a["gt_boxes"]
    assert not boxes.flags.owndata and not boxes.flags.writeable  # a view of the mapping
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as fh:
            assert os.path.join(a.path, "gt_boxes.npy") in fh.read()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_open_roidbs_hold_no_file_descriptor_per_array(ds):
    cat, _, tmp = ds
    a = _build(cat, tmp)
    count = lambda: len(os.listdir("/proc/self/fd"))  # noqa: E731
    gc.collect()
    before = count()
    opened = [RoIDB(a.path) for _ in range(40)]
    entries = [r[i].to_dict() for r in opened for i in range(len(r))]
    # one shared lock per open roidb (on its manifest), no descriptor per memory-mapped array
    assert count() - before <= len(opened)
    assert len(opened[0].manifest["arrays"]) > 5
    np.testing.assert_array_equal(entries[0]["boxes"], a[0]["boxes"])
    del opened, entries
    gc.collect()
    assert count() == before


def test_changed_input_or_option_rebuilds(ds):
    cat, data, tmp = ds
    a = _build(cat, tmp)
    ann = cat.get("d").annotation_file
    st = os.stat(ann)
    os.utime(ann, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touch
    b = _build(cat, tmp)
    assert b.path != a.path
    data["annotations"][0]["area"] += 1.0  # content change
    write_dataset(str(tmp), "d", data, catalog=cat)
    c = _build(cat, tmp)
    assert c.path not in (a.path, b.path)
    cfg = get_cfg()
    cfg.merge_from_dict({"TRAIN.FG_THRESH": 0.6})
    d = _build(cat, tmp, cfg)
    assert d.path != c.path
    cfg.merge_from_dict({"TRAIN.FG_THRESH": 0.5, "TRAIN.SCALES": (800,)})  # not a roidb option
    assert _build(cat, tmp, cfg).path == c.path
    p = make_proposals(3, data, str(tmp / "p.pkl"))
    e = _build(cat, tmp, proposals=[p])
    assert e.path != c.path and len(e) > 0


def test_truncated_cache_file_is_detected_and_rebuilt(ds, caplog):
    cat, _, tmp = ds
    a = _build(cat, tmp)
    ref = [a[i].to_dict() for i in range(len(a))]
    fn = os.path.join(a.path, "gt_boxes.npy")
    with open(fn, "r+b") as fh:
        fh.truncate(os.path.getsize(fn) - 8)
    with pytest.raises(CacheError, match=r"gt_boxes\.npy has \d+ bytes, the manifest says"):
        RoIDB(a.path)
    with caplog.at_level(logging.WARNING):
        b = _build(cat, tmp)
    assert any("unusable" in r.getMessage() for r in caplog.records)
    assert b.path == a.path and len(b) == len(ref)
    np.testing.assert_array_equal(b[0]["boxes"], ref[0]["boxes"])
    os.unlink(os.path.join(a.path, "manifest.json"))
    assert len(_build(cat, tmp)) == len(ref)


def test_pickles_as_a_path(ds):
    cat, _, tmp = ds
    a = _build(cat, tmp)
    blob = pickle.dumps(a)
    assert len(blob) < 1000
    b = pickle.loads(blob)
    assert len(b) == len(a)
    for i in range(len(a)):
        np.testing.assert_array_equal(a[i]["boxes"], b[i]["boxes"])
    e = a[0]
    with pytest.raises(TypeError):
        e["boxes"] = 1  # read-only mapping
    with pytest.raises(ValueError):
        e["boxes"][0, 0] = 1.0  # read-only arrays
    pickle.loads(pickle.dumps(e.to_dict()))
    pickle.loads(pickle.dumps(e["dataset"]))


def _child(cat, tmp_path, q):
    records = []

    class H(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("lit_roidata.roidb").addHandler(H())
    logging.getLogger("lit_roidata.roidb").setLevel(logging.INFO)
    db = combined_roidb_for_training("d", [str(tmp_path / "p.pkl")], get_cfg(),
                                     str(tmp_path / "shared"), catalog=cat, trust_pickle=True)
    q.put((db.path, any(m.startswith("roidb built") for m in records), len(db)))


def test_two_builders_one_builds(tmp_path):
    data = make_coco(5, n_images=400)
    cat = write_dataset(str(tmp_path), "d", data)
    make_proposals(1, data, str(tmp_path / "p.pkl"), per_image=50)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(cat, tmp_path, q)) for _ in range(2)]
    for p in procs:
        p.start()
    res = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert res[0][0] == res[1][0] and res[0][2] == res[1][2]
    assert sorted(r[1] for r in res) == [False, True], res
    assert not [n for n in os.listdir(tmp_path / "shared") if n.startswith(".tmp")]


def test_waits_for_lock_holder(tmp_path):
    data = make_coco(5, n_images=20)
    cat = write_dataset(str(tmp_path), "d", data)
    make_proposals(1, data, str(tmp_path / "p.pkl"))
    probe = combined_roidb_for_training("d", [str(tmp_path / "p.pkl")], get_cfg(),
                                        str(tmp_path / "probe"), catalog=cat, trust_pickle=True)
    key_dir = os.path.basename(probe.path)
    os.makedirs(tmp_path / "shared")
    lock = FileLock(str(tmp_path / "shared" / (key_dir + ".lock")))
    lock.acquire()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(cat, tmp_path, q))
    p.start()
    time.sleep(1.0)
    assert q.empty() and p.is_alive()  # blocked on the lock
    lock.release()
    path, built, n = q.get(timeout=60)
    p.join(30)
    assert built and os.path.basename(path) == key_dir and n == len(probe)


_FORKED_WORKER_PROBE = r"""
import gc, json, sys
import torch.utils.data
from lit_roidata.config import get_cfg
from lit_roidata.roidb import combined_roidb_for_training
from roidb_fixtures import make_coco, make_proposals, write_dataset


def anon_kb():
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1])
    return 0


class Touch:  # one item that reads every entry of the roidb in the worker
    def __init__(self, db):
        self.db = db

    def __len__(self):
        return 1

    def __getitem__(self, _):
        before, total = anon_kb(), 0.0
        for i in range(len(self.db)):
            e = self.db[i]
            total += float(e["boxes"].sum()) + len(e["segms"]) + float(e["max_overlaps"].sum())
        return before, anon_kb(), total


tmp, deltas = sys.argv[1], {}
for n in (200, 1600):
    data = make_coco(n, n_images=n, max_anns=6)
    cat = write_dataset(tmp, f"d{n}", data, images=False)
    make_proposals(2, data, f"{tmp}/p{n}.pkl", per_image=60)
    db = combined_roidb_for_training(f"d{n}", [f"{tmp}/p{n}.pkl"], get_cfg(), f"{tmp}/c",
                                     catalog=cat, check_images=False, trust_pickle=True)
    gc.collect()
    gc.freeze()  # keep the parent's GC from touching (copying) every object in the child
    loader = torch.utils.data.DataLoader(Touch(db), batch_size=None, num_workers=1,
                                         multiprocessing_context="fork")
    (before, after, total), = list(loader)
    gc.unfreeze()
    assert total > 0
    deltas[n] = after - before
print(json.dumps(deltas))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup"), reason="needs Linux smaps")
def test_forked_workers_do_not_grow_with_roidb_size(tmp_path):
    """Measured in a fresh interpreter started for this test, so what earlier tests left
    in this process (heap, imported modules, GC state) cannot change the result."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _FORKED_WORKER_PROBE, str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    deltas = {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}
    # Private dirty memory (copy-on-write + new allocations) a worker adds by reading every
    # entry: small, and not proportional to the roidb (8x more entries).
    assert deltas[1600] < 16 * 1024, deltas
    assert deltas[1600] - deltas[200] < 8 * 1024, deltas


def _damage(fn, how):
    size = os.path.getsize(fn)
    with open(fn, "r+b") as fh:
        if how == "zero":  # what a power loss leaves: right size, zeros
            fh.write(b"\0" * size)
        elif how == "zero_tail":  # header intact, data zeroed
            fh.seek(128)
            fh.write(b"\0" * (size - 128))
        else:  # one flipped bit in the data
            fh.seek(size - 3)
            b = fh.read(1)
            fh.seek(size - 3)
            fh.write(bytes([b[0] ^ 0x10]))


@pytest.mark.parametrize("how", ["zero", "zero_tail", "flip"])
def test_damaged_array_file_is_named_and_rebuilt(ds, caplog, how):
    from lit_roidata.roidb.cache import verify_checksums

    cat, _, tmp = ds
    a = _build(cat, tmp)
    ref = [a[i]["boxes"].copy() for i in range(len(a))]
    fn = os.path.join(a.path, "gt_boxes.npy")
    _damage(fn, how)
    with pytest.raises(CacheError, match=r"gt_boxes\.npy"):
        verify_checksums(a.path)
    if how == "zero":  # the header is gone: even a plain open names the file, never unpickles
        with pytest.raises(CacheError, match=r"gt_boxes\.npy has a damaged header"):
            RoIDB(a.path)
    # the next build verifies on request (and on the first open after a boot) and rebuilds
    with caplog.at_level(logging.WARNING):
        b = _build(cat, tmp, verify=True)
    assert any("unusable" in r.getMessage() and "gt_boxes.npy" in r.getMessage()
               for r in caplog.records)
    assert len(b) == len(ref)
    for i in range(len(b)):
        np.testing.assert_array_equal(b[i]["boxes"], ref[i])
    verify_checksums(b.path)


def test_checksums_verified_on_first_open_after_a_boot(ds, caplog, monkeypatch):
    from lit_roidata.roidb import cache as cache_mod

    cat, _, tmp = ds
    a = _build(cat, tmp)
    _damage(os.path.join(a.path, "gt_classes.npy"), "flip")
    assert _build(cat, tmp).path == a.path  # same boot: the cheap open does not read it all
    monkeypatch.setattr(cache_mod, "_boot_id", lambda: "another-boot")
    with caplog.at_level(logging.WARNING):
        _build(cat, tmp)
    assert any("gt_classes.npy is damaged" in r.getMessage() for r in caplog.records)


def test_cache_tool_ls_clean_verify(ds, capsys):
    from lit_roidata.cli import main

    cat, _, tmp = ds
    root = str(tmp / "c")
    a = _build(cat, tmp)
    key = os.path.basename(a.path)[len("roidb-"):]
    assert main(["cache", "--cache-dir", root, "ls"]) == 0
    out = capsys.readouterr().out
    assert key[:8] in out and "in use" in out and "d" in out
    assert main(["cache", "--cache-dir", root, "verify"]) == 0
    assert "ok" in capsys.readouterr().out
    # in use: never removed
    assert main(["cache", "--cache-dir", root, "clean", "--all"]) == 0
    assert "kept roidb-" in capsys.readouterr().out and os.path.isdir(a.path)
    path = a.path
    del a
    gc.collect()
    _damage(os.path.join(path, "gt_boxes.npy"), "flip")
    assert main(["cache", "--cache-dir", root, "verify"]) == 1
    assert "DAMAGED" in capsys.readouterr().out
    assert main(["cache", "--cache-dir", root, "clean", "--older-than", "1"]) == 0
    assert os.path.isdir(path)  # used just now
    assert main(["cache", "--cache-dir", root, "clean", "--key", key[:6], "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out and os.path.isdir(path)
    assert main(["cache", "--cache-dir", root, "clean", "--key", key[:6]]) == 0
    assert not os.path.exists(path)
    with pytest.raises(SystemExit):  # nothing is removed without an explicit choice
        main(["cache", "--cache-dir", root, "clean"])


@pytest.mark.parametrize("algo", ["blake2b", "xxh3_128"])
def test_checksum_algorithms(ds, monkeypatch, algo):
    from lit_roidata.roidb import cache as cache_mod

    if algo == "xxh3_128":
        pytest.importorskip("xxhash")
    monkeypatch.setattr(cache_mod, "default_algo", lambda: algo)
    cat, _, tmp = ds
    a = _build(cat, tmp, cache=f"c-{algo}")
    recs = a.manifest["arrays"].values()
    assert all(r["checksum"].startswith(algo + ":") for r in recs)
    cache_mod.verify_checksums(a.path)
    _damage(os.path.join(a.path, "img_id.npy"), "flip")
    with pytest.raises(CacheError, match=rf"img_id\.npy is damaged \(its {algo} checksum"):
        cache_mod.verify_checksums(a.path)


@pytest.mark.parametrize("algo", ["blake2b", "xxh3_128"])
def test_write_arrays_checksums_the_written_bytes(tmp_path, monkeypatch, algo):
    """The digest is taken while writing (no read-back) and equals the file's digest; the
    files are byte for byte what ``np.save`` writes."""
    from lit_roidata.roidb import cache as cache_mod

    if algo == "xxh3_128":
        pytest.importorskip("xxhash")
    monkeypatch.setattr(cache_mod, "default_algo", lambda: algo)
    arrays = {"i": np.arange(10, dtype=np.int64), "empty": np.zeros((0, 4), np.float32),
              "b": np.array([True, False, True]), "strided": np.arange(12, dtype=np.int16)
              .reshape(3, 4)[:, ::2], "u8": np.frombuffer(b"abc", np.uint8),
              "zero_dim": np.zeros((2, 3, 0), np.int32), "k": np.ones((5, 3, 17), np.int32)}
    manifest = cache_mod.write_arrays(str(tmp_path), arrays)
    for name, arr in arrays.items():
        fn = tmp_path / f"{name}.npy"
        np.save(tmp_path / f"ref_{name}.npy", arr)
        assert fn.read_bytes() == (tmp_path / f"ref_{name}.npy").read_bytes(), name
        rec = manifest[name]
        assert rec["bytes"] == fn.stat().st_size
        assert rec["checksum"] == f"{algo}:{cache_mod.file_digest(str(fn), algo)}"


def test_write_arrays_leaves_zero_blocks_as_holes(tmp_path, monkeypatch):
    """All-zero blocks are not written (holes read back as zeros); the file's bytes and
    checksum are those of the array."""
    from lit_roidata.roidb import cache as cache_mod

    block = cache_mod._WRITE_BLOCK
    arr = np.zeros(3 * block + 100, np.uint8)
    arr[block + 5] = 7  # only the second block (and the header) hold non-zero bytes
    written = []
    real = cache_mod.pwrite_all

    def spy(fd, offset, data, *args):
        written.append((offset, memoryview(data).nbytes))
        real(fd, offset, data, *args)

    monkeypatch.setattr(cache_mod, "pwrite_all", spy)
    rec = cache_mod.write_arrays(str(tmp_path), {"z": arr})["z"]
    np.save(tmp_path / "ref.npy", arr)
    assert (tmp_path / "z.npy").read_bytes() == (tmp_path / "ref.npy").read_bytes()
    header = rec["bytes"] - arr.nbytes
    assert sorted(written) == [(0, header), (header + block, block)]
    assert rec["checksum"].split(":")[1] == cache_mod.file_digest(
        str(tmp_path / "z.npy"), rec["checksum"].split(":")[0])


def test_open_maps_without_parsing_and_accepts_other_header_layouts(ds):
    """Files whose header says exactly the manifest's dtype and shape are mapped at once
    (NumPy's 1.0 and 2.0 layouts alike); a header written differently (keys in another
    order) still opens, through NumPy's parser; the per-entry columns are gathered on
    first use."""
    from lit_roidata.roidb.cache import npy_data_offset

    cat, _, tmp = ds
    a = _build(cat, tmp)
    recs = a.manifest["arrays"]
    assert all(npy_data_offset(os.path.join(a.path, r["file"]), r) for r in recs.values())
    ref = [a[i].to_dict() for i in range(len(a))]
    fn = os.path.join(a.path, "gt_boxes.npy")
    boxes = np.load(fn)
    with open(fn, "wb") as fh:
        np.lib.format.write_array(fh, boxes, version=(2, 0))
    assert npy_data_offset(fn, recs["gt_boxes"]) == 128
    text = f"{{'shape': {boxes.shape}, 'fortran_order': False, 'descr': '<f4'}}".encode()
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    with open(fn, "wb") as fh:
        fh.write(b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text)
        fh.write(boxes.tobytes())
    assert npy_data_offset(fn, recs["gt_boxes"]) is None
    rec = dict(recs["gt_boxes"], bytes=os.path.getsize(fn))
    a.manifest["arrays"]["gt_boxes"] = rec
    b = RoIDB(a.path, a.manifest)
    assert "widths" not in vars(b) and "ids" not in vars(b)
    np.testing.assert_array_equal(b.widths, np.asarray(b.column("img_width"))[b.entry_image_rows])
    for i, e in enumerate(ref):
        np.testing.assert_array_equal(b[i]["boxes"], e["boxes"])
        assert b[i]["dataset"] == e["dataset"] and b.dataset_of(i) == "d"


def test_durable_writes_start_the_writeback(tmp_path, monkeypatch):
    """Each durable block write asks the kernel to start writing it out, so the fsync
    before the cache is published waits less (Python's ``os`` has no sync_file_range:
    it comes from the C library)."""
    from lit_roidata import osutil
    from lit_roidata.roidb import cache as cache_mod

    if sys.platform.startswith("linux"):
        assert osutil._libc("sync_file_range") is not None
    calls = []
    monkeypatch.setattr(cache_mod, "start_writeback",
                        lambda fd, off, n: calls.append((off, n)) or osutil.start_writeback(
                            fd, off, n))
    fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR)
    try:
        cache_mod.pwrite_all(fd, 4096, b"x" * 10000)
        cache_mod.pwrite_all(fd, 0, b"y" * 100, False)  # scratch writes: no hint
        osutil.start_writeback(-1, 0, 10)  # a hint only: errors are ignored
    finally:
        os.close(fd)
    assert calls == [(4096, 10000)]
    assert (tmp_path / "f").read_bytes() == b"y" * 100 + b"\0" * 3996 + b"x" * 10000


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the builder is forked")
def test_the_forked_builder_keeps_freed_memory(ds, monkeypatch):
    """Before the proposal chunks, the forked builder (and only it: it exits after the
    build) tells glibc to keep freed memory, so chunk after chunk reuses pages instead of
    faulting in new ones; a gt-only build and an in-process build leave malloc alone."""
    from lit_roidata import osutil
    from lit_roidata.roidb import build as build_mod

    if sys.platform.startswith("linux"):
        assert osutil._libc("mallopt") is not None
    cat, _, tmp = ds
    marker = tmp / "kept"
    monkeypatch.delenv("LIT_ROIDATA_BUILD_IN_PROCESS", raising=False)
    parent = os.getpid()
    monkeypatch.setattr(build_mod, "keep_freed_memory",
                        lambda: marker.write_text(str(os.getpid() != parent)))
    _build(cat, tmp, progress=False)
    assert not marker.exists()  # no proposals: the gt build keeps glibc's defaults
    props = make_proposals(3, ds[1], str(tmp / "p.pkl"))
    _build(cat, tmp, cache="c2", progress=False, proposals=[props])
    assert marker.read_text() == "True"
    marker.unlink()
    monkeypatch.setenv("LIT_ROIDATA_BUILD_IN_PROCESS", "1")
    _build(cat, tmp, cache="c3", progress=False, proposals=[props])
    assert not marker.exists()


def test_writeback_hint_starts_only_whole_2mib_spans(monkeypatch):
    """A folio at either end of a write may be shared with a write not done yet: started
    early it would be dirtied, and counted in the bytes written, twice."""
    from lit_roidata import osutil

    got = []
    monkeypatch.setattr(osutil, "_libc", lambda name: (
        lambda fd, off, n, flags: got.append((fd, off.value, n.value, flags)))
        if name == "sync_file_range" else None)
    mib = 1 << 20
    osutil.start_writeback(7, 100, 5 * mib)  # [100, 5 MiB + 100): the span [2, 4) MiB
    osutil.start_writeback(7, 0, 4 * mib)  # aligned: all of it
    osutil.start_writeback(7, 3 * mib, 2 * mib)  # [3, 5) MiB holds no whole span: nothing
    assert got == [(7, 2 * mib, 2 * mib, 2), (7, 0, 4 * mib, 2)]
