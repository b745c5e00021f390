"""LVISEvaluator: federated LVIS AP, checked against the official ``lvis`` API's LVISEval.

The official API is a test dependency (``pip install --no-deps lvis``, done by .ci/run);
tests/lvis_support.py skips the cross-checks where it is missing, except in CI.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_roidata.evaluation import COCOEvaluator, detections_to_coco_results
from lit_roidata.lvis_evaluation import LVISEvaluator, limit_dets_per_image
from lvis_support import (make_detections, make_lvis_gt, official_key, official_lvis,
                          official_lvis_eval)
from evaluation_support import OracleDetector

pytest.importorskip("faster_coco_eval")

STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "APr", "APc", "APf",
         "AR", "ARs", "ARm", "ARl")
N_CATS = 9
ID_MAP = {c: c for c in range(1, N_CATS + 1)}  # LVIS ids already run 1..n


def _write(tmp: Path, gt: dict[str, Any]) -> str:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "lvis_tiny.json"
    path.write_text(json.dumps(gt))
    return str(path)


def _ours(ann_file: str, dets: list[dict[str, Any]], iou: str, cap: int) -> dict[str, float]:
    ev = LVISEvaluator(iou_types=(iou,), annotation_files={"lvis_tiny": ann_file},
                       print_summary=False, max_dets_per_image=cap)
    m = ev.evaluate(dets)
    return {s: m[f"val/lvis_{iou}_{s}"] for s in STATS}


def _theirs(lvis: Any, gt: dict[str, Any], dets: list[dict[str, Any]], iou: str, cap: int,
            image_ids: Any = None) -> dict[str, float]:
    results = detections_to_coco_results(dets, ID_MAP)
    if iou == "bbox":
        results = [{k: v for k, v in r.items() if k != "segmentation"} for r in results]
    got = official_lvis_eval(lvis, gt, results, iou, image_ids=image_ids, max_dets=cap)
    key = official_key(cap)
    return {s: got[key(s)] for s in STATS}


def _assert_close(ours: dict[str, float], theirs: dict[str, float]) -> None:
    for s in STATS:
        assert ours[s] == pytest.approx(theirs[s], abs=1e-6), (s, ours, theirs)


# -- agreement with the official LVISEval ---------------------------------------------------
@settings(deadline=None, max_examples=25,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2 ** 32 - 1), cap=st.sampled_from([4, 10, 300]),
       ties=st.booleans(), n_images=st.integers(1, 10))
def test_bbox_matches_official_lvis_eval(tmp_path: Path, seed: int, cap: int, ties: bool,
                                         n_images: int) -> None:
    """Random federated ground truth and detections (jittered hits, wrong labels, random
    boxes of federated and non-federated categories, tied scores, per-image caps that bite):
    every number equals the official LVISEval's to 1e-6."""
    lvis = official_lvis()
    rng = np.random.default_rng(seed)
    gt = make_lvis_gt(rng, n_images=n_images, n_cats=N_CATS)
    dets = make_detections(rng, gt, per_image=15, ties=ties)
    if not detections_to_coco_results(dets, ID_MAP):
        return  # the official LVISResults cannot load an empty list
    ann_file = _write(tmp_path / f"s{seed}", gt)
    _assert_close(_ours(ann_file, dets, "bbox", cap), _theirs(lvis, gt, dets, "bbox", cap))


@settings(deadline=None, max_examples=8,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2 ** 32 - 1), cap=st.sampled_from([5, 300]))
def test_segm_matches_official_lvis_eval(tmp_path: Path, seed: int, cap: int) -> None:
    """Masks (rectangles and cut rectangles as RLE) against polygon ground truth."""
    lvis = official_lvis()
    rng = np.random.default_rng(seed)
    gt = make_lvis_gt(rng, n_images=6, n_cats=N_CATS)
    dets = make_detections(rng, gt, per_image=8, masks=True)
    if not detections_to_coco_results(dets, ID_MAP):
        return
    ann_file = _write(tmp_path / f"s{seed}", gt)
    _assert_close(_ours(ann_file, dets, "segm", cap), _theirs(lvis, gt, dets, "segm", cap))


def test_real_cap_of_300_and_a_partial_image_set(tmp_path: Path) -> None:
    """LVIS's own cap (more than 300 detections on some images) and evaluation restricted
    to the images that were run (``limit_val_batches``): still the official numbers."""
    lvis = official_lvis()
    rng = np.random.default_rng(7)
    gt = make_lvis_gt(rng, n_images=12, n_cats=N_CATS, max_anns=8)
    dets = make_detections(rng, gt, per_image=420)
    assert max(len(d["boxes"]) for d in dets) > 300
    run = dets[::2]  # half the images were evaluated
    ann_file = _write(tmp_path, gt)
    ours = _ours(ann_file, run, "bbox", 300)
    theirs = _theirs(lvis, gt, run, "bbox", 300, image_ids=[d["image_id"] for d in run])
    _assert_close(ours, theirs)
    assert 0 < ours["AP"] < 1


