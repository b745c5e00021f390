"""Proposal columns written once, in narrow dtypes (issue #21).

* the dtype choice at its edges (class count, most gt boxes of an image);
* a build stores ``prop_max_classes`` / ``prop_gt_map`` narrow, and a cache holding them
  as int32 (what earlier versions wrote, under the same content key) opens and gives
  bit-identical entries and Fast R-CNN blobs;
* LVIS-sized class counts and images with more than 127 gt boxes (int16), and images
  without gt;
* the pickle staged in memory or spilled to a scratch file gives the same cache bytes;
* the bytes a build writes stay within 1.2x the cache it leaves (``/proc/self/io``).
"""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest

from lit_roidata.config import get_cfg
from lit_roidata.minibatch.fast_rcnn import add_fast_rcnn_blobs
from lit_roidata.roidb import combined_roidb_for_training
from lit_roidata.roidb.cache import write_arrays
from lit_roidata.roidb.columnar import RoIDB
from lit_roidata.roidb.proposal_files import STAGING_ENV, read_proposal_file
from lit_roidata.roidb.proposals import ProposalColumns, build_proposal_table, proposal_dtypes
from roidb_fixtures import make_coco, make_proposals, write_dataset


@pytest.mark.parametrize("num_classes,want", [(2, np.uint8), (81, np.uint8), (256, np.uint8),
                                              (257, np.int16), (1204, np.int16),
                                              (32768, np.int16), (32769, np.int32)])
def test_max_classes_dtype_by_class_count(num_classes, want):
    mc, _ = proposal_dtypes(num_classes, 5)
    assert mc == np.dtype(want)
    assert np.iinfo(mc).max >= num_classes - 1  # every contiguous class id fits
    assert np.iinfo(mc).min <= 0


@pytest.mark.parametrize("max_gt,want", [(0, np.int8), (1, np.int8), (127, np.int8),
                                         (128, np.int8), (129, np.int16), (32768, np.int16),
                                         (32769, np.int32)])
def test_gt_map_dtype_by_gt_count(max_gt, want):
    _, gm = proposal_dtypes(81, max_gt)
    assert gm == np.dtype(want)
    assert np.iinfo(gm).min <= -1 and np.iinfo(gm).max >= max_gt - 1


def test_columns_refuse_values_beyond_their_bounds(tmp_path):
    cols = ProposalColumns(str(tmp_path), num_classes=81, max_gt=3)
    b, mo = np.zeros((2, 4), np.float32), np.zeros(2, np.float32)
    with pytest.raises(RuntimeError, match="max_classes"):
        cols.append(b, mo, np.array([0, 81]), np.array([-1, 0]))
    with pytest.raises(RuntimeError, match="gt_map"):
        cols.append(b, mo, np.array([0, 80]), np.array([-1, 3]))
    cols.close()


# ----------------------------------------------------------------------------- helpers
def _same(a, b) -> bool:
    if hasattr(a, "toarray"):
        a, b = a.toarray(), b.toarray()
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return a == b


def _assert_same_roidb(d1: RoIDB, d2: RoIDB) -> None:
    assert len(d1) == len(d2)
    for i in range(len(d1)):
        e1, e2 = d1[i].to_dict(), d2[i].to_dict()
        assert list(e1) == list(e2)
        for k in e1:
            assert _same(e1[k], e2[k]), (i, k)


def _assert_same_blobs(d1: RoIDB, d2: RoIDB, num_classes: int) -> None:
    cfg = get_cfg()
    cfg.merge_from_dict({"MODEL.NUM_CLASSES": num_classes, "TRAIN.BATCH_SIZE_PER_IM": 64})
    for k in range(0, len(d1) - 1, 2):
        b1, b2 = {}, {}
        v1 = add_fast_rcnn_blobs(b1, [0.8, 1.5], [d1[k], d1[k + 1]], cfg,
                                 np.random.RandomState(k))
        v2 = add_fast_rcnn_blobs(b2, [0.8, 1.5], [d2[k], d2[k + 1]], cfg,
                                 np.random.RandomState(k))
        assert v1 == v2 and list(b1) == list(b2)
        for name in b1:
            assert _same(b1[name], b2[name]), name


