"""Hand-checked fixtures: one annotation per cleaning rule (Detectron semantics: ground-truth
cleaning; class assignment; proposals; filtering)."""

from __future__ import annotations

import numpy as np
import pytest

from lit_roidata.config import get_cfg
from lit_roidata.roidb import combined_roidb_for_training, roidb_for_evaluation
from roidb_fixtures import make_coco, rle_string, write_dataset

CATS = [{"id": 9, "name": "b"}, {"id": 2, "name": "a"}]


def ann(i, img, bbox, area=None, cat=9, **kw):
    a = {"id": i, "image_id": img, "category_id": cat, "bbox": bbox,
         "area": float(bbox[2] * bbox[3]) if area is None else area, "iscrowd": 0,
         "segmentation": [[bbox[0], bbox[1], bbox[0] + bbox[2], bbox[1], bbox[0], bbox[1] + 1]]}
    a.update(kw)
    return a


def dataset():
    crowd_mask = np.zeros((50, 100), np.uint8)
    crowd_mask[0:20, 60:90] = 1
    anns = [
        ann(1, 1, [10, 5, 20.5, 10]),                         # kept: [10, 5, 29.5, 14]
        ann(2, 1, [90, 40, 30, 30]),                           # clipped: [90, 40, 99, 49]
        ann(3, 1, [-5, -5, 10, 10], area=50.0),                # clipped: [0, 0, 4, 4]
        ann(4, 1, [30, 30, 1, 5]),                             # w <= 1: x2 == x1, dropped
        ann(5, 1, [40, 30, 1.5, 5]),                           # 1 < w < 2 survives
        ann(6, 1, [50, 30, 5, 5], area=0.0),                   # area 0: dropped
        ann(7, 1, [50, 30, 5, 5], ignore=1),                   # ignore: dropped
        ann(8, 1, [60, 30, 2, 5], area=10.0, cat=2),           # area 10: kept unless GT_MIN_AREA
        ann(9, 1, [70, 30, 5, 5], segmentation=[[1, 2, 3, 4]]),  # polygon < 6: [] kept
        ann(10, 1, [60, 0, 30, 20], iscrowd=1,
            segmentation={"size": [50, 100], "counts": rle_string(crowd_mask)}),
        ann(11, 1, [200, 10, 5, 5]),                           # outside: clipped to a line
        ann(12, 2, [1, 1, 10, 10], iscrowd=1,
            segmentation={"size": [30, 30], "counts": [31, 10, 859]}),
    ]
    images = [{"id": 3, "width": 40, "height": 40, "file_name": "c.jpg"},
              {"id": 1, "width": 100, "height": 50, "file_name": "a.jpg"},
              {"id": 2, "width": 30, "height": 30, "file_name": "b.jpg"}]
    return {"images": images, "annotations": anns, "categories": CATS}


@pytest.fixture
def built(tmp_path):
    cat = write_dataset(str(tmp_path), "hand", dataset())
    cfg = get_cfg()
    db = combined_roidb_for_training("hand", (), cfg, str(tmp_path / "c"), catalog=cat)
    return db, cat, cfg


