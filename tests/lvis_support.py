"""Small synthetic LVIS-format ground truth and detections for the LVIS evaluation tests
(and benchmarks/lvis_eval.py): federated labels, r/c/f frequencies, several images."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Callable, Optional

import numpy as np
import pytest


def make_lvis_gt(rng: np.random.Generator, n_images: int = 8, n_cats: int = 9,
                 max_anns: int = 5, size: tuple[int, int] = (60, 160),
                 neg_fraction: float = 0.5) -> dict[str, Any]:
    """An LVIS v1-style dataset dict: categories 1..n_cats with frequencies cycling r/c/f,
    image ids 100, 103, ... (not contiguous), rectangle polygons (area = w * h), each image's
    ``neg_category_ids`` drawn from the categories it lacks and
    ``not_exhaustive_category_ids`` from those it has."""
    cats = [{"id": c, "name": f"cat{c}", "frequency": "rcf"[(c - 1) % 3],
             "synset": f"cat{c}.n.01", "image_count": 1, "instance_count": 1}
            for c in range(1, n_cats + 1)]
    images, anns = [], []
    for i in range(n_images):
        image_id = 100 + 3 * i
        w, h = (int(v) for v in rng.integers(size[0], size[1], size=2))
        present: set[int] = set()
        for _ in range(int(rng.integers(0, max_anns + 1))):
            c = int(rng.integers(1, n_cats + 1))
            bw, bh = float(rng.integers(4, w // 2)), float(rng.integers(4, h // 2))
            x, y = float(rng.integers(0, w - int(bw))), float(rng.integers(0, h - int(bh)))
            anns.append({"id": len(anns) + 1, "image_id": image_id, "category_id": c,
                         "bbox": [x, y, bw, bh], "area": bw * bh,
                         "segmentation": [[x, y, x + bw, y, x + bw, y + bh, x, y + bh]]})
            present.add(c)
        absent = [c for c in range(1, n_cats + 1) if c not in present]
        neg = sorted(int(c) for c in absent if rng.random() < neg_fraction)
        nel = sorted(int(c) for c in present if rng.random() < 0.3)
        images.append({"id": image_id, "width": w, "height": h,
                       "coco_url": f"http://images.cocodataset.org/val2017/{image_id:012d}.jpg",
                       "neg_category_ids": neg, "not_exhaustive_category_ids": nel})
    return {"info": {}, "licenses": [], "images": images, "annotations": anns,
            "categories": cats}


def make_detections(rng: np.random.Generator, gt: dict[str, Any], per_image: int = 12,
                    masks: bool = False, ties: bool = False,
                    known_bias: float = 0.0) -> list[dict[str, Any]]:
    """Per-image detections in lit_roidata's evaluation format (x1, y1, x2, y2 with the +1
    convention; labels = json ids, as LVIS ids are already contiguous): jittered copies of
    the ground truth plus random boxes of any category (some federated, some not; with
    probability ``known_bias`` a random box takes one of the image's annotated or negative
    categories, so that it is evaluated)."""
    n_cats = len(gt["categories"])
    by_image: dict[int, list[dict[str, Any]]] = {im["id"]: [] for im in gt["images"]}
    for a in gt["annotations"]:
        by_image[a["image_id"]].append(a)
    dets = []
    for im in gt["images"]:
        w, h = im["width"], im["height"]
        boxes, labels = [], []
        for a in by_image[im["id"]]:
            if rng.random() < 0.85:
                x, y, bw, bh = a["bbox"]
                j = rng.normal(0, 0.08, 4) * np.array([bw, bh, bw, bh])
                boxes.append([x + j[0], y + j[1], x + bw - 1 + j[2], y + bh - 1 + j[3]])
                labels.append(a["category_id"] if rng.random() < 0.8
                              else int(rng.integers(1, n_cats + 1)))
        known = sorted({a["category_id"] for a in by_image[im["id"]]}
                       | set(im["neg_category_ids"]))
        for _ in range(int(rng.integers(0, per_image + 1))):
            x1, y1 = rng.uniform(0, w - 8), rng.uniform(0, h - 8)
            boxes.append([x1, y1, rng.uniform(x1 + 3, w - 1), rng.uniform(y1 + 3, h - 1)])
            labels.append(int(rng.choice(known)) if known_bias > 0 and known
                          and rng.random() < known_bias
                          else int(rng.integers(1, n_cats + 1)))
        b = np.clip(np.asarray(boxes, np.float64).reshape(-1, 4), 0, [w - 1, h - 1, w - 1, h - 1])
        b[:, 2:] = np.maximum(b[:, 2:], b[:, :2])
        scores = (rng.choice([0.2, 0.5, 0.7, 0.9], len(b)) if ties
                  else rng.uniform(0.01, 1.0, len(b)))
        det = {"image_id": im["id"], "dataset": "lvis_tiny", "boxes": b, "scores": scores,
               "labels": np.asarray(labels, np.int64)}
        if masks:
            m = np.zeros((len(b), h, w), np.uint8)
            for k, (x1, y1, x2, y2) in enumerate(np.round(b).astype(int)):
                m[k, y1:y2 + 1, x1:x2 + 1] = 1
                if k % 3 == 0:  # not a rectangle: cut a corner
                    m[k, y1:(y1 + y2) // 2 + 1, x1:(x1 + x2) // 2 + 1] = 0
            det["masks"] = m
        dets.append(det)
    return dets


def official_lvis() -> Any:
    """The official ``lvis`` package (installed with ``pip install --no-deps lvis`` as its
    pin of ``opencv-python`` would clash with ``opencv-python-headless``). Skipped where it
    is missing, except in CI (``CI`` set), where .ci/run installs it and a missing package
    is an error: the cross-check must not be skipped silently."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        if os.environ.get("CI"):
            import lvis  # noqa: F401 - CI installs it (.ci/run); fail rather than skip
        else:
            pytest.importorskip("lvis", reason="the official lvis API: pip install --no-deps lvis")
        import lvis
    finally:  # `import lvis` calls logging.basicConfig: leave the root logger as it was
        for hd in list(root.handlers):
            if hd not in handlers:
                root.removeHandler(hd)
        root.setLevel(level)
    return lvis