def _widen_in_place(path: str) -> None:
    """Rewrite a cache's class / gt-index proposal columns as int32 (the layout written
    before narrow dtypes, under the same key), manifest and checksums included."""
    with open(os.path.join(path, "manifest.json")) as fh:
        manifest = json.load(fh)
    wide = {}
    for name in ("prop_max_classes", "prop_gt_map"):
        wide[name] = np.load(os.path.join(path, name + ".npy")).astype(np.int32)
        os.unlink(os.path.join(path, name + ".npy"))
    manifest["arrays"].update(write_arrays(path, wide))
    with open(os.path.join(path, "manifest.json"), "w") as fh:
        json.dump(manifest, fh)


def _build(tmp_path, data, *, per_image=40, name="ds", cache="cache", seed=3, **kw):
    cat = write_dataset(str(tmp_path), name, data)
    pfile = make_proposals(seed, data, str(tmp_path / f"{name}.pkl"), per_image=per_image)
    db = combined_roidb_for_training(name, [pfile], get_cfg(), str(tmp_path / cache),
                                     catalog=cat, progress=False, trust_pickle=True, **kw)
    return db, pfile, cat


# ----------------------------------------------------------------------------- narrow vs wide
def test_narrow_columns_and_old_int32_cache_give_identical_entries_and_blobs(tmp_path):
    data = make_coco(11, 12, max_anns=6)
    db, pfile, cat = _build(tmp_path, data)
    dt = {n: r["dtype"] for n, r in db.manifest["arrays"].items()}
    assert dt["prop_max_classes"] == "|u1" and dt["prop_gt_map"] == "|i1"
    assert dt["prop_boxes"] == "<f4" and dt["prop_max_overlaps"] == "<f4"
    mc = np.asarray(db._a["prop_max_classes"])
    gm = np.asarray(db._a["prop_gt_map"])
    assert mc.max() > 0 and gm.min() == -1 and gm.max() >= 1  # the test sees real values
    # the same cache with int32 columns, as earlier versions wrote it (same content key)
    old = tmp_path / "old"
    import shutil

    shutil.copytree(db.path, old)
    _widen_in_place(str(old))
    db_old = RoIDB(str(old))
    assert db_old.manifest["arrays"]["prop_gt_map"]["dtype"] == "<i4"
    _assert_same_roidb(db, db_old)
    _assert_same_blobs(db, db_old, 4)
    # an int32 cache in place is opened, checksums verified, not rebuilt
    path = db.path
    del db
    _widen_in_place(path)
    again = combined_roidb_for_training("ds", [pfile], get_cfg(), str(tmp_path / "cache"),
                                        catalog=cat, progress=False, trust_pickle=True,
                                        verify=True)
    assert again.path == path
    assert again.manifest["arrays"]["prop_max_classes"]["dtype"] == "<i4"
    _assert_same_roidb(again, db_old)


def test_gt_only_cache_keeps_int32_empty_columns(tmp_path):
    data = make_coco(5, 4)
    cat = write_dataset(str(tmp_path), "g", data)
    db = combined_roidb_for_training("g", (), get_cfg(), str(tmp_path / "c"), catalog=cat,
                                     progress=False)
    for name in ("prop_max_classes", "prop_gt_map"):
        assert db.manifest["arrays"][name]["dtype"] == "<i4"
        assert db.manifest["arrays"][name]["shape"] == [0]


