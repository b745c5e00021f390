"""``DatasetCatalog.register(name, func, thing_classes=...)``: Detectron2's standard dataset
dicts through the same roidb build as a COCO json (docs/custom_datasets.md)."""

from __future__ import annotations

import copy
import json
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from d2_support import d2_src
from roidb_fixtures import make_coco, write_dataset
from lit_roidata.catalog import Catalog
from lit_roidata.config import get_cfg
from lit_roidata.demo.data import ensure_demo_data
from lit_roidata.roidb.build import combined_roidb_for_training
from lit_roidata.roidb.coco import load_coco_json
from lit_roidata.roidb.dicts import load_records
from lit_roidata.roidb.info import RoIDBInputError

SMALL = {"demo_train_a": 10, "demo_train_b": 1, "demo_val": 1}


def to_dicts(data: dict, image_dir: str, *, xyxy: bool = False, extra: tuple = ()):
    """What Detectron2's ``load_coco_json`` gives for ``data`` (a generator): full paths,
    contiguous category ids in sorted-id order, keypoints + 0.5, no ``area`` (but the
    ``extra`` annotation keys)."""
    cmap = {c: i for i, c in enumerate(sorted(c["id"] for c in data["categories"]))}
    by_image: dict = {}
    for a in data["annotations"]:
        by_image.setdefault(a["image_id"], []).append(a)
    for im in data["images"]:
        anns = []
        for a in by_image.get(im["id"], []):
            x, y, w, h = a["bbox"]
            d = {"bbox": [x, y, x + w, y + h] if xyxy else list(a["bbox"]),
                 "bbox_mode": 0 if xyxy else 1, "category_id": cmap[a["category_id"]],
                 "iscrowd": a.get("iscrowd", 0), "segmentation": a.get("segmentation")}
            if "keypoints" in a:
                d["keypoints"] = [v + 0.5 if i % 3 != 2 else v
                                  for i, v in enumerate(a["keypoints"])]
            d.update({k: a[k] for k in extra if k in a})
            anns.append(d)
        yield {"file_name": os.path.join(image_dir, im["file_name"]), "height": im["height"],
               "width": im["width"], "image_id": im["id"], "annotations": anns}


def _classes(data: dict) -> list:
    return [c["name"] for c in sorted(data["categories"], key=lambda c: c["id"])]


def _kp_names(data: dict):
    return next((c["keypoints"] for c in data["categories"] if c.get("keypoints")), None)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    info = ensure_demo_data(root, num_images=SMALL)["demo_train_a"]
    with open(info["annotation_file"]) as fh:
        return info, json.load(fh), str(root)


def _same_blobs(a, b, cfg) -> None:
    """Every roidb entry equal (but the dataset's json id map) and the minibatch blobs of
    every entry equal."""
    from lit_roidata.minibatch import get_minibatch

    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert set(x) == set(y)
        for k in set(x) - {"dataset", "segms"}:
            vx, vy = x[k], y[k]
            vx, vy = (v.toarray() if hasattr(v, "toarray") else v for v in (vx, vy))
            assert np.array_equal(vx, vy) if isinstance(vx, np.ndarray) else vx == vy, k
        blobs_x, ok_x = get_minibatch([x], cfg, np.random.default_rng(1))
        blobs_y, ok_y = get_minibatch([y], cfg, np.random.default_rng(1))
        assert ok_x == ok_y and set(blobs_x) == set(blobs_y)
        for k in blobs_x:
            np.testing.assert_array_equal(blobs_x[k], blobs_y[k], err_msg=k)


def _mask_kp_cfg():
    cfg = get_cfg()
    cfg.merge_from_dict({"MODEL.NUM_CLASSES": 5, "MODEL.MASK_ON": True,
                         "MODEL.KEYPOINTS_ON": True, "KRCNN.NUM_KEYPOINTS": 17,
                         "KRCNN.HEATMAP_SIZE": 56, "TRAIN.SCALES": (96,),
                         "TRAIN.MAX_SIZE": 160, "TRAIN.BATCH_SIZE_PER_IM": 16})
    return cfg