def official_gt(lvis: Any, gt: dict[str, Any]) -> Any:
    """The official ``LVIS`` object of a dataset dict (a copy; no file)."""
    import copy

    lvis_gt = lvis.LVIS.__new__(lvis.LVIS)
    lvis_gt.logger = logging.getLogger("lvis.lvis")
    lvis_gt.dataset = copy.deepcopy(gt)
    lvis_gt._create_index()
    return lvis_gt


def official_lvis_eval(lvis: Any, gt: Any, results: list[dict[str, Any]],
                       iou: str, image_ids: Optional[list[int]] = None,
                       max_dets: int = 300) -> dict[str, float]:
    """The official ``LVISEval`` numbers (``get_results()``) of ``results`` on ``gt`` (a
    dataset dict or an :func:`official_gt` object)."""
    import copy

    lvis_gt = gt if isinstance(gt, lvis.LVIS) else official_gt(lvis, gt)
    with _np_float_alias():
        dt = lvis.LVISResults(lvis_gt, copy.deepcopy(results), max_dets=max_dets)
        ev = lvis.LVISEval(lvis_gt, dt, iou)
        ev.params.max_dets = max_dets
        if image_ids is not None:
            ev.params.img_ids = sorted(image_ids)
        ev.run()
    return {k: float(v) for k, v in ev.get_results().items()}


@contextlib.contextmanager
def _np_float_alias() -> Any:
    """lvis 0.5.3 (its last release) still spells ``float`` as ``np.float``, which NumPy
    removed in 1.24; the alias was exactly the builtin, so lending it changes nothing."""
    had = hasattr(np, "float")
    if not had:
        np.float = float  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if not had:
            del np.float


#: Official ``get_results()`` key of each of our stat names, for ``max_dets``.
def official_key(max_dets: int) -> Callable[[str], str]:
    """Our stat name (``AP``, ``APr``, ``AR``, ``ARs``, ...) -> the official results key."""
    def key(name: str) -> str:
        return f"{name}@{max_dets}" if name.startswith("AR") else name
    return key