def _many_gt_dataset(n_classes: int, big_gt: int) -> dict:
    """Images: one with ``big_gt`` boxes (classes beyond 255 when there are that many), one
    with none, one ordinary."""
    cats = [{"id": 1000 + k, "name": f"c{k}"} for k in range(n_classes)]
    images = [{"id": i, "width": 640, "height": 480, "file_name": f"{i}.jpg"}
              for i in (1, 2, 3)]
    anns, aid = [], 1
    rng = np.random.default_rng(0)
    for iid, n in ((1, big_gt), (3, 4)):
        for j in range(n):
            x, y = float(rng.uniform(0, 600)), float(rng.uniform(0, 440))
            c = cats[(j * 37 + iid) % n_classes]["id"] if j else cats[-1]["id"]
            anns.append({"id": aid, "image_id": iid, "category_id": c,
                         "bbox": [x, y, 30.0, 30.0], "area": 900.0, "iscrowd": 0,
                         "segmentation": [[x, y, x + 30, y, x + 30, y + 30]]})
            aid += 1
    return {"images": images, "annotations": anns, "categories": cats}


def _gt_proposals(data: dict, path: str) -> str:
    """Each gt box as a proposal (so gt indices and classes up to the last appear), plus
    random boxes; image 2 (no gt) gets random boxes only."""
    rng = np.random.default_rng(1)
    by_img: dict = {}
    for a in data["annotations"]:
        x, y, w, h = a["bbox"]
        by_img.setdefault(a["image_id"], []).append([x + 1, y, x + w, y + h - 1])
    boxes, scores, ids = [], [], []
    for im in data["images"]:
        b = np.array(by_img.get(im["id"], []) + rng.uniform(0, 400, (20, 4)).tolist(),
                     np.float32)
        b[:, 2:] = np.maximum(b[:, 2:], b[:, :2] + 5)
        boxes.append(b)
        scores.append(np.linspace(1, 0, len(b), dtype=np.float32))
        ids.append(im["id"])
    with open(path, "wb") as fh:
        pickle.dump({"boxes": boxes, "scores": scores, "ids": ids}, fh)
    return path


@pytest.mark.parametrize("n_classes,big_gt,mc_dt,gm_dt", [
    (1203, 200, "<i2", "<i2"),   # LVIS: 1204 classes with background; > 127 gt boxes
    (80, 128, "|u1", "|i1"),     # COCO: 81 classes; 128 gt boxes still fit int8 (max 127)
    (255, 129, "|u1", "<i2"),    # 256 classes fit uint8; 129 gt boxes need int16
])
def test_dtype_edges_in_a_build(tmp_path, n_classes, big_gt, mc_dt, gm_dt):
    data = _many_gt_dataset(n_classes, big_gt)
    cat = write_dataset(str(tmp_path), "lv", data)
    pfile = _gt_proposals(data, str(tmp_path / "lv.pkl"))
    cfg = get_cfg()
    cfg.merge_from_dict({"TRAIN.USE_FLIPPED": False})
    db = combined_roidb_for_training("lv", [pfile], cfg, str(tmp_path / "c"), catalog=cat,
                                     progress=False, trust_pickle=True)
    rec = db.manifest["arrays"]
    assert rec["prop_max_classes"]["dtype"] == mc_dt and rec["prop_gt_map"]["dtype"] == gm_dt
    # the values are those of a wide (int32) processing of the same file
    table = db._a
    img = np.argsort([1, 2, 3])
    gt_off = np.asarray(table["img_gt_off"])
    wide = build_proposal_table(
        read_proposal_file(pfile, trust_pickle=True), image_ids=np.asarray(table["img_id"]),
        widths=np.asarray(table["img_width"]), heights=np.asarray(table["img_height"]),
        gt_off=gt_off, gt_boxes=np.asarray(table["gt_boxes"]),
        gt_classes=np.asarray(table["gt_classes"]), gt_is_crowd=np.asarray(table["gt_is_crowd"]))
    assert wide.max_classes.dtype == np.int32 and wide.gt_map.dtype == np.int32
    np.testing.assert_array_equal(np.asarray(table["prop_max_classes"]), wide.max_classes)
    np.testing.assert_array_equal(np.asarray(table["prop_gt_map"]), wide.gt_map)
    assert int(wide.gt_map.max()) == big_gt - 1  # the last gt index is stored exactly
    assert int(wide.max_classes.max()) == n_classes  # so is the last class
    assert img.size == 3
    # entries widen to Detectron's dtypes; the image without gt has only -1 / 0 rows
    for i in range(len(db)):
        e = db[i]
        assert e["max_classes"].dtype == np.int64
        assert e["box_to_gt_ind_map"].dtype == np.int32
        if e["id"] == 2:
            assert (e["box_to_gt_ind_map"] == -1).all() and (e["max_classes"] == 0).all()
        if e["id"] == 1:
            assert int(e["box_to_gt_ind_map"].max()) == big_gt - 1
    # an old int32 cache of the same data gives the same entries and blobs
    old = tmp_path / "old"
    import shutil

    shutil.copytree(db.path, old)
    _widen_in_place(str(old))
    _assert_same_roidb(db, RoIDB(str(old)))


