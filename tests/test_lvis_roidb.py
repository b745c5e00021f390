"""LVIS-format datasets: catalog, roidb columns, entries, batch fields, errors, generator,
and equality with Detectron2's ``load_lvis_json`` (from a source checkout, skipped without)."""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_roidata.catalog import Catalog
from lit_roidata.config import get_cfg
from lit_roidata.demo.lvis_data import (ensure_lvis_demo_data, lvis_thresholds,
                                        register_lvis_demo_datasets)
from lit_roidata.minibatch.roidb_blob import LVIS_KEYS, deserialize_roidb, serialize_roidb
from lit_roidata.roidb.build import combined_roidb_for_training, roidb_for_evaluation
from lit_roidata.roidb.info import RoIDBInputError
from lit_roidata.roidb.lvis import decode_lvis, file_name_from_coco_url

SMALL = {"num_train": 60, "num_val": 12, "num_categories": 9}


@pytest.fixture(scope="module")
def lvis(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("lvis")
    return root, ensure_lvis_demo_data(root, **SMALL)


def _catalog(root: Path) -> Catalog:
    return Catalog(data_root=str(root))


def _load(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


# ------------------------------------------------------------------------- generator
def test_generator_is_lvis_v1_long_tailed_and_federated(lvis):
    _, layout = lvis
    train = _load(layout["lvis_demo_train"]["annotation_file"])
    val = _load(layout["lvis_demo_val"]["annotation_file"])
    rare_max, common_max = lvis_thresholds(SMALL["num_train"])
    assert train["categories"] == val["categories"]
    ids = [c["id"] for c in train["categories"]]
    assert ids == list(range(1, SMALL["num_categories"] + 1))
    img_sets: dict = {i: set() for i in ids}
    for a in train["annotations"]:
        img_sets[a["category_id"]].add(a["image_id"])
        assert "iscrowd" not in a and isinstance(a["segmentation"], list)
        assert all(len(p) >= 6 and len(p) % 2 == 0 for p in a["segmentation"])
    for c in train["categories"]:
        n = len(img_sets[c["id"]])
        assert c["image_count"] == n >= 1
        assert c["instance_count"] == sum(a["category_id"] == c["id"]
                                          for a in train["annotations"])
        assert c["frequency"] == ("r" if n <= rare_max else "c" if n <= common_max else "f")
    assert {c["frequency"] for c in train["categories"]} == {"r", "c", "f"}
    for doc, folder in ((train, "train2017"), (val, "val2017")):
        by_img: dict = {}
        for a in doc["annotations"]:
            by_img.setdefault(a["image_id"], set()).add(a["category_id"])
        for im in doc["images"]:
            assert "file_name" not in im
            assert im["coco_url"].startswith(f"http://images.cocodataset.org/{folder}/")
            pos = by_img.get(im["id"], set())
            assert not pos & set(im["neg_category_ids"])
            assert set(im["not_exhaustive_category_ids"]) <= pos
            assert set(im["neg_category_ids"]) <= set(ids)
        # every category appears in val too (evaluation needs each group)
        assert {a["category_id"] for a in doc["annotations"]} == set(ids)
        assert any(im["neg_category_ids"] for im in doc["images"])
        assert any(im["not_exhaustive_category_ids"] for im in doc["images"])


def test_generator_deterministic_and_reused(tmp_path, lvis):
    root, layout = lvis
    other = ensure_lvis_demo_data(tmp_path, **SMALL)

    def digest(base: Path, lay: dict) -> str:
        h = hashlib.sha256()
        for info in lay.values():
            h.update(Path(info["annotation_file"]).read_bytes())
        for p in sorted((base / "coco").rglob("*.jpg")):
            h.update(p.relative_to(base).as_posix().encode() + p.read_bytes())
        return h.hexdigest()

    assert digest(root, layout) == digest(tmp_path, other)
    before = os.stat(other["lvis_demo_train"]["annotation_file"]).st_mtime_ns
    ensure_lvis_demo_data(tmp_path, **SMALL)  # complete: reused untouched
    assert os.stat(other["lvis_demo_train"]["annotation_file"]).st_mtime_ns == before
    changed = ensure_lvis_demo_data(tmp_path, **dict(SMALL, seed=1))
    assert digest(tmp_path, changed) != digest(root, layout)


def test_thresholds_are_lvis_from_300_images():
    assert lvis_thresholds(300) == (10, 100) == lvis_thresholds(100000)
    r, c = lvis_thresholds(10)
    assert 1 <= r < c


# ------------------------------------------------------------------------- catalog
def test_catalog_lvis_builtins_and_format(tmp_path):
    cat = Catalog(data_root=str(tmp_path))
    s = cat.get("lvis_v1_train")
    assert s.format == "lvis" and s.image_dir == os.path.join(str(tmp_path), "coco")
    assert s.annotation_file == os.path.join(str(tmp_path), "lvis/lvis_v1_train.json")
    assert cat.get("lvis_v1_val").annotation_file.endswith("lvis/lvis_v1_val.json")
    assert cat.get("coco_2017_train").format == "coco"
    assert cat.register("x", "/im", "/a.json").format == "coco"
    assert cat.register("y", "/im", "/a.json", format="lvis").format == "lvis"
    with pytest.raises(ValueError, match="format='yolo'.*coco.*lvis.*voc"):
        cat.register("z", "/im", "/a.json", format="yolo")
    (tmp_path / "c.yaml").write_text(
        "datasets:\n  l:\n    image_dir: coco\n    annotation_file: l.json\n    format: lvis\n"
        "  k:\n    image_dir: coco\n    annotation_file: k.json\n")
    names = cat.load_yaml(tmp_path / "c.yaml")
    assert names == ["l", "k"] and cat.get("l").format == "lvis" and cat.get("k").format == "coco"
    (tmp_path / "bad.yaml").write_text(
        "datasets:\n  b:\n    image_dir: c\n    annotation_file: b.json\n    format: LVIS\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: dataset 'b': format='LVIS'"):
        cat.load_yaml(tmp_path / "bad.yaml")


def test_file_name_from_coco_url():
    assert file_name_from_coco_url(
        "http://images.cocodataset.org/train2017/000000155379.jpg") == "train2017/000000155379.jpg"
    assert file_name_from_coco_url("000000155379.jpg") is None
    assert file_name_from_coco_url("http://x/") is None


# ------------------------------------------------------------------------- roidb
def test_roidb_columns_entries_and_flips(lvis, tmp_path):
    root, layout = lvis
    cat = _catalog(root)
    db = combined_roidb_for_training("lvis_v1_train", (), get_cfg(), str(tmp_path), catalog=cat)
    arrays = set(db.manifest["arrays"])
    assert {"img_neg_off", "neg_classes", "img_nexh_off", "nexh_classes"} <= arrays
    doc = _load(layout["lvis_demo_train"]["annotation_file"])
    by_id = {im["id"]: im for im in doc["images"]}
    info = db.datasets[0]
    assert info.classes[1:] == tuple(c["name"] for c in doc["categories"])
    j2c = info.json_category_id_to_contiguous_id
    assert all(j2c[i] == i for i in j2c)  # ids 1..K: contiguous id == LVIS id
    seen_flip = 0
    for e in db:
        im = by_id[e["id"]]
        assert e["image"] == os.path.join(str(root), "coco", "train2017", f"{e['id']:012d}.jpg")
        for key in LVIS_KEYS:
            assert e[key].dtype == np.int32
            assert e[key].tolist() == [j2c[c] for c in im[key]]
        seen_flip += e["flipped"]
    assert seen_flip > 0


def test_annotation_order_and_noncontiguous_ids(tmp_path):
    """Shuffled images and categories, ids with gaps: lists follow their images and map
    to classes by sorted id."""
    rng = np.random.default_rng(3)
    cat_ids = [40, 7, 1203, 99]
    images, anns = [], []
    for i, iid in enumerate(rng.permutation(np.arange(10, 20)).tolist()):
        neg = rng.choice(cat_ids, size=int(rng.integers(0, 3)), replace=False).tolist()
        images.append({"id": iid, "width": 50, "height": 40,
                       "coco_url": f"http://h/val2017/{iid:012d}.jpg",
                       "neg_category_ids": neg, "not_exhaustive_category_ids": neg[:1]})
        anns.append({"id": i + 1, "image_id": iid, "category_id": cat_ids[i % 4],
                     "bbox": [1, 2, 10, 12], "area": 120.0,
                     "segmentation": [[1, 2, 11, 2, 11, 14, 1, 14]]})
    doc = {"images": images, "annotations": anns,
           "categories": [{"id": c, "name": f"c{c}"} for c in cat_ids]}
    p = tmp_path / "a.json"
    p.write_text(json.dumps(doc))
    cat = Catalog(builtins=False)
    cat.register("a", tmp_path, p, format="lvis")
    db = roidb_for_evaluation("a", None, str(tmp_path / "c"), catalog=cat, check_images=False)
    info = db.datasets[0]
    assert info.classes == ("__background__", "c7", "c40", "c99", "c1203")
    rank = {7: 1, 40: 2, 99: 3, 1203: 4}
    by_id = {im["id"]: im for im in images}
    assert [e["id"] for e in db] == sorted(by_id)
    for e in db:
        im = by_id[e["id"]]
        assert e["neg_category_ids"].tolist() == [rank[c] for c in im["neg_category_ids"]]
        assert e["not_exhaustive_category_ids"].tolist() == [
            rank[c] for c in im["not_exhaustive_category_ids"]]
        a = next(a for a in anns if a["image_id"] == e["id"])
        assert e["gt_classes"].tolist() == [rank[a["category_id"]]]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.lists(st.integers(1, 6), max_size=4),
                          st.lists(st.integers(1, 6), max_size=3),
                          st.booleans(), st.booleans()), min_size=1, max_size=8))
