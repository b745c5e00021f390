"""Synthetic demo data: valid COCO, Detectron proposal format, idempotent and race-safe."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from pycocotools.coco import COCO

from lit_roidata.boxes import bbox_overlaps
from lit_roidata.demo import (
    DEMO_TRAIN_DATASETS,
    DEMO_VAL_DATASETS,
    ensure_demo_data,
    register_demo_datasets,
)
from lit_roidata.demo.shapes import COCO_KEYPOINT_NAMES, rle_uncompressed
from lit_roidata.roidb.proposals import read_proposal_file

SMALL = {"demo_train_a": 24, "demo_train_b": 10, "demo_val": 9}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("demo")
    return root, ensure_demo_data(root, num_images=SMALL)


def test_layout_and_counts(demo: tuple[Path, dict]) -> None:
    root, layout = demo
    assert set(layout) == set(DEMO_TRAIN_DATASETS) | set(DEMO_VAL_DATASETS)
    for name, info in layout.items():
        assert info["num_images"] == SMALL[name]
        assert len(list(Path(info["image_dir"]).glob("*.jpg"))) == SMALL[name]
        assert Path(info["annotation_file"]).is_file()
        assert Path(info["proposal_file"]).is_file()


def test_valid_coco_with_crowd_keypoints_polygons(demo: tuple[Path, dict]) -> None:
    _, layout = demo
    coco = COCO(layout["demo_train_a"]["annotation_file"])
    cats = coco.loadCats(coco.getCatIds())
    assert [c["name"] for c in cats][0] == "person"
    assert tuple(cats[0]["keypoints"]) == COCO_KEYPOINT_NAMES
    assert len({c["id"] for c in cats}) == len(cats) >= 3
    anns = coco.loadAnns(coco.getAnnIds())
    crowd = [a for a in anns if a["iscrowd"]]
    assert crowd and all(isinstance(a["segmentation"], dict) for a in crowd)
    polys = [a for a in anns if not a["iscrowd"]]
    assert all(isinstance(a["segmentation"], list) and all(len(p) >= 6 for p in a["segmentation"])
               for a in polys)
    persons = [a for a in polys if a["category_id"] == cats[0]["id"]]
    assert persons and all(len(a["keypoints"]) == 3 * 17 for a in anns)  # every object has them
    assert all(a["num_keypoints"] == 0 for a in anns if a["category_id"] != cats[0]["id"])
    for a in persons:
        kp = np.array(a["keypoints"]).reshape(17, 3)
        assert a["num_keypoints"] == int((kp[:, 2] > 0).sum())
    imgs = coco.loadImgs(coco.getImgIds())
    assert any(im["height"] > im["width"] for im in imgs)  # portrait images exist
    for a in anns:
        im = coco.imgs[a["image_id"]]
        x, y, w, h = a["bbox"]
        assert w >= 1 and h >= 1 and x >= 0 and y >= 0
        assert x + w <= im["width"] and y + h <= im["height"]
        mask = coco.annToMask(a)
        ys, xs = np.nonzero(mask)
        if a["iscrowd"]:  # RLE is the exact mask: the box is its tight pixel bounds
            assert (xs.min(), ys.min(), xs.max() - xs.min() + 1) == (x, y, w)
            assert mask.sum() == a["area"]


def test_proposal_file_format(demo: tuple[Path, dict]) -> None:
    _, layout = demo
    for info in layout.values():
        assert info["proposal_file"].endswith(".npz")
        read_proposal_file(info["proposal_file"])  # the columnar format: no trust_pickle
        with np.load(info["proposal_file"], allow_pickle=False) as z:
            ends = np.cumsum(z["counts"])[:-1]
            props = {"ids": z["ids"].tolist(), "boxes": np.split(z["boxes"], ends),
                     "scores": np.split(z["scores"], ends)}
        coco = COCO(info["annotation_file"])
        assert sorted(props["ids"]) == sorted(coco.getImgIds())
        assert len(props["boxes"]) == len(props["scores"]) == len(props["ids"])
        for boxes, scores, image_id in zip(props["boxes"], props["scores"], props["ids"]):
            im = coco.imgs[image_id]
            assert boxes.dtype == np.float32 and boxes.shape[1] == 4
            assert 100 <= len(boxes) <= 400 and scores.shape == (len(boxes),)
            assert np.all(np.diff(scores) <= 0)  # descending score
            assert np.all(boxes[:, 2] >= boxes[:, 0]) and np.all(boxes[:, 3] >= boxes[:, 1])
            assert boxes[:, 2].max() <= im["width"] - 1 and boxes[:, 3].max() <= im["height"] - 1
            anns = coco.loadAnns(coco.getAnnIds(imgIds=image_id))
            if anns:  # some proposals are foreground for the gt
                gt = np.array([[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2] - 1,
                                a["bbox"][1] + a["bbox"][3] - 1] for a in anns], np.float32)
                assert (bbox_overlaps(boxes, gt).max(axis=0) >= 0.5).all()


def test_idempotent_and_repairs_incomplete(demo: tuple[Path, dict]) -> None:
    root, layout = demo
    ann = Path(layout["demo_val"]["annotation_file"])
    before = ann.stat().st_mtime_ns
    assert ensure_demo_data(root, num_images=SMALL) == layout
    assert ann.stat().st_mtime_ns == before  # reused, not rewritten
    content = ann.read_bytes()
    victim = sorted(Path(layout["demo_val"]["image_dir"]).glob("*.jpg"))[0]
    victim.unlink()
    ensure_demo_data(root, num_images=SMALL)
    assert victim.is_file() and ann.read_bytes() == content  # same seed, same data


def test_deterministic_per_seed(tmp_path: Path) -> None:
    small = {"demo_train_a": 3, "demo_train_b": 2, "demo_val": 2}
    a = ensure_demo_data(tmp_path / "a", seed=5, num_images=small)
    b = ensure_demo_data(tmp_path / "b", seed=5, num_images=small)
    c = ensure_demo_data(tmp_path / "c", seed=6, num_images=small)
    def read(d: dict) -> dict:
        return json.loads(Path(d["demo_train_a"]["annotation_file"]).read_text())

    assert read(a)["annotations"] == read(b)["annotations"] != read(c)["annotations"]


def _worker(root: str) -> None:
    ensure_demo_data(root, num_images={"demo_train_a": 6, "demo_train_b": 3, "demo_val": 3})


def test_concurrent_ranks_do_not_race(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")  # two "ranks" racing for the lock
    procs = [ctx.Process(target=_worker, args=(str(tmp_path),)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert not list(tmp_path.glob(".build-*"))
    coco = COCO(str(tmp_path / "demo_train_a" / "annotations.json"))
    assert len(coco.imgs) == 6


def test_bad_num_images(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown demo dataset"):
        ensure_demo_data(tmp_path, num_images={"coco_2014_train": 3})
    with pytest.raises(ValueError, match="at least 1"):
        ensure_demo_data(tmp_path, num_images={"demo_val": 0})


def test_register_in_catalog(demo: tuple[Path, dict]) -> None:
    root, layout = demo

    class FakeCatalog:
        def __init__(self) -> None:
            self.entries: dict[str, tuple] = {}

        def register(self, name: str, image_dir: str, annotation_file: str,
                     image_prefix: str = "") -> None:
            self.entries[name] = (image_dir, annotation_file, image_prefix)

    cat = FakeCatalog()
    out = register_demo_datasets(root, cat, num_images=SMALL)
    assert out.catalog is cat
    assert out.train_datasets == DEMO_TRAIN_DATASETS and out.val_datasets == DEMO_VAL_DATASETS
    assert out.train_proposal_files == tuple(layout[n]["proposal_file"]
                                             for n in DEMO_TRAIN_DATASETS)
    assert cat.entries["demo_val"] == (layout["demo_val"]["image_dir"],
                                       layout["demo_val"]["annotation_file"], "")


def test_rle_uncompressed_roundtrip() -> None:
    from pycocotools import mask as mask_utils

    rng = np.random.default_rng(0)
    for first in (0, 1):
        m = (rng.random((7, 5)) > 0.5).astype(np.uint8)
        m[0, 0] = first
        rle = rle_uncompressed(m)
        assert sum(rle["counts"]) == m.size
        back = mask_utils.decode(mask_utils.frPyObjects(rle, 7, 5))
        np.testing.assert_array_equal(back, m)




@settings(deadline=None, max_examples=50)
@given(hnp.arrays(np.uint8, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=12),
                  elements=st.integers(0, 1)))
def test_rle_uncompressed_property(m: np.ndarray) -> None:
    from pycocotools import mask as mask_utils

    rle = rle_uncompressed(m)
    assert sum(rle["counts"]) == m.size and all(c >= 0 for c in rle["counts"])
    back = mask_utils.decode(mask_utils.frPyObjects(rle, *m.shape))
    np.testing.assert_array_equal(back, m)