def _both(demo, tmp_path, func):
    info, data, _ = demo
    cat = Catalog(builtins=False)
    cat.register("as_json", info["image_dir"], info["annotation_file"])
    cat.register("as_func", func, thing_classes=_classes(data), keypoint_names=_kp_names(data))
    cfg = _mask_kp_cfg()
    a, b = (combined_roidb_for_training(n, [info["proposal_file"]], cfg, str(tmp_path),
                                        catalog=cat) for n in ("as_json", "as_func"))
    _same_blobs(a, b, cfg)
    assert a.manifest["report"]["entries"] == b.manifest["report"]["entries"]
    return a, b


def test_blobs_equal_the_coco_path(demo, tmp_path):
    """The demo json registered as a json and as a generator of the equivalent dicts:
    the same entries (flips, proposals, filtering) and the same mask/keypoint blobs."""
    info, data, _ = demo
    a, b = _both(demo, tmp_path, lambda: to_dicts(data, info["image_dir"]))
    assert any(e["is_crowd"].any() for e in a) and any(e["flipped"] for e in b)
    assert [e["segms"] for e in a] == [e["segms"] for e in b]  # crowd RLE kept as given


def test_detectron2_load_coco_json_registered_unchanged(demo, tmp_path):
    """Detectron2's own ``load_coco_json`` (compressed RLE, keypoints + 0.5), registered as a
    Detectron2 user registers it: the blobs equal the COCO path's."""
    d2_load_coco_json = _d2_import("data.datasets.coco", "load_coco_json")
    info = demo[0]
    _both(demo, tmp_path, lambda: d2_load_coco_json(info["annotation_file"], info["image_dir"],
                                                    "lit_roidata_test_demo"))


def _table_arrays(t) -> dict:
    out = {k: getattr(t, k) for k in ("ids", "widths", "heights", "gt_off", "boxes", "classes",
                                      "seg_areas", "is_crowd", "keypoints", "has_vis_kp")}
    out.update(t.segms.arrays())
    return out


@settings(deadline=None, max_examples=20)
@given(st.integers(0, 10 ** 6), st.booleans(), st.integers(1, 7))
def test_table_equals_the_json_table(seed, xyxy, window):
    """For any generated COCO data (every cleaning rule), its dicts in either box mode and
    any window size give the json's table: boxes, classes, areas, segms, keypoints."""
    data = make_coco(seed, 9, keypoints=True)
    for a in data["annotations"]:  # quarters: x + w - x is exact (XYXY_ABS round trip)
        a["bbox"] = [round(v * 4) / 4 for v in a["bbox"]]
    cats = sorted(data["categories"], key=lambda c: c["id"])
    ref = load_coco_json("x.json", name="x", data=dict(data, categories=cats))
    got = load_records(to_dicts(data, "", xyxy=xyxy, extra=("area", "ignore")), name="x",
                       thing_classes=_classes(data), keypoint_names=_kp_names(data),
                       window=window)
    ra, ga = _table_arrays(ref), _table_arrays(got)
    for k in ra:
        np.testing.assert_array_equal(ga[k], ra[k], err_msg=k)
    assert got.file_names == ref.file_names and dict(got.counts) == dict(ref.counts)


def test_generator_consumed_lazily():
    """Many small records from a generator: never more than a window of them alive."""
    alive, peak = [0], [0]

    class Rec(dict):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])

        def __del__(self):
            alive[0] -= 1

    def gen():
        for i in range(5000):
            yield Rec(file_name=f"{i}.jpg", height=20, width=30, image_id=i + 1,
                      annotations=[{"bbox": [1, 2, 10, 8], "bbox_mode": 1,
                                    "category_id": i % 2}])

    t = load_records(gen(), name="many", thing_classes=["a", "b"], window=100)
    assert t.ids.size == t.classes.size == 5000 and peak[0] <= 102
    assert t.classes.tolist()[:4] == [1, 2, 1, 2] and t.seg_areas[0] == 80.0


def test_string_image_ids_are_positions():
    """Pascal VOC style ``"000005"`` ids: images are numbered by their position."""
    recs = [{"file_name": f"/x/{s}.jpg", "height": 10, "width": 10, "image_id": s,
             "annotations": []} for s in ("000009", "000005")]
    t = load_records(recs, name="voc", thing_classes=["a"])
    assert t.ids.tolist() == [0, 1] and t.file_names == ["/x/000009.jpg", "/x/000005.jpg"]