def test_fast_and_generic_decoders_agree(tmp_path_factory, rows):
    images = []
    for i, (neg, nexh, has_url, has_name) in enumerate(rows):
        im = {"id": 100 - i, "width": 30, "height": 20}
        if has_url or not has_name:
            im["coco_url"] = f"http://h/train2017/{i}.jpg"
        if has_name:
            im["file_name"] = f"own_{i}.jpg"
        if neg:
            im["neg_category_ids"] = neg
        if nexh:
            im["not_exhaustive_category_ids"] = nexh
        images.append(im)
    doc = {"images": images, "annotations": [],
           "categories": [{"id": c, "name": str(c)} for c in (6, 2, 4, 1, 3, 5)]}
    p = tmp_path_factory.mktemp("dec") / "a.json"
    p.write_text(json.dumps(doc))
    fast, generic = decode_lvis(str(p)), decode_lvis(str(p), fast=False)
    assert fast.decoder == "fast" and generic.decoder == "generic"
    assert fast.file_names == generic.file_names == [
        im.get("file_name") or f"train2017/{i}.jpg" for i, im in enumerate(images)]
    assert [c["id"] for c in fast.categories] == [1, 2, 3, 4, 5, 6]
    for k in ("neg_n", "neg_ids", "nexh_n", "nexh_ids"):
        np.testing.assert_array_equal(getattr(fast, k), getattr(generic, k))
    np.testing.assert_array_equal(fast.neg_ids, [c for im in images
                                                 for c in im.get("neg_category_ids", [])])