# ----------------------------------------------------------------------------- staging, bytes
def _cache_arrays(path: str) -> dict:
    with open(os.path.join(path, "manifest.json")) as fh:
        recs = json.load(fh)["arrays"]
    out = {}
    for name, r in recs.items():
        with open(os.path.join(path, r["file"]), "rb") as fh:
            out[name] = fh.read()
    return out


def test_memory_and_spilled_staging_give_the_same_cache(tmp_path, monkeypatch):
    data = make_coco(21, 10, max_anns=5)
    db_mem, pfile, cat = _build(tmp_path, data, per_image=60)
    # a budget of a few arrays: the staging spills to a scratch file mid-file
    monkeypatch.setenv(STAGING_ENV, "3000")
    db_spill = combined_roidb_for_training("ds", [pfile], get_cfg(), str(tmp_path / "c2"),
                                           catalog=cat, progress=False, trust_pickle=True)
    monkeypatch.setenv(STAGING_ENV, "0")  # everything in the scratch file
    db_file = combined_roidb_for_training("ds", [pfile], get_cfg(), str(tmp_path / "c3"),
                                          catalog=cat, progress=False, trust_pickle=True)
    a = _cache_arrays(db_mem.path)
    assert a == _cache_arrays(db_spill.path) == _cache_arrays(db_file.path)
    assert len(a["prop_boxes"]) > 128


def test_source_without_scores_reads_the_same_boxes(tmp_path, monkeypatch):
    data = make_coco(8, 7)
    pfile = make_proposals(4, data, str(tmp_path / "p.pkl"), per_image=30)
    for budget in ("0", "500", str(1 << 30)):
        monkeypatch.setenv(STAGING_ENV, budget)
        full = read_proposal_file(pfile, trust_pickle=True)
        lean = read_proposal_file(pfile, trust_pickle=True, scores=False)
        assert lean.scores_of is None and lean.scores_flat is None
        assert full.scores_of is not None
        np.testing.assert_array_equal(full.ids, lean.ids)
        np.testing.assert_array_equal(full.counts, lean.counts)
        for i in range(full.ids.size):
            assert _same(full.boxes_of(i), lean.boxes_of(i))


def test_float_ids_array_falls_back_to_keeping_everything(tmp_path):
    boxes = [np.array([[1, 2, 30, 40]], np.float32), np.zeros((0, 4), np.float32)]
    scores = [np.array([0.5], np.float32), np.zeros(0, np.float32)]
    path = str(tmp_path / "f.pkl")
    with open(path, "wb") as fh:  # ids as a 1-D float array (dropped at first, then kept)
        pickle.dump({"boxes": boxes, "scores": scores, "ids": np.array([7.0, 9.0])}, fh)
    src = read_proposal_file(path, trust_pickle=True, scores=False)
    assert src.ids.tolist() == [7, 9]
    assert _same(src.boxes_of(0), boxes[0])


def _write_bytes() -> int:
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    raise OSError("no write_bytes")


