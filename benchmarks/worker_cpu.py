"""Worker CPU per image of the e2e Mask R-CNN FPN path, per stage: this package vs the
previous implementation, kept as test oracles in ``tests/oracles/`` (same run, CPU time).

Stages (COCO-like synthetic data: image sizes 480x640 .. 640x427, ~7 boxes per image of
COCO-like sizes, polygons with 10-40 points; shortest side drawn from 640-800, MAX_SIZE
1333, 5 FPN levels):

* ``rpn labels``: ``rpn.label_anchors`` (inside rectangles, tight IoU candidates,
  negatives by rank/select) vs ``tests/oracles/rpn.label_anchors``, both generator kinds;
* ``roidb blob``: ``serialize_roidb`` (orjson header) vs ``tests/oracles/roidb_blob``;
* ``uint8 blob``: decode + resize each RGB channel into its BGR plane vs decode + BGR
  conversion + 3-channel resize + ``cv2.split`` into the blob (in-memory JPEGs, a fresh
  zeroed blob per batch of 2).

Every pair is checked equal before it is timed. Prints CPU ms per image and the ratio
(new / old) per stage, median of ``--repeat`` runs with the spread.

Usage::

    python benchmarks/worker_cpu.py [--images 200] [--repeat 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

from oracles import roidb_blob as oracle_roidb_blob  # noqa: E402
from oracles import rpn as oracle_rpn  # noqa: E402

from lit_roidata.config import get_cfg  # noqa: E402
from lit_roidata.minibatch import rpn  # noqa: E402
from lit_roidata.minibatch.anchors import concat_fields, rpn_fields  # noqa: E402
from lit_roidata.minibatch.decode import decode_bgr, decode_rgb  # noqa: E402
from lit_roidata.minibatch.image import (  # noqa: E402
    ImageBatch, _build_uint8_planes, im_list_to_blob, scale_image)
from lit_roidata.minibatch.roidb_blob import serialize_roidb  # noqa: E402

SIZES = [(480, 640), (427, 640), (640, 480), (500, 375), (612, 612), (640, 427)]


def _cfg() -> Any:
    cfg = get_cfg()
    cfg.merge_from_dict({"MODEL.FASTER_RCNN": True, "FPN.FPN_ON": True,
                         "FPN.MULTILEVEL_RPN": True, "TRAIN.MAX_SIZE": 1333,
                         "TRAIN.SCALES": tuple(range(640, 801, 32))})
    return cfg


def _scenes(n: int, seed: int = 0) -> list[dict[str, Any]]:
    r = np.random.default_rng(seed)
    out = []
    for i in range(n):
        h, w = SIZES[i % len(SIZES)]
        g = int(r.integers(1, 15))
        wh = np.exp(r.uniform(np.log(8), np.log(0.9 * min(h, w)), (g, 2)))
        xy = r.uniform(0, 1, (g, 2)) * ([w, h] - wh)
        boxes = np.concatenate([xy, xy + wh - 1], 1).astype(np.float32)
        segms = [[list(map(float, r.uniform(0, 500, 2 * int(r.integers(5, 20)))))]
                 for _ in range(g)]
        scale = min(r.choice(range(640, 801, 32)) / min(h, w), 1333 / max(h, w))
        out.append({"id": i, "image": f"/data/{i:012d}.jpg", "width": w, "height": h,
                    "flipped": bool(i % 2), "boxes": boxes, "segms": segms,
                    "gt_classes": np.ones(g, np.int32), "is_crowd": np.zeros(g, bool),
                    "seg_areas": (wh[:, 0] * wh[:, 1]).astype(np.float32),
                    "box_to_gt_ind_map": np.arange(g, dtype=np.int32),
                    "has_visible_keypoints": False, "scale": scale})
    return out


def _cpu(fn: Callable[[], Any]) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def bench_rpn(scenes: list[dict[str, Any]], cfg: Any) -> tuple[Callable, Callable]:
    fields = rpn_fields(cfg)
    anchors = concat_fields(fields)
    jobs = []
    for i, e in enumerate(scenes):
        s = e["scale"]
        jobs.append(((e["boxes"] * s).astype(np.float32), float(round(e["height"] * s)),
                     float(round(e["width"] * s)), i))

    def run(impl: Any) -> Callable[[], list]:
        def go() -> list:
            out = []
            for gt, h, w, i in jobs:
                for rng in (np.random.default_rng(i), np.random.RandomState(i)):
                    out.append(impl.label_anchors(anchors, fields, gt, h, w, cfg.TRAIN, rng))
            return out
        return go

    new, old = run(rpn)(), run(oracle_rpn)()
    for a, b in zip(new, old):
        assert all(np.array_equal(x, y) for x, y in zip(a, b)), "rpn labels differ"
    return run(rpn), run(oracle_rpn)


def bench_roidb(scenes: list[dict[str, Any]]) -> tuple[Callable, Callable]:
    batches = [scenes[i:i + 2] for i in range(0, len(scenes), 2)]
    for b in batches[:20]:
        new, old = serialize_roidb(b), oracle_roidb_blob.serialize_roidb(b)
        assert len(new) and len(old)

    def run(fn: Callable) -> Callable[[], None]:
        return lambda: [fn(b) for b in batches]
    return run(serialize_roidb), run(oracle_roidb_blob.serialize_roidb)


def bench_image(n: int, cfg: Any) -> tuple[Callable, Callable]:
    r = np.random.default_rng(1)
    files = []
    for i in range(n):
        h, w = SIZES[i % len(SIZES)]
        small = r.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
        im = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
        files.append(cv2.imencode(".jpg", im, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes())
    entries = [{"id": i, "width": SIZES[i % len(SIZES)][1], "height": SIZES[i % len(SIZES)][0],
                "flipped": bool(i % 2)} for i in range(n)]
    pairs = [list(range(i, min(i + 2, n))) for i in range(0, n, 2)]

    def load(decode: Callable) -> Callable[[dict], np.ndarray]:
        def fn(e: dict) -> np.ndarray:
            im = decode(files[e["id"]])
            return cv2.flip(im, 1) if e["flipped"] else im
        return fn
    load_rgb = load(decode_rgb)
    load_rgb.channel_order = "rgb"  # type: ignore[attr-defined]
    load_bgr = load(decode_bgr)

    def new() -> list[ImageBatch]:
        return [_build_uint8_planes([entries[i] for i in p], cfg, np.random.default_rng(k),
                                    load_rgb, None) for k, p in enumerate(pairs)]

    def old() -> list[np.ndarray]:
        out = []
        for k, p in enumerate(pairs):
            rng = np.random.default_rng(k)
            inds = rng.integers(0, len(cfg.TRAIN.SCALES), size=len(p))
            ims = [scale_image(load_bgr(entries[i]), cfg.TRAIN.SCALES[int(j)], 1333,
                               pixel_format="uint8", pixel_means=cfg.PIXEL_MEANS)[0]
                   for i, j in zip(p, inds)]
            out.append(im_list_to_blob(ims, fpn_on=True, coarsest_stride=32))
        return out

    for a, b in zip(new()[:10], old()[:10]):
        assert np.array_equal(a.data, b), "uint8 blobs differ"
    return new, old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    cfg = _cfg()
    scenes = _scenes(args.images)
    stages = {"rpn labels (x2 rng kinds)": bench_rpn(scenes, cfg),
              "roidb blob": bench_roidb(scenes),
              "uint8 blob (decode+resize+planes)": bench_image(args.images, cfg)}
    print(f"CPU ms per image, {args.images} images, median of {args.repeat} "
          "(min-max); checked equal first")
    print(f"{'stage':36s} {'new':>16s} {'old':>16s} {'new/old':>8s}")
    tot_new = tot_old = 0.0
    for name, (new, old) in stages.items():
        t_new, t_old = [], []
        for _ in range(args.repeat):  # interleaved so that load changes hit both
            t_new.append(_cpu(new) / args.images * 1e3)
            t_old.append(_cpu(old) / args.images * 1e3)
        mn, mo = float(np.median(t_new)), float(np.median(t_old))
        tot_new += mn
        tot_old += mo
        print(f"{name:36s} {mn:6.2f} ({min(t_new):.2f}-{max(t_new):.2f}) "
              f"{mo:6.2f} ({min(t_old):.2f}-{max(t_old):.2f}) {mn / mo:8.2f}")
    print(f"{'total':36s} {tot_new:6.2f}{'':11s}{tot_old:6.2f}{'':11s}{tot_new / tot_old:8.2f}")


if __name__ == "__main__":
    main()
