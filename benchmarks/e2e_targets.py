"""End-to-end Mask R-CNN FPN: RPN targets in the loader and ``proposal_labels`` per step.

Measures, in one run and on the same generated JPEGs (2 images per minibatch, scaled
to 800x1333, Detectron's e2e_mask_rcnn_R-50-FPN settings: RPN levels 2..6, 81 classes,
512 RoIs per image, 28x28 masks):

* baseline: the image blob alone (``get_image_blob``: decode, scale, pad) per minibatch;
* the full e2e loader minibatch (``get_minibatch``: image blob + RPN targets, 5 levels);
* the RPN targets alone (``add_rpn_blobs``), and Detectron's dense labelling of the same
  anchors (a literal port: every anchor x every gt) for comparison;
* ``proposal_labels`` for 2000 proposals over 2 images (NumPy input and torch CPU
  input; ``--device cuda`` adds a GPU run when available);

and prints each as ms per minibatch, minibatches/s and the ratio to the baseline.

Usage::

    python benchmarks/e2e_targets.py            # full run
    python benchmarks/e2e_targets.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lit_roidata.boxes import bbox_overlaps, bbox_transform_targets  # noqa: E402
from lit_roidata.config import get_cfg  # noqa: E402
from lit_roidata.minibatch import get_image_blob, get_minibatch, proposal_labels  # noqa: E402
from lit_roidata.minibatch.anchors import concat_fields, rpn_fields  # noqa: E402
from lit_roidata.minibatch.model_type import flags_for_model_type  # noqa: E402
from lit_roidata.minibatch.rpn import add_rpn_blobs  # noqa: E402


def e2e_cfg() -> Any:
    cfg = get_cfg()
    cfg.merge_from_dict(flags_for_model_type("mask_rcnn_fpn"))
    cfg.merge_from_dict({"MODEL.NUM_CLASSES": 81, "TRAIN.SCALES": (800,),
                         "TRAIN.MAX_SIZE": 1333, "TRAIN.BATCH_SIZE_PER_IM": 512,
                         "MRCNN.RESOLUTION": 28, "TRAIN.IMS_PER_BATCH": 2})
    return cfg


def make_entries(root: Path, n: int, rng: np.random.RandomState) -> list[dict]:
    """``n`` 1000x600 JPEGs (scaled to 1333x800) with COCO-like gt: ~7 boxes, polygons."""
    entries = []
    for i in range(n):
        w, h = 1000, 600
        im = rng.randint(0, 255, (h // 8, w // 8, 3)).astype(np.uint8)
        path = root / f"{i}.jpg"
        cv2.imwrite(str(path), cv2.resize(im, (w, h)))
        g = int(rng.randint(3, 15))
        side = np.exp(rng.uniform(np.log(10), np.log(400), (g, 2)))
        xy = rng.uniform(0, 1, (g, 2)) * ([w, h] - side)
        boxes = np.concatenate([xy, xy + side], 1).astype(np.float32)
        cls = rng.randint(1, 81, g).astype(np.int32)
        crowd = np.zeros(g, bool)
        mo = np.ones(g, np.float32)
        entries.append({
            "id": i, "image": str(path), "width": w, "height": h, "flipped": False,
            "boxes": boxes, "gt_classes": cls, "is_crowd": crowd, "seg_areas": side.prod(1),
            "box_to_gt_ind_map": np.arange(g, dtype=np.int32), "max_overlaps": mo,
            "max_classes": cls.astype(np.int64),
            "segms": [[[x1, y1, x2, y1, (x1 + x2) / 2, y2]] for x1, y1, x2, y2 in boxes.tolist()]})
    return entries


def dense_rpn_labels(all_anchors: np.ndarray, gt: np.ndarray, im_h: float, im_w: float,
                     train: Any, rng: np.random.RandomState) -> np.ndarray:
    """Detectron's ``_get_rpn_blobs`` labelling, literally (dense IoU), for comparison."""
    inside = np.where((all_anchors[:, 0] >= 0) & (all_anchors[:, 1] >= 0)
                      & (all_anchors[:, 2] < im_w) & (all_anchors[:, 3] < im_h))[0]
    anchors = all_anchors[inside]
    o = bbox_overlaps(anchors, gt)
    a2g = o.argmax(1)
    a2g_max = o[np.arange(len(inside)), a2g]
    g2a_max = o[o.argmax(0), np.arange(o.shape[1])]
    labels = np.full(len(inside), -1, np.int32)
    labels[np.where(o == g2a_max)[0]] = 1
    labels[a2g_max >= train.RPN_POSITIVE_OVERLAP] = 1
    fg = np.where(labels == 1)[0]
    if len(fg) > 128:
        labels[rng.choice(fg, len(fg) - 128, replace=False)] = -1
    fg = np.where(labels == 1)[0]
    bg = np.where(a2g_max < train.RPN_NEGATIVE_OVERLAP)[0]
    num_bg = 256 - len(fg)
    labels[bg[rng.randint(len(bg), size=num_bg)] if len(bg) > num_bg else bg] = 0
    bbox_transform_targets(anchors[fg], gt[a2g[fg]], (1, 1, 1, 1))
    out = np.full(len(all_anchors), -1, np.int32)
    out[inside] = labels
    return out