def _io_measurable(tmp_path) -> bool:
    try:
        before = _write_bytes()
    except OSError:
        return False
    probe = tmp_path / "probe"
    with open(probe, "wb") as fh:
        fh.write(b"x" * (1 << 20))
        fh.flush()
        os.fsync(fh.fileno())
    probe.unlink()
    return _write_bytes() - before >= 1 << 20


def test_build_writes_each_proposal_column_once(tmp_path, monkeypatch):
    """Bytes written by the whole build (in this process) <= 1.2x the cache it leaves.

    Staging the pickle in a scratch file, writing the columns to scratch files and
    copying them into the cache (what the build did before) writes about 3x.
    """
    if not _io_measurable(tmp_path):
        pytest.skip("this filesystem does not account written bytes in /proc/self/io")
    data = make_coco(31, 300, max_anns=3)
    cat = write_dataset(str(tmp_path), "big", data, images=False)
    rng = np.random.default_rng(0)
    boxes = [np.sort(rng.uniform(0, 100, (1500, 4)).astype(np.float32).reshape(-1, 2, 2),
                     axis=1).reshape(-1, 4) for _ in data["images"]]
    pfile = str(tmp_path / "big.pkl")
    with open(pfile, "wb") as fh:
        pickle.dump({"boxes": boxes, "scores": [np.linspace(1, 0, 1500, dtype=np.float32)
                                                for _ in boxes],
                     "ids": [im["id"] for im in data["images"]]}, fh, protocol=4)
    monkeypatch.setenv("LIT_ROIDATA_BUILD_IN_PROCESS", "1")
    monkeypatch.delenv(STAGING_ENV, raising=False)
    cfg = get_cfg()
    cache = tmp_path / "cache"
    os.makedirs(cache)
    before = _write_bytes()
    db = combined_roidb_for_training("big", [pfile], cfg, str(cache), catalog=cat,
                                     progress=False, trust_pickle=True, check_images=False)
    written = _write_bytes() - before
    size = sum(os.path.getsize(os.path.join(db.path, f)) for f in os.listdir(db.path))
    assert db.manifest["arrays"]["prop_boxes"]["shape"][0] > 250_000  # proposals dominate
    print(f"wrote {written} bytes for a {size}-byte cache ({written / size:.2f}x)")
    assert written <= 1.2 * size, f"wrote {written} bytes for a {size}-byte cache"


def test_padded_header_loads_and_no_kept_proposal_gives_empty_narrow_columns(tmp_path):
    from lit_roidata.roidb.cache import npy_header

    for pad in (0, 128, 192, 256):
        head = npy_header(np.dtype("<i2"), (3,), pad_to=pad)
        assert len(head) == max(pad, 128) and len(head) % 64 == 0
        fn = tmp_path / f"h{pad}.npy"
        fn.write_bytes(head + np.array([-1, 5, 300], "<i2").tobytes())
        assert np.load(fn).tolist() == [-1, 5, 300]
        assert np.load(fn, mmap_mode="r").dtype == np.dtype("<i2")
    # every proposal is too small: the columns exist, empty, in their narrow dtypes
    data = make_coco(2, 4)
    cat = write_dataset(str(tmp_path), "t", data)
    pfile = str(tmp_path / "t.pkl")
    with open(pfile, "wb") as fh:
        pickle.dump({"boxes": [np.array([[1, 1, 2, 2]], np.float32) for _ in data["images"]],
                     "scores": [np.ones(1, np.float32) for _ in data["images"]],
                     "ids": [im["id"] for im in data["images"]]}, fh)
    db = combined_roidb_for_training("t", [pfile], get_cfg(), str(tmp_path / "c"), catalog=cat,
                                     progress=False, trust_pickle=True, verify=True)
    rec = db.manifest["arrays"]
    assert rec["prop_boxes"]["shape"] == [0, 4] and rec["prop_max_classes"]["dtype"] == "|u1"
    assert db.report["datasets"][0]["proposals"]["proposals_min_size"] == len(data["images"])