def test_mixed_with_coco_dataset_has_empty_lists(lvis, tmp_path):
    root, layout = lvis
    doc = _load(layout["lvis_demo_val"]["annotation_file"])
    coco = copy.deepcopy(doc)
    for im in coco["images"]:
        im["file_name"] = im.pop("coco_url").split("/")[-1]
        del im["neg_category_ids"], im["not_exhaustive_category_ids"]
    p = tmp_path / "coco.json"
    p.write_text(json.dumps(coco))
    cat = _catalog(root)
    cat.register("as_coco", os.path.join(str(root), "coco", "val2017"), p)
    db = roidb_for_evaluation(["lvis_v1_val", "as_coco"], None, str(tmp_path / "c"),
                              catalog=cat)
    n = len(doc["images"])
    assert len(db) == 2 * n
    for i in range(n):
        a, b = db[i], db[n + i]
        assert a["id"] == b["id"] and a["image"] == b["image"]
        np.testing.assert_array_equal(a["boxes"], b["boxes"])
        assert b["neg_category_ids"].size == b["not_exhaustive_category_ids"].size == 0
    # the COCO dataset alone: no LVIS columns, no LVIS fields (its cache is today's)
    only = roidb_for_evaluation("as_coco", None, str(tmp_path / "c"), catalog=cat)
    assert not {"img_neg_off", "neg_classes"} & set(only.manifest["arrays"])
    assert not set(LVIS_KEYS) & set(only[0])
    assert "format" not in json.dumps(only.manifest["inputs"])


