"""COCO results conversion and the COCOEvaluator callback."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import pytorch_lightning as pl
import torch
from pycocotools import mask as mask_utils

from lit_roidata.evaluation import COCOEvaluator, coco_category_map, detections_to_coco_results
from evaluation_support import OracleDetector

INFO = SimpleNamespace(contiguous_category_id_to_json_id={1: 3, 2: 7})


def test_boxes_to_xywh_and_json_ids_by_hand() -> None:
    det = {"image_id": 42, "dataset": "d", "boxes": torch.tensor([[10.0, 20.0, 29.0, 59.0],
                                                                  [0.0, 0.0, 0.0, 0.0]]),
           "scores": torch.tensor([0.9, 0.25]), "labels": torch.tensor([2, 1])}
    res = detections_to_coco_results([det], INFO)
    assert res == [
        {"image_id": 42, "category_id": 7, "bbox": [10.0, 20.0, 20.0, 40.0],
         "score": pytest.approx(0.9)},
        {"image_id": 42, "category_id": 3, "bbox": [0.0, 0.0, 1.0, 1.0],
         "score": pytest.approx(0.25)},
    ]
    # a {dataset name: info} mapping and a plain {contiguous: json} map work too
    assert detections_to_coco_results([det], {"d": INFO}) == res
    assert detections_to_coco_results([det], {1: 3, 2: 7}) == res


def test_empty_image_and_bad_labels() -> None:
    empty = {"image_id": 1, "boxes": np.zeros((0, 4)), "scores": np.zeros(0),
             "labels": np.zeros(0, int)}
    assert detections_to_coco_results([empty], INFO) == []
    bad = {"image_id": 5, "boxes": np.ones((1, 4)), "scores": [0.5], "labels": [0]}
    with pytest.raises(ValueError, match=r"image 5.*labels \[0\]"):
        detections_to_coco_results([bad], INFO)
    ragged = {"image_id": 6, "boxes": np.ones((2, 4)), "scores": [0.5], "labels": [1, 1]}
    with pytest.raises(ValueError, match="image 6"):
        detections_to_coco_results([ragged], INFO)


def test_masks_become_rle() -> None:
    m = np.zeros((6, 8), np.uint8)
    m[1:4, 2:7] = 1
    det = {"image_id": 3, "boxes": [[2, 1, 6, 3]], "scores": [1.0], "labels": [1], "masks": m[None]}
    (res,) = detections_to_coco_results([det], INFO)
    assert isinstance(res["segmentation"]["counts"], str)
    json.dumps(res)
    back = mask_utils.decode({"size": res["segmentation"]["size"],
                              "counts": res["segmentation"]["counts"].encode()})
    np.testing.assert_array_equal(back, m)


def _tiny_coco(tmp_path: Path) -> tuple[str, list[dict]]:
    images = [{"id": i, "file_name": f"{i}.jpg", "width": 100, "height": 80} for i in (5, 9, 11)]
    cats = [{"id": 3, "name": "a"}, {"id": 7, "name": "b"}]
    boxes = [(5, 3, 10, 10, 20, 30), (5, 7, 50, 40, 30, 25), (9, 3, 0, 0, 40, 40),
             (11, 7, 60, 10, 30, 60), (11, 3, 5, 50, 20, 20)]
    anns = [{"id": k + 1, "image_id": im, "category_id": c, "bbox": [x, y, w, h],
             "area": float(w * h), "iscrowd": 0,
             "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]]}
            for k, (im, c, x, y, w, h) in enumerate(boxes)]
    crowd = np.zeros((80, 100), np.uint8)
    crowd[60:75, 60:90] = 1
    rle = mask_utils.encode(np.asfortranarray(crowd))
    rle["counts"] = rle["counts"].decode()
    anns.append({"id": 99, "image_id": 9, "category_id": 7, "bbox": [60, 60, 30, 15],
                 "area": 450.0, "iscrowd": 1, "segmentation": rle})
    path = tmp_path / "ann.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return str(path), anns


def _perfect(anns: list[dict], shift: float = 0.0) -> list[dict]:
    j2c = {3: 1, 7: 2}
    out = []
    for im in (5, 9, 11):
        rows = [a for a in anns if a["image_id"] == im and not a["iscrowd"]]
        # xywh -> Detectron's x1, y1, x2, y2 (+1): x2 = x + w - 1
        boxes = np.array([[a["bbox"][0] + shift, a["bbox"][1], a["bbox"][0] + a["bbox"][2] - 1
                           + shift, a["bbox"][1] + a["bbox"][3] - 1] for a in rows])
        out.append({"image_id": im, "dataset": "tiny", "boxes": boxes.reshape(-1, 4),
                    "scores": np.linspace(0.9, 0.8, len(rows)),
                    "labels": np.array([j2c[a["category_id"]] for a in rows])})
    return out


def test_evaluator_perfect_and_shifted(tmp_path: Path) -> None:
    ann_file, anns = _tiny_coco(tmp_path)
    ev = COCOEvaluator(annotation_files={"tiny": ann_file}, output_dir=str(tmp_path / "out"),
                       print_summary=False)
    perfect = ev.evaluate(_perfect(anns))
    assert perfect["val/bbox_AP"] == pytest.approx(1.0)
    assert perfect["val/bbox_AP50"] == pytest.approx(1.0)
    assert "val/segm_AP" not in perfect  # no masks given
    shifted = ev.evaluate(_perfect(anns, shift=6.0))
    assert 0.0 < shifted["val/bbox_AP"] < 0.9
    written = json.loads((tmp_path / "out" / "val_bbox_tiny_results.json").read_text())
    assert len(written) == 5 and {r["category_id"] for r in written} == {3, 7}
    # a missed image counts: dropping image 11's detections lowers recall
    partial = _perfect(anns)
    partial[2] = {**partial[2], "boxes": np.zeros((0, 4)), "scores": np.zeros(0),
                  "labels": np.zeros(0, int)}
    assert ev.evaluate(partial)["val/bbox_AP"] < 1.0
    # an image seen twice (DistributedSampler padding) is evaluated once
    twice = _perfect(anns)
    assert ev.evaluate(twice + twice[:1])["val/bbox_AP"] == pytest.approx(1.0)


def test_evaluator_masks(tmp_path: Path) -> None:
    ann_file, anns = _tiny_coco(tmp_path)
    from pycocotools.coco import COCO

    coco = COCO(ann_file)
    dets = _perfect(anns)
    for d in dets:
        rows = [a for a in anns if a["image_id"] == d["image_id"] and not a["iscrowd"]]
        d["masks"] = np.stack([coco.annToMask(a) for a in rows])
    m = COCOEvaluator(annotation_files={"tiny": ann_file}, print_summary=False).evaluate(
        dets, prefix="test")
    assert m["test/segm_AP"] == pytest.approx(1.0) and m["test/bbox_AP"] == pytest.approx(1.0)


def test_unknown_image_and_category_map(tmp_path: Path) -> None:
    ann_file, anns = _tiny_coco(tmp_path)
    from pycocotools.coco import COCO

    assert coco_category_map(COCO(ann_file)) == {1: 3, 2: 7}
    ev = COCOEvaluator(annotation_files={"tiny": ann_file}, print_summary=False)
    dets = _perfect(anns)
    dets[0] = {**dets[0], "image_id": 12345}
    with pytest.raises(ValueError, match="12345"):
        ev.evaluate(dets)
    with pytest.raises(ValueError, match="iou_types"):
        COCOEvaluator(iou_types=("keypoint",))




def test_callback_in_trainer(tmp_path: Path) -> None:
    ann_file, anns = _tiny_coco(tmp_path)
    ev = COCOEvaluator(annotation_files={"tiny": ann_file})
    trainer = pl.Trainer(accelerator="cpu", devices=1, callbacks=[ev], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    loader = torch.utils.data.DataLoader(torch.arange(3), batch_size=1)
    trainer.validate(OracleDetector(_perfect(anns)), dataloaders=loader, verbose=False)
    assert trainer.callback_metrics["val/bbox_AP"].item() == pytest.approx(1.0)
    assert ev.last_metrics["val/bbox_AP50"] == pytest.approx(1.0)


class _Silent(OracleDetector):
    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        return None


def test_callback_warns_without_detections(tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    ann_file, _ = _tiny_coco(tmp_path)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[COCOEvaluator(annotation_files={"tiny": ann_file})])
    loader = torch.utils.data.DataLoader(torch.arange(2), batch_size=1)
    with caplog.at_level("WARNING", logger="lit_roidata.evaluation"):
        trainer.validate(_Silent([]), dataloaders=loader, verbose=False)
    assert "no detections were returned" in caplog.text
    assert "val/bbox_AP" not in trainer.callback_metrics




@settings(deadline=None, max_examples=50)
@given(st.lists(st.tuples(st.floats(0, 500), st.floats(0, 500), st.floats(0, 300),
                          st.floats(0, 300), st.floats(0, 1), st.integers(1, 4)),
                max_size=20))
def test_results_roundtrip_property(rows: list) -> None:
    """xywh -> x1y1x2y2 (+1) gives the input back; every label maps to its json id."""
    c2j = {1: 1, 2: 3, 3: 7, 4: 12}
    boxes = np.array([[x, y, x + w, y + h] for x, y, w, h, _, _ in rows]).reshape(-1, 4)
    det = {"image_id": 1, "boxes": boxes, "scores": [r[4] for r in rows],
           "labels": [r[5] for r in rows]}
    res = detections_to_coco_results([det], c2j)
    assert len(res) == len(rows)
    for r, (x, y, w, h, s, lab), b in zip(res, rows, boxes):
        bx, by, bw, bh = r["bbox"]
        np.testing.assert_allclose([bx, by, bx + bw - 1, by + bh - 1], b, atol=2e-3)
        assert bw == pytest.approx(w + 1, abs=1e-3) and r["category_id"] == c2j[lab]
        assert r["score"] == pytest.approx(s)


def test_keypoint_results_and_ap(tmp_path: Path) -> None:
    """Keypoints become COCO's flat x, y, v=1 lists scored by the box; perfect keypoints
    give OKS AP 1 (on the category that defines keypoints only), shifted ones less."""
    ann_file, anns = _tiny_coco(tmp_path)
    data = json.loads(Path(ann_file).read_text())
    data["categories"][0]["keypoints"] = [f"k{i}" for i in range(17)]
    rng = np.random.default_rng(0)
    for a in data["annotations"]:
        if a["category_id"] == 3 and not a["iscrowd"]:
            x, y, w, h = a["bbox"]
            kp = np.stack([x + rng.uniform(0, w, 17), y + rng.uniform(0, h, 17),
                           np.full(17, 2.0)], 1)
            a["keypoints"], a["num_keypoints"] = kp.reshape(-1).round(1).tolist(), 17
        else:
            a["keypoints"], a["num_keypoints"] = [0] * 51, 0
    Path(ann_file).write_text(json.dumps(data))
    by_id = {a["id"]: a for a in data["annotations"]}
    dets = _perfect(anns)
    for d in dets:
        rows = [a for a in anns if a["image_id"] == d["image_id"] and not a["iscrowd"]]
        d["keypoints"] = np.array([np.asarray(by_id[a["id"]]["keypoints"], float).reshape(17, 3)
                                   for a in rows]).reshape(-1, 17, 3)
    res = detections_to_coco_results(dets[:1], {1: 3, 2: 7})
    assert res[0]["keypoints"][:3] == [round(v, 2) for v in dets[0]["keypoints"][0, 0, :2]] + [1.0]
    assert res[0]["score"] == pytest.approx(0.9)  # the box score (KEYPOINT_CONFIDENCE: bbox)
    ev = COCOEvaluator(annotation_files={"tiny": ann_file}, print_summary=False)
    m = ev.evaluate(dets)
    assert m["val/keypoints_AP"] == pytest.approx(1.0) and m["val/bbox_AP"] == pytest.approx(1.0)
    for d in dets:
        d["keypoints"][..., :2] += 6.0
    assert ev.evaluate(dets)["val/keypoints_AP"] < 0.9
    with pytest.raises(ValueError, match="OKS sigmas"):
        COCOEvaluator(annotation_files={"tiny": ann_file}, print_summary=False,
                      kpt_oks_sigmas=[0.1] * 5).evaluate(dets)