def run(quick: bool = False, device: str = "cpu") -> list[tuple[str, float]]:
    """Run the benchmark; returns ``(name, seconds per minibatch)`` rows (also printed).

    The cases are timed round-robin (one call of each per round, median over rounds),
    so a change in machine load affects all of them alike and the ratios stay fair.
    """
    rounds = 4 if quick else 20
    cfg = e2e_cfg()
    rs = np.random.RandomState(0)
    scales = [800 / 600] * 2
    fields = rpn_fields(cfg)
    anchors = concat_fields(fields)
    n = 2000
    xy = rs.uniform(0, 1200, (n, 2))
    rois = np.concatenate([rs.randint(0, 2, (n, 1)), xy, xy + rs.uniform(8, 400, (n, 2))], 1)
    rois = rois.astype(np.float32)
    scores = rs.rand(n).astype(np.float32)
    rois_t, scores_t = torch.from_numpy(rois), torch.from_numpy(scores)
    with tempfile.TemporaryDirectory() as tmp:
        entries = make_entries(Path(tmp), 8, rs)
        pairs = [entries[2 * k:2 * k + 2] for k in range(4)]

        def dense(k: int) -> None:
            for e in pairs[k % 4]:
                gt = (e["boxes"] * scales[0]).astype(np.float32)
                dense_rpn_labels(anchors, gt, 800.0, 1333.0, cfg.TRAIN, np.random.RandomState(k))

        cases: list[tuple[str, Callable[[int], Any]]] = [
            ("image blob only (baseline)",
             lambda k: get_image_blob(pairs[k % 4], cfg, np.random.RandomState(k))),
            ("e2e loader minibatch (image + RPN 5 levels)",
             lambda k: get_minibatch(pairs[k % 4], cfg, np.random.RandomState(k))),
            ("RPN targets only (add_rpn_blobs)",
             lambda k: add_rpn_blobs({}, scales, pairs[k % 4], cfg, np.random.RandomState(k))),
            ("RPN labels, Detectron's dense IoU (reference)", dense),
            (f"proposal_labels, {n} proposals, NumPy",
             lambda k: proposal_labels(rois, pairs[k % 4], scales, cfg,
                                       np.random.RandomState(k), scores=scores)),
            (f"proposal_labels, {n} proposals, torch cpu",
             lambda k: proposal_labels(rois_t, pairs[k % 4], scales, cfg,
                                       np.random.RandomState(k), scores=scores_t)),
        ]
        if device != "cpu" and torch.cuda.is_available():
            rois_d, scores_d = rois_t.to(device), scores_t.to(device)

            def on_device(k: int) -> None:
                out = proposal_labels(rois_d, pairs[k % 4], scales, cfg,
                                      np.random.RandomState(k), scores=scores_d)
                torch.cuda.synchronize()
                assert out["rois"].device.type == "cuda"
            cases.append((f"proposal_labels, {n} proposals, torch {device}", on_device))
        times: dict[str, list[float]] = {name: [] for name, _ in cases}
        for r in range(rounds + 1):
            for name, fn in cases:
                t = time.perf_counter()
                fn(r)
                if r:  # round 0 warms up
                    times[name].append(time.perf_counter() - t)
    rows = [(name, float(np.median(times[name]))) for name, _ in cases]
    base = rows[0][1]
    print(f"{'what':52s} {'ms/minibatch':>13s} {'minibatch/s':>12s} {'x baseline time':>16s}")
    for name, sec in rows:
        print(f"{name:52s} {sec * 1e3:13.1f} {1 / sec:12.1f} {sec / base:16.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--device", default="cpu", help="also time proposal_labels on this device")
    args = ap.parse_args()
    torch.set_num_threads(1)
    run(quick=args.quick, device=args.device)


if __name__ == "__main__":
    main()