# ------------------------------------------------------------------------- errors
def _write(tmp_path: Path, doc: dict) -> Catalog:
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    cat = Catalog(builtins=False)
    cat.register("bad", tmp_path, p, format="lvis")
    return cat


def _doc() -> dict:
    return {"images": [{"id": 5, "width": 20, "height": 20,
                        "coco_url": "http://h/train2017/5.jpg", "neg_category_ids": [2],
                        "not_exhaustive_category_ids": []}],
            "annotations": [{"id": 1, "image_id": 5, "category_id": 1, "bbox": [1, 1, 5, 5],
                             "area": 25.0, "segmentation": [[1, 1, 6, 1, 6, 6]]}],
            "categories": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]}


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d["images"][0].pop("coco_url"),
     r"bad\.json: image id 5 has neither 'file_name' nor 'coco_url'.*coco_url"),
    (lambda d: d["images"][0].update(coco_url="5.jpg"),
     r"image id 5 has no 'file_name' and a coco_url '5\.jpg' without a folder"),
    (lambda d: d["images"][0].update(coco_url=7), r"image id 5 has coco_url=7"),
    (lambda d: d["annotations"][0].update(category_id=9),
     r"annotation id 1 \(image id 5\): category_id 9"),
    (lambda d: d["images"][0].update(neg_category_ids=[2, 77]),
     r"bad\.json: 1 neg_category_ids value\(s\) in 1 image\(s\) are not ids of 'categories' "
     r"\(image id 5: 77\)"),
    (lambda d: d["images"][0].update(not_exhaustive_category_ids=[3]),
     r"not_exhaustive_category_ids.*\(image id 5: 3\)"),
    (lambda d: d["images"][0].update(neg_category_ids=["a"]),
     r"image id 5 has neg_category_ids=\['a'\]; expected a list of integer category ids"),
    (lambda d: d["images"][0].update(not_exhaustive_category_ids=[2 ** 64 - 1]),
     r"image id 5 has not_exhaustive_category_ids=\[18446744073709551615\]; expected a list"),
])
def test_named_errors(tmp_path, mutate, match):
    doc = _doc()
    mutate(doc)
    cat = _write(tmp_path, doc)
    with pytest.raises(RoIDBInputError, match=match):
        roidb_for_evaluation("bad", None, str(tmp_path / "c"), catalog=cat, check_images=False)


def test_coco_format_still_requires_file_name(tmp_path):
    doc = _doc()
    p = tmp_path / "coco.json"
    p.write_text(json.dumps(doc))
    cat = Catalog(builtins=False)
    cat.register("c", tmp_path, p)
    with pytest.raises(RoIDBInputError, match="image id 5 has file_name=None"):
        roidb_for_evaluation("c", None, str(tmp_path / "c"), catalog=cat, check_images=False)