def test_area_without_an_area_key():
    """COCO's area stands in: the mask's as pycocotools measures it, else the box's."""
    square = [[2, 2, 12, 2, 12, 12, 2, 12], [0, 0, 1, 1]]  # the short one: not counted
    anns = [{"bbox": [2, 2, 10, 10], "bbox_mode": 1, "category_id": 0, "segmentation": square},
            {"bbox": [0, 0, 4, 5], "bbox_mode": 0, "category_id": 0, "iscrowd": 1,
             "segmentation": {"size": [20, 20], "counts": [5, 10, 385]}},
            {"bbox": np.array([1, 1, 3, 2], np.float32), "bbox_mode": 1, "category_id": 0}]
    t = load_records([{"file_name": "a.jpg", "height": np.int64(20), "width": 20,
                       "image_id": 7, "annotations": anns}], name="a", thing_classes=["x"])
    assert t.seg_areas.tolist() == [100.0, 10.0, 6.0] and t.ids.tolist() == [7]
    assert t.boxes.tolist() == [[2, 2, 11, 11], [0, 0, 3, 4], [1, 1, 3, 2]]


@pytest.mark.parametrize("change, words", [
    (lambda r: r.pop("height"), ["'bad'", "record #1", "image_id 2", "height", "Add them"]),
    (lambda r: r["annotations"][0].pop("bbox_mode"),
     ["'bad'", "record #1", "image_id 2", "annotation #0", "bbox_mode", "BoxMode"]),
    (lambda r: r["annotations"][0].update(bbox_mode=2),
     ["'bad'", "image_id 2", "XYXY_REL", "XYXY_ABS (0)", "XYWH_ABS (1)"]),
    (lambda r: r["annotations"][0].update(category_id=3),
     ["'bad'", "image_id 2", "category_id=3", "0..1", "thing_classes"]),
    (lambda r: r["annotations"].__setitem__(0, "x"), ["'bad'", "image_id 2", "a str, not"]),
])
def test_bad_records_named(change, words):
    recs = [{"file_name": f"{i}.jpg", "height": 10, "width": 10, "image_id": i + 1,
             "annotations": [{"bbox": [0, 0, 5, 5], "bbox_mode": 1, "category_id": 0}]}
            for i in range(3)]
    change(recs[1])
    with pytest.raises(RoIDBInputError) as exc:
        load_records(recs, name="bad", thing_classes=["a", "b"])
    assert all(w in str(exc.value) for w in words), str(exc.value)
    with pytest.raises(RoIDBInputError, match="'bad': the registered function returned None"):
        load_records(None, name="bad", thing_classes=["a"])


def test_catalog_registration_and_cache_key(tmp_path):
    """Files still register as before; a function needs thing_classes; a ``version`` keys
    the cache (a changed function reuses it), without one the records' content does."""
    data = make_coco(5, 6)
    cat = write_dataset(str(tmp_path), "files", data)
    image_dir = cat.get("files").image_dir
    with pytest.raises(ValueError, match="thing_classes"):
        cat.register("f", lambda: [])
    with pytest.raises(ValueError, match="annotation_file"):
        cat.register("g", image_dir)
    state = {"data": data}
    cat.register("v", lambda: to_dicts(state["data"], image_dir), thing_classes=_classes(data),
                 version="1")
    cat.register("h", lambda: to_dicts(state["data"], image_dir), thing_classes=_classes(data))
    assert cat.copy().get("v") == cat.get("v") and cat.get("v").format == "dicts"
    cfg, cache = get_cfg(), str(tmp_path / "cache")

    def path(name):
        return combined_roidb_for_training(name, (), cfg, cache, catalog=cat).path

    before = {n: path(n) for n in ("v", "h")}
    assert path("h") == before["h"]  # same content, same cache
    changed = copy.deepcopy(data)
    changed["annotations"][0]["bbox"][0] += 1
    state["data"] = changed
    assert path("v") == before["v"]  # the user's choice: same version, same cache
    assert path("h") != before["h"]
    state["data"] = dict(data, images=data["images"][:2] + [dict(data["images"][2],
                                                                 file_name="gone.jpg")])
    with pytest.raises(RoIDBInputError, match="gone.jpg"):  # raised in the build worker
        path("h")


