"""LVIS AP: LVISEvaluator (faster-coco-eval's LVIS mode) against the official ``lvis`` API.

Both evaluate the same detections on the same synthetic LVIS-format ground truth (1,203
categories with r/c/f frequencies, federated negative and not-exhaustive lists), measured
in the same run and interleaved, with the ground truth loaded once beforehand for each:

* ours: ``LVISEvaluator.evaluate(detections)``: the conversion of the model's per-image
  detections to results (and masks to RLE), the 300-per-image cap, the federated filter
  and faster-coco-eval's evaluate / accumulate / summarize;
* official: ``LVISResults`` (the cap; it copies the ground truth, as it always does) +
  ``LVISEval.run()`` on the already converted result dicts (the conversion is not timed
  for it, which favours it).

It also prints the largest difference between the two sets of numbers (the tests hold it
to 1e-6). Needs ``pip install "lit_roidata[lvis]"`` and ``pip install --no-deps lvis``.

Usage: ``python benchmarks/lvis_eval.py [--images 400] [--per-image 12] [--repeats 5]
[--segm]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from lvis_support import (make_detections, make_lvis_gt, official_gt,  # noqa: E402
                          official_key, official_lvis, official_lvis_eval)

from lit_roidata.evaluation import detections_to_coco_results  # noqa: E402
from lit_roidata.lvis_evaluation import LVISEvaluator  # noqa: E402

STATS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "APr", "APc", "APf", "AR")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--per-image", type=int, default=12, help="random boxes per image (max)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--segm", action="store_true", help="mask AP instead of box AP")
    args = ap.parse_args()
    logging.getLogger("lvis").setLevel(logging.ERROR)

    lvis = official_lvis()
    rng = np.random.default_rng(0)
    gt = make_lvis_gt(rng, n_images=args.images, n_cats=1203, max_anns=8,
                      size=(120, 400), neg_fraction=0.01)
    dets = make_detections(rng, gt, per_image=args.per_image, masks=args.segm,
                           known_bias=0.7)
    iou = "segm" if args.segm else "bbox"
    id_map = {c["id"]: c["id"] for c in gt["categories"]}
    results = detections_to_coco_results(dets, id_map)
    if iou == "bbox":
        results = [{k: v for k, v in r.items() if k != "segmentation"} for r in results]
    known = {(a["image_id"], a["category_id"]) for a in gt["annotations"]}
    known |= {(im["id"], c) for im in gt["images"] for c in im["neg_category_ids"]}
    n_eval = sum((r["image_id"], r["category_id"]) in known for r in results)
    print(f"{iou}: {len(gt['images'])} images, {len(gt['annotations'])} gt instances, "
          f"1203 categories; {len(results)} detections ({n_eval} on categories known for "
          f"their image), {args.repeats} repeats")

    with tempfile.TemporaryDirectory() as tmp:
        ann = Path(tmp) / "lvis_bench.json"
        ann.write_text(json.dumps(gt))
        ev = LVISEvaluator(iou_types=(iou,), annotation_files={"lvis_bench": str(ann)},
                           print_summary=False)
        for d in dets:
            d["dataset"] = "lvis_bench"
        ev._dataset("lvis_bench", None)  # load the ground truth once, outside the timing
        lvis_gt = official_gt(lvis, gt)  # the same for the official API
        ours_t, theirs_t = [], []
        for _ in range(args.repeats):  # interleaved: the machine's noise hits both
            t0 = time.perf_counter()
            m = ev.evaluate(dets)
            ours_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            got = official_lvis_eval(lvis, lvis_gt, results, iou)
            theirs_t.append(time.perf_counter() - t0)
    key = official_key(300)
    diff = max(abs(m[f"val/lvis_{iou}_{s}"] - got[key(s)]) for s in STATS)
    o, t = np.asarray(ours_t), np.asarray(theirs_t)
    ratios = t / o
    print(f"ours (LVISEvaluator, faster-coco-eval): median {np.median(o):.3f} s "
          f"[min {o.min():.3f}, max {o.max():.3f}]")
    print(f"official LVISEval: median {np.median(t):.3f} s [min {t.min():.3f}, max "
          f"{t.max():.3f}]")
    print(f"speed-up official/ours: median {np.median(ratios):.1f}x "
          f"[min {ratios.min():.1f}x, max {ratios.max():.1f}x] over {args.repeats} paired runs")
    print(f"AP {m[f'val/lvis_{iou}_AP']:.4f} APr {m[f'val/lvis_{iou}_APr']:.4f} "
          f"APc {m[f'val/lvis_{iou}_APc']:.4f} APf {m[f'val/lvis_{iou}_APf']:.4f}; largest "
          f"difference from the official numbers: {diff:.2e}")


if __name__ == "__main__":
    main()