def test_file_name_kept_when_present(tmp_path):
    doc = _doc()
    doc["images"][0]["file_name"] = "mine.jpg"
    cat = _write(tmp_path, doc)
    db = roidb_for_evaluation("bad", None, str(tmp_path / "c"), catalog=cat, check_images=False)
    assert db[0]["image"] == os.path.join(str(tmp_path), "mine.jpg")


# ------------------------------------------------------------------------- batch
def test_batch_fields(lvis, tmp_path):
    from lit_roidata.minibatch.torchvision_format import build_torchvision_batch

    root, _ = lvis
    db = combined_roidb_for_training("lvis_v1_train", (), get_cfg(), str(tmp_path),
                                     catalog=_catalog(root))
    idx = [i for i in range(len(db)) if db[i]["neg_category_ids"].size][:2]
    entries = [db[i] for i in idx]
    cfg = get_cfg()
    cfg.MODEL.MASK_ON = True
    _, targets = build_torchvision_batch(entries, cfg, np.random.RandomState(0))
    for e, t in zip(entries, targets):
        for key in LVIS_KEYS:
            assert t[key].dtype.is_floating_point is False
            assert t[key].tolist() == e[key].tolist()
        assert t["labels"].tolist() == e["gt_classes"][~e["is_crowd"]].tolist()
    back = deserialize_roidb(serialize_roidb(entries))
    for e, b in zip(entries, back):
        for key in LVIS_KEYS:
            assert b[key].dtype == np.int32 and b[key].tolist() == e[key].tolist()
    coco_like = [{k: v for k, v in e.items() if k not in LVIS_KEYS} for e in entries]
    assert not set(LVIS_KEYS) & set(deserialize_roidb(serialize_roidb(coco_like))[0])


def test_register_demo_names(lvis):
    root, _ = lvis
    cat = Catalog(builtins=False)
    names = register_lvis_demo_datasets(root, cat, **SMALL)
    assert names == ("lvis_demo_train", "lvis_demo_val")
    assert cat.get("lvis_demo_train").format == "lvis"
    assert cat.get("lvis_demo_val").image_dir == os.path.join(str(root), "coco")


# ------------------------------------------------------------------------- Detectron2
def _d2_source() -> str | None:
    """A Detectron2 source checkout: ``$DETECTRON2_SRC``, or a ``d2src`` folder beside
    the repository or one of its parents."""
    env = os.environ.get("DETECTRON2_SRC")
    cands = [env] if env else []
    here = Path(__file__).resolve().parent.parent
    cands += [str(p / "d2src") for p in (here.parent, here.parent.parent)]
    return next((c for c in cands if c and os.path.isfile(
        os.path.join(c, "detectron2", "data", "datasets", "lvis.py"))), None)


def _d2_load_lvis_json():
    """Detectron2's ``load_lvis_json`` imported from the checkout without running
    ``detectron2/data/__init__`` (which needs the whole training stack): the parent
    packages are bare namespace modules over the checkout's folders."""
    src = _d2_source()
    if src is None:
        pytest.skip("no Detectron2 source checkout (set DETECTRON2_SRC)")
    for mod in ("fvcore", "iopath", "lvis"):
        pytest.importorskip(mod)
    saved = {k: v for k, v in sys.modules.items() if k == "detectron2"
             or k.startswith("detectron2.")}
    try:
        for name, sub in (("detectron2", ""), ("detectron2.data", "data"),
                          ("detectron2.data.datasets", "data/datasets")):
            m = types.ModuleType(name)
            m.__path__ = [os.path.join(src, "detectron2", sub)]
            sys.modules[name] = m
        catalog = importlib.import_module("detectron2.data.catalog")
        sys.modules["detectron2.data"].DatasetCatalog = catalog.DatasetCatalog
        sys.modules["detectron2.data"].MetadataCatalog = catalog.MetadataCatalog
        return importlib.import_module("detectron2.data.datasets.lvis").load_lvis_json
    except ImportError as exc:
        pytest.skip(f"Detectron2's lvis module does not import here: {exc}")
    finally:
        for k in [k for k in sys.modules if k == "detectron2" or k.startswith("detectron2.")]:
            del sys.modules[k]
        sys.modules.update(saved)