# -- the federated rules by hand -------------------------------------------------------------
def _hand_gt(neg2: list[int], nel2: list[int], gt2: bool) -> dict[str, Any]:
    cats = [{"id": 1, "name": "a", "frequency": "f"}, {"id": 2, "name": "b", "frequency": "r"}]
    images = [{"id": 1, "width": 100, "height": 100, "neg_category_ids": [],
               "not_exhaustive_category_ids": []},
              {"id": 2, "width": 100, "height": 100, "neg_category_ids": neg2,
               "not_exhaustive_category_ids": nel2}]
    anns = [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 10, 40, 40], "area": 1600,
             "segmentation": [[10, 10, 50, 10, 50, 50, 10, 50]]}]
    if gt2:
        anns.append({"id": 2, "image_id": 2, "category_id": 1, "bbox": [60, 60, 30, 30],
                     "area": 900, "segmentation": [[60, 60, 90, 60, 90, 90, 60, 90]]})
    return {"images": images, "annotations": anns, "categories": cats}


def _hit(box: list[float], score: float) -> tuple[list[float], float]:
    x, y, w, h = box
    return [x, y, x + w - 1, y + h - 1], score


def _eval_hand(tmp_path: Path, gt: dict[str, Any], per_image: dict[int, list]) -> dict:
    dets = [{"image_id": i, "dataset": "h", "boxes": [b for b, _, _ in v],
             "scores": [s for _, s, _ in v], "labels": [c for _, _, c in v]}
            for i, v in per_image.items()]
    ann = _write(tmp_path, gt)
    return LVISEvaluator(iou_types=("bbox",), annotation_files={"h": ann},
                         print_summary=False).evaluate(dets)


def test_federated_rules_by_hand(tmp_path: Path) -> None:
    """Category a (frequent) is on image 1. A higher-scoring false 'a' on image 2:
    * image 2 lists a as negative: a false positive ranked first, precision 1/2 at every
      recall, AP = 0.5;
    * image 2 says nothing about a: the detection is dropped, AP = 1;
    * image 2 has an 'a' but lists a as not exhaustive: the unmatched one is ignored, AP = 1
      (and without the not-exhaustive mark it costs precision).
    APr is -1: no rare category has ground truth."""
    perfect = (*_hit([10, 10, 40, 40], 0.5), 1)
    false_a = (*_hit([5, 70, 20, 20], 0.9), 1)
    m = _eval_hand(tmp_path / "neg", _hand_gt([1], [], False),
                   {1: [perfect], 2: [false_a]})
    assert m["val/lvis_bbox_AP"] == pytest.approx(0.5)
    assert m["val/lvis_bbox_APf"] == pytest.approx(0.5)
    assert m["val/lvis_bbox_APr"] == -1 and m["val/lvis_bbox_APc"] == -1
    m = _eval_hand(tmp_path / "unknown", _hand_gt([], [], False),
                   {1: [perfect], 2: [false_a]})
    assert m["val/lvis_bbox_AP"] == pytest.approx(1.0)
    # nothing left after the federated filter (or no detection at all): AP 0, not an error
    for case, dets in (("none_kept", {1: [], 2: [false_a]}), ("none", {1: [], 2: []})):
        m = _eval_hand(tmp_path / case, _hand_gt([], [], False), dets)
        assert m["val/lvis_bbox_AP"] == 0 and m["val/lvis_bbox_APr"] == -1, case
    hit2 = (*_hit([60, 60, 30, 30], 0.8), 1)
    m = _eval_hand(tmp_path / "nel", _hand_gt([], [1], True),
                   {1: [perfect], 2: [false_a, hit2]})
    assert m["val/lvis_bbox_AP"] == pytest.approx(1.0)
    m = _eval_hand(tmp_path / "exhaustive", _hand_gt([], [], True),
                   {1: [perfect], 2: [false_a, hit2]})
    assert m["val/lvis_bbox_AP"] < 0.9


def test_limit_dets_per_image_by_hand() -> None:
    r = [{"image_id": 1, "score": s, "k": k} for k, s in enumerate([0.1, 0.9, 0.5, 0.9])]
    r += [{"image_id": 2, "score": 0.3, "k": 9}]
    got = limit_dets_per_image(r, 2)
    assert [(x["image_id"], x["k"]) for x in got] == [(1, 1), (1, 3), (2, 9)]  # ties: stable
    assert limit_dets_per_image(r, 300) == r
    assert limit_dets_per_image(r, -1) == r


# -- inputs and wiring -------------------------------------------------------------------------
def test_coco_format_annotation_file_is_refused_by_name(tmp_path: Path) -> None:
    gt = _hand_gt([], [], False)
    coco = copy.deepcopy(gt)
    for c in coco["categories"]:
        del c["frequency"]
    ann = _write(tmp_path / "a", coco)
    det = [{"image_id": 1, "dataset": "h", "boxes": [[10, 10, 49, 49]], "scores": [0.5],
            "labels": [1]}]
    with pytest.raises(ValueError, match=r"lvis_tiny\.json: category id 1 .*COCOEvaluator"):
        LVISEvaluator(annotation_files={"h": ann}, print_summary=False).evaluate(det)
    no_neg = copy.deepcopy(gt)
    del no_neg["images"][1]["neg_category_ids"]
    ann = _write(tmp_path / "b", no_neg)
    with pytest.raises(ValueError, match=r"image id 2 has no 'neg_category_ids'"):
        LVISEvaluator(annotation_files={"h": ann}, print_summary=False).evaluate(det)
    bad = copy.deepcopy(gt)
    bad["images"][1]["not_exhaustive_category_ids"] = [7]
    ann = _write(tmp_path / "c", bad)
    with pytest.raises(ValueError, match=r"image id 2 lists not_exhaustive_category_ids \[7\]"):
        LVISEvaluator(annotation_files={"h": ann}, print_summary=False).evaluate(det)
    with pytest.raises(ValueError, match="keypoints"):
        LVISEvaluator(iou_types=("bbox", "keypoints"))