def _d2_import(module: str, name: str):
    """``detectron2.<module>.<name>`` from a source checkout (skips without one)."""
    src = d2_src()
    if src is None:
        pytest.skip("no Detectron2 source checkout (set DETECTRON2_SRC)")
    pytest.importorskip("fvcore")
    pytest.importorskip("iopath")
    sys.path.insert(0, src)
    try:
        return getattr(__import__(f"detectron2.{module}", fromlist=[name]), name)
    finally:
        sys.path.remove(src)


def test_detectron2_load_voc_instances_registered_unchanged(tmp_path):
    """Detectron2's ``load_voc_instances`` (XYXY_ABS boxes less 1 at the top left, string
    ids): Detectron's 0-based inclusive VOC boxes, images numbered in split order."""
    load_voc_instances = _d2_import("data.datasets.pascal_voc", "load_voc_instances")
    classes = _d2_import("data.datasets.pascal_voc", "CLASS_NAMES")
    objs = {"000009": [("dog", 10, 20, 49, 59, 0), ("person", 1, 1, 30, 40, 1)],
            "000005": [("chair", 5, 6, 7, 8, 0)]}
    for sub in ("Annotations", "ImageSets/Main", "JPEGImages"):
        os.makedirs(tmp_path / "VOC" / sub)
    for fid, boxes in objs.items():
        (tmp_path / "VOC" / "JPEGImages" / f"{fid}.jpg").write_bytes(b"")
        xml = "".join(f"<object><name>{c}</name><difficult>{d}</difficult><bndbox><xmin>{a}"
                      f"</xmin><ymin>{b}</ymin><xmax>{x}</xmax><ymax>{y}</ymax></bndbox></object>"
                      for c, a, b, x, y, d in boxes)
        (tmp_path / "VOC" / "Annotations" / f"{fid}.xml").write_text(
            f"<annotation><size><width>80</width><height>60</height></size>{xml}</annotation>")
    (tmp_path / "VOC" / "ImageSets" / "Main" / "trainval.txt").write_text("000009\n000005\n")
    cat = Catalog(builtins=False)
    cat.register("voc", lambda: load_voc_instances(str(tmp_path / "VOC"), "trainval", classes),
                 thing_classes=list(classes))
    from lit_roidata.roidb.build import roidb_for_evaluation

    db = roidb_for_evaluation("voc", get_cfg(), str(tmp_path / "cache"), catalog=cat)
    assert [e["id"] for e in db] == [0, 1]
    assert [os.path.basename(e["image"]) for e in db] == ["000009.jpg", "000005.jpg"]
    for e, boxes in zip(db, objs.values()):
        np.testing.assert_array_equal(e["boxes"], [[a - 1, b - 1, x - 1, y - 1]
                                                   for _, a, b, x, y, _ in boxes])
        assert e["gt_classes"].tolist() == [classes.index(c) + 1 for c, *_ in boxes]
        assert e["seg_areas"].tolist() == [(x - a + 1) * (y - b + 1)
                                           for _, a, b, x, y, _ in boxes]


def test_mixed_with_a_json_dataset_by_name(tmp_path):
    """A function's ids (0..K-1) and a json's differ: strict refuses, by_name maps them."""
    data = make_coco(8, 5)
    cat = write_dataset(str(tmp_path), "files", data)
    image_dir = cat.get("files").image_dir
    cat.register("func", lambda: to_dicts(data, image_dir, extra=("area", "ignore")),
                 thing_classes=_classes(data), version="1")
    cfg, names = get_cfg(), ["files", "func"]
    with pytest.raises(RoIDBInputError, match="different categories"):
        combined_roidb_for_training(names, (), cfg, str(tmp_path / "c"), catalog=cat)
    db = combined_roidb_for_training(names, (), cfg, str(tmp_path / "c"), catalog=cat,
                                     category_policy="by_name")
    half = len(db) // 2
    for x, y in zip(list(db)[:half], list(db)[half:]):
        assert x["gt_classes"].tolist() == y["gt_classes"].tolist() and x["id"] == y["id"]