@pytest.mark.parametrize("split", ["lvis_v1_train", "lvis_v1_val"])
def test_equals_detectron2_load_lvis_json(lvis, tmp_path, split):
    """Every image of the file: file name, gt boxes and classes, polygons, and the neg /
    not-exhaustive lists equal Detectron2's records, in Detectron's conventions: boxes
    (x1, y1, x1 + max(0, w - 1), y1 + max(0, h - 1)) clipped to the image, classes
    ``category_id + 1`` (D2 is 0-based without background), the lists' raw LVIS ids
    mapped by ``json_category_id_to_contiguous_id`` (the identity for ids 1..K)."""
    load_lvis_json = _d2_load_lvis_json()
    root, _ = lvis
    cat = _catalog(root)
    spec = cat.get(split)
    records = load_lvis_json(spec.annotation_file, spec.image_dir + os.sep)
    db = roidb_for_evaluation(split, None, str(tmp_path), catalog=cat)
    assert [e["id"] for e in db] == [r["image_id"] for r in records]
    j2c = db.datasets[0].json_category_id_to_contiguous_id
    n_boxes = 0
    for e, r in zip(db, records):
        assert os.path.normpath(e["image"]) == os.path.normpath(r["file_name"])
        assert (e["width"], e["height"]) == (r["width"], r["height"])
        for key in LVIS_KEYS:
            assert e[key].tolist() == [j2c[c] for c in r[key]]
        anns = r["annotations"]
        xywh = np.array([a["bbox"] for a in anns], np.float64).reshape(-1, 4)
        x2 = xywh[:, 0] + np.maximum(0, xywh[:, 2] - 1)
        y2 = xywh[:, 1] + np.maximum(0, xywh[:, 3] - 1)
        ref = np.stack([xywh[:, 0], xywh[:, 1], x2, y2], 1)
        ref[:, 0::2] = ref[:, 0::2].clip(0, r["width"] - 1)
        ref[:, 1::2] = ref[:, 1::2].clip(0, r["height"] - 1)
        np.testing.assert_allclose(e["boxes"], ref.astype(np.float32), rtol=0, atol=0)
        assert e["gt_classes"].tolist() == [a["category_id"] + 1 for a in anns]
        assert e["segms"] == [a["segmentation"] for a in anns]
        assert not e["is_crowd"].any()
        n_boxes += len(anns)
    assert n_boxes > 0 and any(r["neg_category_ids"] for r in records)


@pytest.mark.parametrize("output_format", ["torchvision", "detectron"])
def test_lists_reach_the_batch_through_workers(lvis, tmp_path, output_format):
    """One batch from the train loader (a worker process, shared-memory transport): the
    torchvision targets, or the RPN family's ``roidb`` blob, carry the entries' lists."""
    from lit_roidata.loader import build_train_loader

    root, _ = lvis
    cfg = get_cfg()
    cfg.MODEL.FASTER_RCNN = True
    cfg.TRAIN.SCALES = (160,)
    cfg.TRAIN.MAX_SIZE = 320
    db = combined_roidb_for_training("lvis_v1_train", (), cfg, str(tmp_path),
                                     catalog=_catalog(root))
    loader = build_train_loader(cfg, db, num_workers=1, ims_per_batch=2, seed=3,
                                output_format=output_format)
    by_id = {e["id"]: e for e in db}
    nonempty = 0
    for _, batch in zip(range(4), loader):
        if output_format == "torchvision":
            got = [{k: t[k].tolist() for k in LVIS_KEYS} for t in batch[1]]
            ids = [t["image_id"] for t in batch[1]]
        else:
            entries = deserialize_roidb(batch["roidb"])
            got = [{k: e[k].tolist() for k in LVIS_KEYS} for e in entries]
            ids = [e["id"] for e in entries]
        assert got == [{k: by_id[i][k].tolist() for k in LVIS_KEYS} for i in ids]
        nonempty += sum(bool(v) for g in got for v in g.values())
    assert nonempty > 0