def test_callback_in_trainer_logs_lvis_names(tmp_path: Path) -> None:
    """In a Trainer: the lvis_ names are logged, beside COCOEvaluator's without clashing;
    boxes and masks both evaluated; the results file holds the capped results."""
    rng = np.random.default_rng(3)
    gt = make_lvis_gt(rng, n_images=4, n_cats=N_CATS)
    dets = make_detections(rng, gt, per_image=6, masks=True)
    for a in gt["annotations"]:  # pycocotools (COCOEvaluator) needs it; LVIS has none
        a["iscrowd"] = 0
    ann = _write(tmp_path, gt)
    ev = LVISEvaluator(annotation_files={"lvis_tiny": ann}, output_dir=str(tmp_path / "out"),
                       max_dets_per_image=5)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False,
                         callbacks=[ev, COCOEvaluator(iou_types=("bbox",), print_summary=False,
                                                      annotation_files={"lvis_tiny": ann})])
    loader = torch.utils.data.DataLoader(torch.arange(len(dets)), batch_size=1)
    trainer.validate(OracleDetector(dets), dataloaders=loader, verbose=False)
    cm = trainer.callback_metrics
    for iou in ("bbox", "segm"):
        for s in STATS:
            assert f"val/lvis_{iou}_{s}" in cm
    assert "val/bbox_AP" in cm  # COCOEvaluator's own name
    assert ev.last_metrics["val/lvis_bbox_AP"] == pytest.approx(
        _ours(ann, dets, "bbox", 5)["AP"])
    saved = json.loads((tmp_path / "out" / "val_bbox_lvis_tiny_results.json").read_text())
    per_image: dict[int, int] = {}
    for r in saved:
        per_image[r["image_id"]] = per_image.get(r["image_id"], 0) + 1
    assert saved and max(per_image.values()) <= 5


def test_labels_map_by_sorted_category_id_without_a_trainer(tmp_path: Path) -> None:
    """Without a trainer, labels map to categories by sorted id, as the LVIS roidb maps
    them: perfect detections score AP 1 when the json lists its categories out of id
    order, and a sorted file scores as before. Category ids are sparse (10, 20, ...)."""
    rng = np.random.default_rng(5)
    gt = make_lvis_gt(rng, n_images=5, n_cats=4, max_anns=4)
    for key, items in (("categories", gt["categories"]), ("annotations", gt["annotations"])):
        for x in items:
            x["id" if key == "categories" else "category_id"] *= 10
    for im in gt["images"]:
        for k in ("neg_category_ids", "not_exhaustive_category_ids"):
            im[k] = [10 * c for c in im[k]]
    label = {10 * c: c for c in range(1, 5)}  # contiguous = rank of the sorted id
    dets = [{"image_id": im["id"], "dataset": "u",
             "boxes": [_hit(a["bbox"], 0.9)[0] for a in gt["annotations"]
                       if a["image_id"] == im["id"]],
             "scores": [0.9 for a in gt["annotations"] if a["image_id"] == im["id"]],
             "labels": [label[a["category_id"]] for a in gt["annotations"]
                        if a["image_id"] == im["id"]]} for im in gt["images"]]
    aps = []
    for case, cats in (("sorted", gt["categories"]), ("reversed", gt["categories"][::-1]),
                       ("shuffled", [gt["categories"][i] for i in (2, 0, 3, 1)])):
        ann = _write(tmp_path / case, {**gt, "categories": cats})
        m = LVISEvaluator(iou_types=("bbox",), annotation_files={"u": ann},
                          print_summary=False).evaluate(dets)
        aps.append(m["val/lvis_bbox_AP"])
    assert aps == [pytest.approx(1.0)] * 3
    # imperfect detections: the same AP whatever the order of the categories
    noisy = make_detections(np.random.default_rng(6), gt, per_image=5)
    for d in noisy:
        d["dataset"] = "u"
        d["labels"] = [label.get(int(c)) or label[10 * int(c)] for c in d["labels"]]
    got = [LVISEvaluator(iou_types=("bbox",), annotation_files={"u": _write(tmp_path / c, g)},
                         print_summary=False).evaluate(noisy)["val/lvis_bbox_AP"]
           for c, g in (("s2", gt), ("r2", {**gt, "categories": gt["categories"][::-1]}))]
    assert got[0] == pytest.approx(got[1], abs=1e-12) and 0 < got[0] < 1
