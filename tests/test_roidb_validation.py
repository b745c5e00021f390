"""Build-time validation of every field the roidb reads (issue #11).

Each class of bad value either gets a :class:`RoIDBInputError` naming the file, the
annotation id, the image id and the fix, or is dropped and counted in the build report
(the policy table in docs/roidb.md). Also: an empty training roidb, impossible config
values and a Fast R-CNN model without proposals are refused before training starts;
keypoints are required only where the model trains them.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from lit_roidata.config import get_cfg
from lit_roidata.roidb import RoIDBInputError, combined_roidb_for_training, roidb_for_evaluation
from lit_roidata.roidb.build import check_training_config
from roidb_fixtures import KEYPOINTS, make_coco, rle_string, uncompressed_counts, write_dataset


def build(tmp_path, data, proposals=(), **kw):
    cat = write_dataset(str(tmp_path), "bad", data)
    cfg = kw.pop("cfg", get_cfg())
    return combined_roidb_for_training("bad", proposals, cfg, str(tmp_path / "c"), catalog=cat,
                                       **kw, trust_pickle=True)


def victim_of(data, **fields):
    """The first annotation, made a kept non-crowd box on its image, with ``fields``."""
    a = data["annotations"][0]
    a.update(bbox=[1, 1, 10, 10], area=100.0, iscrowd=0, category_id=3)
    a.pop("ignore", None)
    a.update(fields)
    return a


def named(a, *fix_words):
    """Regex: file, annotation id, image id, then the fix words (in order)."""
    words = ".*".join(fix_words)
    return rf"ann\.json: annotation id {a['id']} \(image id {a['image_id']}\).*{words}"


def image_of(data, a):
    return next(im for im in data["images"] if im["id"] == a["image_id"])


# ----------------------------------------------------------------- segmentations
def test_null_polygon_coordinate(tmp_path):
    data = make_coco(1)
    a = victim_of(data, segmentation=[[1.0, 2.0, None, 4.0, 5.0, 6.0]])
    with pytest.raises(RoIDBInputError, match=named(a, "polygon coordinate None", "Fix")):
        build(tmp_path, data)


def test_odd_length_polygon(tmp_path):
    data = make_coco(2)
    a = victim_of(data, segmentation=[[1, 2, 3, 4, 5, 6, 7]])
    with pytest.raises(RoIDBInputError, match=named(a, "odd number of coordinates", "fix")):
        build(tmp_path, data)


def test_short_polygon_is_dropped_and_counted(tmp_path):
    data = make_coco(2)
    victim_of(data, segmentation=[[1, 2, 3, 4], [1, 1, 8, 1, 8, 8]])
    db = build(tmp_path, data)
    assert db.report["datasets"][0]["segms"]["polygon_lt_6_coords"] >= 1


def test_non_crowd_rle_of_wrong_size(tmp_path):
    data = make_coco(3)
    a = victim_of(data)
    im = image_of(data, a)
    m = np.zeros((im["height"] + 1, im["width"]), np.uint8)
    m[2:5, 2:5] = 1
    a["segmentation"] = {"size": [im["height"] + 1, im["width"]], "counts": rle_string(m)}
    with pytest.raises(RoIDBInputError, match=named(a, "RLE of size", "not line up",
                                                    "re-encode")):
        build(tmp_path, data)


@pytest.mark.parametrize("compressed", [False, True])
def test_rle_counts_not_covering_the_image(tmp_path, compressed):
    data = make_coco(4)
    a = victim_of(data)
    im = image_of(data, a)
    h, w = im["height"], im["width"]
    m = np.zeros((h, w - 1), np.uint8)  # one column short
    m[1:4, 1:4] = 1
    counts = rle_string(m) if compressed else uncompressed_counts(m)
    a["segmentation"] = {"size": [h, w], "counts": counts}
    with pytest.raises(RoIDBInputError, match=named(a, f"not height x width = {h * w}")):
        build(tmp_path, data)


def test_rle_counts_as_an_int(tmp_path):
    data = make_coco(5)
    a = victim_of(data)
    im = image_of(data, a)
    a["segmentation"] = {"size": [im["height"], im["width"]], "counts": 4032}
    with pytest.raises(RoIDBInputError, match=named(a, "RLE 'counts' 4032", "compressed")):
        build(tmp_path, data)


def test_valid_rles_of_both_kinds_are_kept_exactly(tmp_path):
    data = make_coco(6)
    a = victim_of(data)
    im = image_of(data, a)
    m = np.zeros((im["height"], im["width"]), np.uint8)
    m[3:9, 2:7] = 1
    a.update(iscrowd=1, segmentation={"size": [im["height"], im["width"]],
                                      "counts": rle_string(m)})
    b = data["annotations"][1]
    b.pop("ignore", None)
    bim = image_of(data, b)
    mb = np.zeros((bim["height"], bim["width"]), np.uint8)
    mb[1:3, 1:5] = 1
    b.update(bbox=[1, 1, 4, 2], area=8.0, iscrowd=1, category_id=3,
             segmentation={"size": [bim["height"], bim["width"]],
                           "counts": uncompressed_counts(mb)})
    cat = write_dataset(str(tmp_path), "ok", data)
    db = roidb_for_evaluation("ok", get_cfg(), str(tmp_path / "c"), catalog=cat)
    segs = [s for i in range(len(db)) for s in db[i]["segms"]]
    assert a["segmentation"] in segs and b["segmentation"] in segs


# ---------------------------------------------------------------------- keypoints
def test_null_keypoint_coordinate(tmp_path):
    data = make_coco(7, keypoints=True)
    kp = [0.0] * 51
    kp[0:3] = [4.0, None, 2]
    a = victim_of(data, category_id=1, keypoints=kp)
    with pytest.raises(RoIDBInputError, match=named(a, "keypoint value None", "0, 0, 0")):
        build(tmp_path, data)


def test_keypoint_string(tmp_path):
    data = make_coco(8, keypoints=True)
    kp = [0] * 51
    kp[3] = "12"
    a = victim_of(data, category_id=1, keypoints=kp)
    with pytest.raises(RoIDBInputError, match=named(a, "keypoint value '12'", "Fix")):
        build(tmp_path, data)


def test_keypoint_out_of_int32_range(tmp_path):
    data = make_coco(8, keypoints=True)
    kp = [0] * 51
    kp[0:3] = [1e12, 3, 2]
    a = victim_of(data, category_id=1, keypoints=kp)
    with pytest.raises(RoIDBInputError, match=named(a, "int32 range")):
        build(tmp_path, data)


def _person_only_keypoints(seed):
    """An instances file: 'person' lists keypoints, only person annotations carry them."""
    data = make_coco(seed, n_images=8, keypoints=True)
    for a in data["annotations"]:
        if a["category_id"] != 1:
            a.pop("keypoints", None)
            a.pop("num_keypoints", None)
    return data


def test_box_only_model_accepts_instances_with_person_keypoints(tmp_path):
    data = _person_only_keypoints(9)
    data["annotations"][0].update(category_id=1)
    data["annotations"][0].pop("keypoints", None)  # even a person without keypoints
    db = build(tmp_path, data)
    assert len(db) > 0


def test_keypoint_model_requires_them_only_for_the_keypoint_category(tmp_path):
    data = _person_only_keypoints(10)
    cfg = get_cfg()
    cfg.MODEL.KEYPOINTS_ON = True
    db = build(tmp_path, data, cfg=cfg)
    by_id = {}
    for a in data["annotations"]:
        by_id.setdefault(a["image_id"], []).append(a)
    checked = 0
    for i in range(len(db)):
        e = db[i]
        if e["flipped"]:
            continue
        kps = e["gt_keypoints"]
        assert kps.shape == (e["gt_classes"].size, 3, len(KEYPOINTS)) and kps.dtype == np.int32
        persons = e["gt_classes"] == list(e["dataset"].classes).index("person")
        assert not kps[~persons].any()  # rows without keypoints: zeros, as Detectron fills
        for row in np.flatnonzero(persons):
            exp = next(a for a in by_id[e["id"]] if a["category_id"] == 1
                       and np.isclose(e["seg_areas"][row], a["area"]))
            want = np.array(exp["keypoints"], np.float64).reshape(-1, 3).T.astype(np.int32)
            np.testing.assert_array_equal(kps[row], want)  # float truncation, like Detectron
            checked += 1
    assert checked > 0


# ------------------------------------------------------------------ ids and types
def test_annotation_without_category_id(tmp_path):
    data = make_coco(11)
    a = victim_of(data)
    del a["category_id"]
    with pytest.raises(RoIDBInputError, match=named(a, "no 'category_id'", "categories")):
        build(tmp_path, data)


@pytest.mark.parametrize("value", ["car", "3", 3.5, None])
def test_non_integer_category_id(tmp_path, value):
    data = make_coco(12)
    a = victim_of(data, category_id=value)
    with pytest.raises(RoIDBInputError, match=named(a, "category_id=", "expected an integer")):
        build(tmp_path, data)


def test_non_string_file_name(tmp_path):
    data = make_coco(13)
    write_dataset(str(tmp_path), "bad", data)  # image files under the real names
    data["images"][0]["file_name"] = 17
    cat = write_dataset(str(tmp_path), "bad", data, images=False)
    with pytest.raises(RoIDBInputError, match=rf"image id {data['images'][0]['id']} has "
                                              rf"file_name=17"):
        combined_roidb_for_training("bad", (), get_cfg(), str(tmp_path / "c"), catalog=cat)


# ------------------------------------------------------- empty roidb, config checks
def test_all_crowd_dataset_fails_at_build_naming_dataset_filter_and_fix(tmp_path):
    data = make_coco(14, rle=False)
    for a in data["annotations"]:
        a["iscrowd"] = 1
    with pytest.raises(RoIDBInputError) as ei:
        build(tmp_path, data)
    msg = str(ei.value)
    assert "training dataset 'bad'" in msg and "no trainable image left" in msg
    assert "filter_for_training removed" in msg and "no foreground" in msg
    assert "add non-crowd annotations" in msg


def test_dataset_emptied_among_others_is_a_warning(tmp_path, caplog):
    good = make_coco(15)
    crowd = make_coco(16, rle=False)
    for a in crowd["annotations"]:
        a["iscrowd"] = 1
    cat = write_dataset(str(tmp_path), "good", good)
    write_dataset(str(tmp_path), "crowd", crowd, catalog=cat)
    import logging

    with caplog.at_level(logging.WARNING):
        db = combined_roidb_for_training(["good", "crowd"], (), get_cfg(), str(tmp_path / "c"),
                                         catalog=cat)
    assert len(db) > 0
    assert any("'crowd'" in w for w in db.report["warnings"])
    assert any("'crowd'" in r.getMessage() and "no trainable image" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("ims", [0, -2])
def test_ims_per_batch_rejected_before_the_roidb_is_built(tmp_path, ims):
    from lit_roidata import RoIDataModule

    data = make_coco(17)
    cat = write_dataset(str(tmp_path), "ok", data)
    yaml = tmp_path / "catalog.yaml"
    spec = cat.get("ok")
    yaml.write_text(f"datasets:\n  ok:\n    image_dir: {spec.image_dir}\n    "
                    f"annotation_file: {spec.annotation_file}\n")
    dm = RoIDataModule(datasets={"train": ["ok"]}, model_type="faster_rcnn",
                       sources={"dataset_catalog": str(yaml), "cache_dir": str(tmp_path / "c")},
                       overrides={"TRAIN.IMS_PER_BATCH": ims})
    for call in (dm.prepare_data, lambda: dm.setup("fit")):
        with pytest.raises(ValueError, match=rf"TRAIN.IMS_PER_BATCH={ims}.*integer >= 1"):
            call()
    assert not os.path.exists(tmp_path / "c") or not any(
        n.startswith("roidb-") for n in os.listdir(tmp_path / "c"))


def test_other_impossible_values_listed_together():
    cfg = get_cfg()
    cfg.merge_from_dict({"TRAIN.SCALES": (), "TRAIN.MAX_SIZE": 0, "TRAIN.FG_FRACTION": 1.5,
                         "MODEL.FASTER_RCNN": True})
    with pytest.raises(ValueError) as ei:
        check_training_config(cfg, (), ["a"])
    msg = str(ei.value)
    assert "TRAIN.SCALES" in msg and "TRAIN.MAX_SIZE" in msg and "TRAIN.FG_FRACTION" in msg


def test_fast_rcnn_without_proposals_is_refused_with_the_fix(tmp_path):
    from lit_roidata import RoIDataModule
    from lit_roidata.minibatch.model_type import flags_for_model_type

    cfg = get_cfg()
    cfg.merge_from_dict(flags_for_model_type("fast_rcnn"))
    with pytest.raises(ValueError, match=r"Fast R-CNN.*no proposal file.*'a'.*Add proposal "
                                         r"files.*end-to-end model_type"):
        check_training_config(cfg, (), ["a"])
    check_training_config(cfg, ["p.pkl"], ["a"])  # with proposals: fine
    cfg.merge_from_dict(flags_for_model_type("mask_rcnn"))
    check_training_config(cfg, (), ["a"])  # e2e: proposals come from the RPN
    dm = RoIDataModule(datasets={"train": ["x"]}, model_type="fast_rcnn",
                       sources={"cache_dir": str(tmp_path / "c")})
    with pytest.raises(ValueError, match="no proposal file"):
        dm.setup("fit")