def test_each_cleaning_rule(built):
    db, _, _ = built
    # image 2 (crowd only) and 3 (no annotations) are filtered; 1 and its flip remain
    assert len(db) == 2 and db.ids.tolist() == [1, 1] and db.flipped.tolist() == [False, True]
    e = db[0]
    np.testing.assert_array_equal(e["boxes"], np.array(
        [[10, 5, 29.5, 14], [90, 40, 99, 49], [0, 0, 4, 4], [40, 30, 40.5, 34],
         [60, 30, 61, 34], [70, 30, 74, 34], [60, 0, 89, 19]], np.float32))
    # json-order category mapping: id 9 -> 1 ("b"), id 2 -> 2 ("a")
    assert e["dataset"].classes == ("__background__", "b", "a")
    assert e["dataset"].json_category_id_to_contiguous_id == {9: 1, 2: 2}
    np.testing.assert_array_equal(e["gt_classes"], [1, 1, 1, 1, 2, 1, 1])
    np.testing.assert_array_equal(e["is_crowd"], [0, 0, 0, 0, 0, 0, 1])
    np.testing.assert_array_equal(e["max_overlaps"], [1, 1, 1, 1, 1, 1, -1])
    np.testing.assert_array_equal(e["max_classes"], [1, 1, 1, 1, 2, 1, 0])
    np.testing.assert_array_equal(e["gt_overlaps"].toarray()[-1], [-1, -1, -1])
    np.testing.assert_array_equal(e["seg_areas"], [205, 900, 50, 7.5, 10, 25, 600])
    assert e["segms"][5] == []  # the object stays without its < 6-coordinate polygon
    assert isinstance(e["segms"][6], dict)
    rep = db.report["datasets"][0]
    assert rep["dropped"] == {"gt_min_area": 0, "ignore": 1, "non_finite_bbox": 0,
                              "non_positive_area": 1, "degenerate_box": 2,
                              "annotation_unknown_image": 0}
    assert rep["segms"]["polygon_lt_6_coords"] == 1
    assert db.report["entries"]["dropped"]["no_fg_or_bg_candidate"] == 4


def test_gt_min_area(tmp_path):
    cat = write_dataset(str(tmp_path), "hand", dataset())
    cfg = get_cfg()
    cfg.merge_from_dict({"TRAIN.GT_MIN_AREA": 20})
    db = combined_roidb_for_training("hand", (), cfg, str(tmp_path / "c"), catalog=cat)
    assert db[0]["boxes"].shape[0] == 5  # area 10 and 7.5 objects dropped
    assert db.report["datasets"][0]["dropped"]["gt_min_area"] == 4  # areas 5, 7.5, 0, 10


def test_flipped_compressed_rle_is_mirrored(built):
    from pycocotools import mask as mask_util

    db, _, _ = built
    o, f = db[0]["segms"][6], db[1]["segms"][6]
    assert isinstance(f["counts"], str)  # same representation as the JSON
    mo = mask_util.decode({"size": o["size"], "counts": o["counts"].encode()})
    mf = mask_util.decode({"size": f["size"], "counts": f["counts"].encode()})
    np.testing.assert_array_equal(mf, mo[:, ::-1])
    assert db[0]["segms"][0] == [[10, 5, 30.5, 5, 10, 6]]
    assert db[1]["segms"][0] == [[100 - 10 - 1, 5, 100 - 30.5 - 1, 5, 100 - 10 - 1, 6]]


def test_flipped_uncompressed_rle(tmp_path):
    cat = write_dataset(str(tmp_path), "hand", dataset())
    cfg = get_cfg()
    ev = roidb_for_evaluation("hand", cfg, str(tmp_path / "c"), catalog=cat)
    e = ev[1]  # id 2: the uncompressed crowd RLE
    assert e["id"] == 2 and e["segms"][0] == {"size": [30, 30], "counts": [31, 10, 859]}
    from lit_roidata.roidb.segms import flip_rle
    from pycocotools import mask as mask_util

    f = flip_rle(e["segms"][0])
    assert isinstance(f["counts"], list)
    m = mask_util.decode(mask_util.frPyObjects(e["segms"][0], 30, 30))
    mf = mask_util.decode(mask_util.frPyObjects(f, 30, 30))
    np.testing.assert_array_equal(mf, m[:, ::-1])


def _proposal_db(tmp_path, boxes_for_1, *, limit=-1, crowd=0.7):
    import pickle

    cat = write_dataset(str(tmp_path), "hand", dataset())
    p = str(tmp_path / "props.pkl")
    with open(p, "wb") as fh:
        pickle.dump({"boxes": [np.zeros((0, 4), np.float32), np.array(boxes_for_1, np.float32),
                               np.zeros((0, 4), np.float32)],
                     "scores": [np.zeros(0), np.zeros(len(boxes_for_1)), np.zeros(0)],
                     "ids": [3, 1, 2]}, fh)
    cfg = get_cfg()
    cfg.merge_from_dict({"TRAIN.PROPOSAL_LIMIT": limit, "TRAIN.CROWD_FILTER_THRESH": crowd,
                         "TRAIN.USE_FLIPPED": False})
    ev = roidb_for_evaluation("hand", cfg, str(tmp_path / "c"), proposal_files=[p], catalog=cat,
                              trust_pickle=True)
    db = combined_roidb_for_training("hand", [p], cfg, str(tmp_path / "c"), catalog=cat,
                                     trust_pickle=True)
    return db, ev


