"""Tiny COCO datasets and proposal files for the roidb tests (built from a seed)."""

from __future__ import annotations

import json
import os
import pickle
from typing import Optional

import numpy as np

from lit_roidata.catalog import Catalog
from lit_roidata.roidb.info import COCO_KEYPOINT_NAMES

KEYPOINTS = list(COCO_KEYPOINT_NAMES)


def rle_string(mask: np.ndarray) -> str:
    """Compressed COCO RLE counts of a mask, as the JSON string."""
    from pycocotools import mask as mask_util

    return mask_util.encode(np.asfortranarray(mask.astype(np.uint8)))["counts"].decode("ascii")


def uncompressed_counts(mask: np.ndarray) -> list:
    flat = mask.astype(np.uint8).ravel(order="F")
    runs, cur, n = [], 0, 0
    for v in flat:
        if v != cur:
            runs.append(n)
            cur, n = v, 0
        n += 1
    runs.append(n)
    return runs


def make_coco(seed: int, n_images: int = 6, *, keypoints: bool = False, max_anns: int = 5,
              categories: Optional[list] = None, rle: bool = True) -> dict:
    """A random COCO dict exercising every cleaning rule (Detectron semantics: ground-truth
    cleaning)."""
    rng = np.random.default_rng(seed)
    if categories is None:
        categories = [{"id": 3, "name": "car"}, {"id": 1, "name": "person"},
                      {"id": 18, "name": "dog"}]
    if keypoints:
        categories = [dict(c, keypoints=KEYPOINTS) if c["name"] == "person" else dict(c)
                      for c in categories]
    ids = rng.permutation(np.arange(1, 3 * n_images + 1))[:n_images]
    images, anns = [], []
    aid = 1
    for iid in ids.tolist():
        w, h = int(rng.integers(20, 120)), int(rng.integers(20, 120))
        images.append({"id": iid, "width": w, "height": h, "file_name": f"{iid:06d}.jpg",
                       "license": 1, "date_captured": "x"})
        for _ in range(int(rng.integers(0, max_anns + 1))):
            kind = rng.integers(0, 10)
            x, y = float(rng.uniform(-10, w)), float(rng.uniform(-10, h))
            bw, bh = float(rng.uniform(0, w / 2)), float(rng.uniform(0, h / 2))
            if kind == 0:
                bw = float(rng.choice([0.0, 0.5, 1.0, 1.5]))
            cat = categories[int(rng.integers(0, len(categories)))]
            ann = {"id": aid, "image_id": iid, "category_id": cat["id"],
                   "bbox": [round(x, 2), round(y, 2), round(bw, 2), round(bh, 2)],
                   "area": round(float(bw * bh), 2) if kind != 1 else 0.0, "iscrowd": 0}
            if kind == 2:
                ann["ignore"] = 1
            if rle and kind in (3, 4):
                ann["iscrowd"] = 1
                m = np.zeros((h, w), np.uint8)
                m[int(max(y, 0)):int(max(y, 0) + bh) + 1, int(max(x, 0)):int(max(x, 0) + bw) + 1] = 1
                ann["segmentation"] = {"size": [h, w], "counts": rle_string(m) if kind == 3
                                       else uncompressed_counts(m)}
            else:
                polys = [[round(float(v), 2) for v in rng.uniform(0, min(w, h), 2 * int(k))]
                         for k in rng.integers(1, 6, size=int(rng.integers(0, 3)))]
                ann["segmentation"] = polys
            if keypoints:
                k = np.zeros((17, 3))
                vis = rng.random(17) < 0.5
                k[:, 0] = np.where(vis, rng.uniform(0, w, 17), 0)
                k[:, 1] = np.where(vis, rng.uniform(0, h, 17), 0)
                k[:, 2] = np.where(vis, rng.integers(1, 3, 17), 0)
                if kind == 5:
                    k[:] = 0
                ann["keypoints"] = [round(float(v), 1) for v in k.ravel()]
                ann["num_keypoints"] = int(vis.sum())
            anns.append(ann)
            aid += 1
    return {"images": images, "annotations": anns, "categories": categories}


def write_dataset(root: str, name: str, data: dict, *, catalog: Optional[Catalog] = None,
                  images: bool = True) -> Catalog:
    """Write ``data`` as ``root/name/ann.json`` (+ empty image files) and register it."""
    d = os.path.join(root, name)
    os.makedirs(os.path.join(d, "images"), exist_ok=True)
    with open(os.path.join(d, "ann.json"), "w") as fh:
        json.dump(data, fh)
    if images:
        for im in data["images"]:
            open(os.path.join(d, "images", im["file_name"]), "wb").close()
    catalog = catalog if catalog is not None else Catalog(builtins=False)
    catalog.register(name, os.path.join(d, "images"), os.path.join(d, "ann.json"),
                     overwrite=True)
    return catalog


def make_proposals(seed: int, data: dict, path: str, *, per_image: int = 12,
                   fmt: str = "pkl", extra_ids: tuple = (), dtype=np.float32) -> str:
    """A Detectron-style proposal file for ``data`` (random, with duplicates/tiny boxes)."""
    rng = np.random.default_rng(seed)
    ids, boxes, scores = [], [], []
    gts = {}
    for a in data["annotations"]:
        gts.setdefault(a["image_id"], []).append(a["bbox"])
    for im in list(data["images"]) + [{"id": i, "width": 50, "height": 50} for i in extra_ids]:
        w, h = im["width"], im["height"]
        n = int(rng.integers(0, per_image + 1))
        x1 = rng.uniform(-5, w, n)
        y1 = rng.uniform(-5, h, n)
        b = np.stack([x1, y1, x1 + rng.uniform(0, w / 2, n), y1 + rng.uniform(0, h / 2, n)], 1)
        for g in gts.get(im["id"], [])[:2]:  # near-gt proposals for fg rows
            b = np.vstack([b, [g[0], g[1], g[0] + g[2], g[1] + g[3]],
                           [g[0] + 1, g[1], g[0] + g[2] + 1, g[1] + g[3] - 1]])
        if len(b):
            b = np.vstack([b, b[:1]])  # an exact duplicate
        ids.append(im["id"])
        boxes.append(b.astype(dtype).reshape(-1, 4))
        scores.append(np.sort(rng.random(len(b)))[::-1].astype(np.float32))
    order = rng.permutation(len(ids))
    ids = [ids[i] for i in order]
    boxes = [boxes[i] for i in order]
    scores = [scores[i] for i in order]
    if fmt == "npz":
        np.savez(path, ids=np.array(ids), counts=np.array([len(b) for b in boxes]),
                 boxes=np.concatenate(boxes) if boxes else np.zeros((0, 4), dtype),
                 scores=np.concatenate(scores) if scores else np.zeros(0))
    else:
        with open(path, "wb") as fh:
            pickle.dump({"boxes": boxes, "scores": scores, "ids": ids, "cfg": ""}, fh)
    return path
