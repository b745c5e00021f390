"""Each bad input gets an error naming the file, the image id and the fix (issue #2 item 7)."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest

from lit_roidata.catalog import Catalog
from lit_roidata.config import get_cfg
from lit_roidata.roidb import RoIDBInputError, combined_roidb_for_training
from roidb_fixtures import make_coco, make_proposals, write_dataset


def build(tmp_path, data, proposals=(), **kw):
    cat = write_dataset(str(tmp_path), "bad", data, images=kw.pop("images", True))
    cfg = kw.pop("cfg", get_cfg())
    return combined_roidb_for_training("bad", proposals, cfg, str(tmp_path / "c"), catalog=cat,
                                       **kw, trust_pickle=True)


def test_malformed_json_names_file_and_position(tmp_path):
    cat = Catalog(builtins=False)
    p = tmp_path / "broken.json"
    p.write_text('{"images": [\n  {"id": 1,, "width": 3}\n]}')
    cat.register("broken", str(tmp_path), str(p))
    with pytest.raises(RoIDBInputError, match=r"broken\.json: malformed JSON at line 2, column"):
        combined_roidb_for_training("broken", (), get_cfg(), str(tmp_path / "c"), catalog=cat)


def test_missing_images_named_and_counted(tmp_path):
    data = make_coco(1, n_images=8)
    cat = write_dataset(str(tmp_path), "bad", data)
    names = sorted(im["file_name"] for im in data["images"])
    for fn in names[:6]:
        os.unlink(os.path.join(tmp_path, "bad", "images", fn))
    with pytest.raises(RoIDBInputError, match=r"6 of 8 images are missing") as ei:
        combined_roidb_for_training("bad", (), get_cfg(), str(tmp_path / "c"), catalog=cat)
    assert names[0] in str(ei.value) and "check_images=False" in str(ei.value)
    db = combined_roidb_for_training("bad", (), get_cfg(), str(tmp_path / "c"), catalog=cat,
                                     check_images=False)
    assert len(db) > 0


def test_zero_width_image(tmp_path):
    data = make_coco(2)
    data["images"][1]["width"] = 0
    bad_id = data["images"][1]["id"]
    with pytest.raises(RoIDBInputError, match=rf"id {bad_id} \(0x\d+\).*Fix 'width'/'height'"):
        build(tmp_path, data)


def test_unknown_category(tmp_path):
    data = make_coco(3)
    data["annotations"][0].update(category_id=999, bbox=[1, 1, 10, 10], area=100.0)
    data["annotations"][0].pop("ignore", None)
    with pytest.raises(RoIDBInputError, match=r"category_id 999"):
        build(tmp_path, data)


def test_bad_bbox(tmp_path):
    data = make_coco(4)
    data["annotations"][1]["bbox"] = [1, 2, 3]
    with pytest.raises(RoIDBInputError, match=r"annotation id 2 .*expected \[x, y, width"):
        build(tmp_path, data)


def test_keypoint_annotation_without_keypoints(tmp_path):
    """Missing keypoints are an error only where the model trains keypoints (person rows)."""
    data = make_coco(5, keypoints=True)
    victim = data["annotations"][0]
    del victim["keypoints"]
    victim.update(bbox=[1, 1, 10, 10], area=100.0, iscrowd=0, category_id=1)
    victim.pop("ignore", None)
    cfg = get_cfg()
    cfg.MODEL.KEYPOINTS_ON = True
    with pytest.raises(RoIDBInputError,
                       match=rf"MODEL.KEYPOINTS_ON.*no 'keypoints' field: annotation id "
                             rf"{victim['id']} \(image id {victim['image_id']}\)"):
        build(tmp_path, data, cfg=cfg)
    db = build(tmp_path, data)  # a box-only model accepts it; the row gets zeros
    assert len(db) > 0


def test_keypoints_wrong_length(tmp_path):
    data = make_coco(5, keypoints=True)
    victim = data["annotations"][0]
    victim.update(bbox=[1, 1, 10, 10], area=100.0, iscrowd=0, keypoints=[1, 2, 2])
    victim.pop("ignore", None)
    with pytest.raises(RoIDBInputError, match=r"has 3 keypoint values, expected 3 x 17"):
        build(tmp_path, data)


def test_proposal_ids_missing(tmp_path):
    data = make_coco(6)
    p = make_proposals(1, data, str(tmp_path / "p.pkl"))
    with open(p, "rb") as fh:
        d = pickle.load(fh)
    gone = d["ids"][0]
    for k in ("ids", "boxes", "scores"):
        d[k] = d[k][1:]
    with open(p, "wb") as fh:
        pickle.dump(d, fh)
    with pytest.raises(RoIDBInputError, match=rf"p\.pkl: no proposals for 1 of \d+ dataset "
                                              rf"images \(e\.g\. image ids \[{gone}\]\)"):
        build(tmp_path, data, [p])


def test_proposal_extra_ids_removed_and_counted(tmp_path):
    data = make_coco(6)
    p = make_proposals(1, data, str(tmp_path / "p.pkl"), extra_ids=(777, 778))
    db = build(tmp_path, data, [p])
    assert db.report["datasets"][0]["proposals"]["proposal_records_not_in_dataset"] == 2


def test_proposal_duplicate_ids(tmp_path):
    data = make_coco(6)
    p = str(tmp_path / "p.pkl")
    iid = data["images"][0]["id"]
    with open(p, "wb") as fh:
        pickle.dump({"boxes": [np.zeros((0, 4))] * 2, "scores": [np.zeros(0)] * 2,
                     "ids": [iid, iid]}, fh)
    with pytest.raises(RoIDBInputError, match=rf"appear more than once: \[{iid}\]"):
        build(tmp_path, data, [p])


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_proposal_nan_inf(tmp_path, value):
    data = make_coco(7)
    p = make_proposals(1, data, str(tmp_path / "p.pkl"), per_image=5)
    with open(p, "rb") as fh:
        d = pickle.load(fh)
    j = next(i for i, b in enumerate(d["boxes"]) if len(b))
    d["boxes"][j][0, 2] = value
    with open(p, "wb") as fh:
        pickle.dump(d, fh)
    with pytest.raises(RoIDBInputError, match=rf"NaN or infinite coordinates \(image ids "
                                              rf"\[{d['ids'][j]}\]"):
        build(tmp_path, data, [p])


def test_proposal_wrong_shape(tmp_path):
    data = make_coco(8)
    p = str(tmp_path / "p.npz")
    ids = [im["id"] for im in data["images"]]
    with open(str(tmp_path / "p.pkl"), "wb") as fh:
        pickle.dump({"boxes": [np.zeros((2, 5))] * len(ids), "scores": [np.zeros(2)] * len(ids),
                     "ids": ids}, fh)
    with pytest.raises(RoIDBInputError, match=rf"record 0 \(image id {ids[0]}\) has boxes of "
                                              rf"shape \(2, 5\)"):
        build(tmp_path, data, [str(tmp_path / "p.pkl")])
    np.savez(p, ids=np.array(ids), counts=np.ones(len(ids), int), boxes=np.zeros((len(ids), 3)))
    with pytest.raises(RoIDBInputError, match=r"inconsistent shapes"):
        build(tmp_path, data, [p])


def test_proposal_not_a_pickle(tmp_path):
    data = make_coco(8)
    p = tmp_path / "p.pkl"
    p.write_bytes(b"not a pickle")
    with pytest.raises(RoIDBInputError, match=r"cannot unpickle"):
        build(tmp_path, data, [str(p)])


def test_category_mismatch_shows_diff(tmp_path):
    a = make_coco(1, categories=[{"id": 1, "name": "x"}, {"id": 2, "name": "y"}])
    b = make_coco(2, categories=[{"id": 1, "name": "x"}, {"id": 2, "name": "z"}])
    cat = write_dataset(str(tmp_path), "a", a)
    write_dataset(str(tmp_path), "b", b, catalog=cat)
    with pytest.raises(RoIDBInputError, match=r"(?s)different categories.*-2: y\n\+2: z.*by_name"):
        combined_roidb_for_training(["a", "b"], (), get_cfg(), str(tmp_path / "c"), catalog=cat)


def test_unknown_dataset_and_argument_errors(tmp_path):
    cat = write_dataset(str(tmp_path), "ok", make_coco(1))
    with pytest.raises(KeyError, match=r"'nope' is not in the catalog.*Known datasets: ok"):
        combined_roidb_for_training("nope", (), get_cfg(), str(tmp_path / "c"), catalog=cat)
    with pytest.raises(ValueError, match=r"1 dataset\(s\) \['ok'\] but 2 proposal"):
        combined_roidb_for_training("ok", ["a", "b"], get_cfg(), str(tmp_path / "c"),
                                    catalog=cat)
    with pytest.raises(ValueError, match=r"category_policy"):
        combined_roidb_for_training("ok", (), get_cfg(), str(tmp_path / "c"), catalog=cat,
                                    category_policy="loose")


def test_annotation_for_unknown_image_is_counted(tmp_path):
    data = make_coco(9)
    data["annotations"].append(dict(data["annotations"][0], id=9999, image_id=123456))
    db = build(tmp_path, data)
    assert db.report["datasets"][0]["dropped"]["annotation_unknown_image"] == 1


def test_no_images_list(tmp_path):
    cat = Catalog(builtins=False)
    p = tmp_path / "x.json"
    p.write_text(json.dumps({"annotations": []}))
    cat.register("x", str(tmp_path), str(p))
    with pytest.raises(RoIDBInputError, match=r"no 'images' list"):
        combined_roidb_for_training("x", (), get_cfg(), str(tmp_path / "c"), catalog=cat)


@pytest.mark.parametrize("seg", [[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], {"size": [10, 10]}, 5])
def test_malformed_segmentation(tmp_path, seg):
    data = make_coco(10)
    victim = data["annotations"][0]
    victim.update(bbox=[1, 1, 10, 10], area=100.0, segmentation=seg, iscrowd=0)
    victim.pop("ignore", None)
    with pytest.raises(RoIDBInputError, match=rf"annotation id {victim['id']} \(image id "
                                              rf"{victim['image_id']}\) has a malformed"):
        build(tmp_path, data)