def test_proposal_processing_by_hand(tmp_path):
    props = [[-10, -10, 200, 200],      # clipped to the image
             [10.2, 5, 29.4, 14],       # same rounded hash as the next: the next is dropped
             [10, 5, 29, 14.4],
             [0, 0, 1, 10],             # w = 2, not > 2: dropped
             [0, 0, 2, 10],             # w = 3: kept
             [62, 2, 85, 15],           # inside the crowd region: IoF > 0.7 -> row -1
             [10, 5, 29.5, 14]]         # equals gt 0: kept (gt appears twice)
    db, _ = _proposal_db(tmp_path, props)
    e = db[[int(i) for i in db.ids].index(1)]
    p = e["gt_classes"] == 0
    np.testing.assert_array_equal(e["boxes"][p], np.array(
        [[0, 0, 99, 49], [10.2, 5, 29.4, 14], [0, 0, 2, 10], [62, 2, 85, 15],
         [10, 5, 29.5, 14]], np.float32))
    mo, mc, m = e["max_overlaps"][p], e["max_classes"][p], e["box_to_gt_ind_map"][p]
    assert mo[3] == -1 and mc[3] == 0 and m[3] >= 0  # crowd filter leaves the map alone
    assert mo[4] == 1 and mc[4] == 1 and m[4] == 0
    assert (e["gt_overlaps"].toarray()[p][3] == -1).all()
    rep = db.report["datasets"][0]["proposals"]
    assert rep["proposals_duplicate"] == 1 and rep["proposals_min_size"] == 1
    assert rep["proposals_crowd_filtered"] == 1 and rep["proposals_kept"] == 5
    # Detectron semantics: filtering: image 3 (no gt) has no proposals -> filtered; image 2 (crowd
    # only) too
    assert sorted(set(db.ids.tolist())) == [1]


def test_proposal_limit(tmp_path):
    props = [[0, 0, 10, 10], [20, 20, 30, 30], [40, 20, 50, 30], [5, 5, 20, 20]]
    db, ev = _proposal_db(tmp_path, props, limit=2)
    e = db[0]
    np.testing.assert_array_equal(e["boxes"][e["gt_classes"] == 0], np.array(props[:2],
                                                                              np.float32))
    # evaluation uses TEST.PROPOSAL_LIMIT (2000) and no crowd filter
    e1 = ev[[int(i) for i in ev.ids].index(1)]
    assert (e1["gt_classes"] == 0).sum() == 4


def test_by_name_category_policy(tmp_path):
    a = make_coco(1, categories=[{"id": 1, "name": "x"}, {"id": 2, "name": "y"}])
    b = make_coco(2, categories=[{"id": 7, "name": "y"}, {"id": 3, "name": "z"}])
    cat = write_dataset(str(tmp_path), "a", a)
    write_dataset(str(tmp_path), "b", b, catalog=cat)
    db = combined_roidb_for_training(["a", "b"], (), get_cfg(), str(tmp_path / "c"),
                                     catalog=cat, category_policy="by_name")
    infos = {d.name: d for d in db.datasets}
    assert infos["a"].classes == infos["b"].classes == ("__background__", "x", "y", "z")
    assert infos["b"].json_category_id_to_contiguous_id == {7: 2, 3: 3}
    for i in range(len(db)):
        e = db[i]
        assert e["gt_overlaps"].shape[1] == 4
    det = combined_roidb_for_training(["a", "b"], (), get_cfg(), str(tmp_path / "c"),
                                      catalog=cat, category_policy="detectron")
    assert {d.name: d.classes for d in det.datasets}["b"] == ("__background__", "y", "z")
