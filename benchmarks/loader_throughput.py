"""Loader throughput: full minibatch pipeline vs the decode + resize floor (same run).

Generates >= 500 real JPEGs at COCO sizes and roidb entries with 2000 proposals each
(Detectron's FPN Mask R-CNN settings from precomputed proposals: scales (800,),
MAX_SIZE 1333, 2 images per batch, 512 RoIs per image, 81 classes, 28x28 masks), then
reports images/s for:

* floor: read + decode + resize alone (uint8), in-process and with 2 workers;
* the full pipeline (``RoIBlockDataset``: image blob + Fast R-CNN + FPN + mask targets)
  with ``num_workers`` 0 and 2, uint8 and Detectron float32 pixels;

with the ratios full/floor and uint8/float32, and the resident memory of the workers.

Usage::

    python benchmarks/loader_throughput.py            # full run (500 images)
    python benchmarks/loader_throughput.py --quick    # smoke run

Hook for other model families: append a callable ``fn(ctx) -> list[Result]`` to
``EXTRA_BENCHES`` (see :func:`bench_extra_families`); it receives the generated roidb,
the config builder and the measured floor, e.g. the end-to-end Mask R-CNN FPN family
(RPN targets) and the ``proposal_labels`` timing.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np
import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lit_roidata.boxes import bbox_overlaps  # noqa: E402
from lit_roidata.config import get_cfg  # noqa: E402
from lit_roidata.dataset import RoIBlockDataset  # noqa: E402
from lit_roidata.sampler import Block  # noqa: E402
from lit_roidata.minibatch.decode import load_image  # noqa: E402
from lit_roidata.minibatch.image import get_target_scale, im_list_to_blob  # noqa: E402
from lit_roidata.roidb.targets import compute_bbox_targets  # noqa: E402

COCO_SIZES = [(640, 480), (480, 640), (640, 427), (427, 640), (500, 375), (640, 512), (612, 612)]


@dataclass
class Result:
    name: str
    images_per_s: float
    note: str = ""


@dataclass
class BenchContext:
    """What an extra benchmark gets: the generated data and the measured floors."""

    roidb: list[dict[str, Any]]
    make_cfg: Callable[..., Any]
    blocks: list[Any]
    floor_w0: float
    floor_w2: float
    args: argparse.Namespace
    results: list[Result] = field(default_factory=list)


def bench_extra_families(ctx: BenchContext) -> list[Result]:
    """Hook: other families (e2e RPN targets, proposal_labels) register in EXTRA_BENCHES."""
    out: list[Result] = []
    for fn in EXTRA_BENCHES:
        out.extend(fn(ctx))
    return out


EXTRA_BENCHES: list[Callable[[BenchContext], list[Result]]] = []


# --------------------------------------------------------------------------- data
def _image(r: np.random.Generator, w: int, h: int) -> np.ndarray:
    small = r.integers(0, 256, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
    im = cv2.resize(small, (w, h), interpolation=cv2.INTER_CUBIC)
    noise = r.integers(0, 24, (h, w, 3), dtype=np.uint8)  # texture: realistic JPEG sizes
    return cv2.add(im, noise)


def make_entry(r: np.random.Generator, path: str, image_id: int, w: int, h: int,
               cfg: Any, num_props: int = 2000) -> dict[str, Any]:
    """A roidb-style entry: ~7 gt with polygons, ``num_props`` proposals, labelled (Detectron
    semantics: proposals)."""
    n_gt = int(r.integers(2, 13))
    wh = r.uniform(16, [w / 2, h / 2], (n_gt, 2))
    xy = r.uniform(0, [w, h] - wh, (n_gt, 2))
    gt = np.round(np.hstack([xy, xy + wh - 1])).astype(np.float32)
    jit = gt[r.integers(0, n_gt, num_props // 3)]
    jit = jit + r.normal(0, 1, jit.shape) * np.hstack([wh.mean(0) * 0.15] * 2)
    rnd_wh = r.uniform(8, [w * 0.7, h * 0.7], (num_props - len(jit), 2))
    rnd_xy = r.uniform(0, [w, h] - rnd_wh, rnd_wh.shape)
    props = np.vstack([jit, np.hstack([rnd_xy, rnd_xy + rnd_wh])])
    props = np.clip(props, 0, [w - 1, h - 1, w - 1, h - 1]).astype(np.float32)
    props = props[(props[:, 2] - props[:, 0] > 2) & (props[:, 3] - props[:, 1] > 2)]
    boxes = np.vstack([gt, props]).astype(np.float32)
    R = len(boxes)
    gt_classes = np.zeros(R, np.int32)
    gt_classes[:n_gt] = r.integers(1, 81, n_gt)
    is_crowd = np.zeros(R, bool)
    ov = bbox_overlaps(boxes, gt)
    arg, mx = ov.argmax(1), ov.max(1)
    mo = mx.astype(np.float32)
    mc = np.where(mx > 0, gt_classes[arg], 0).astype(np.int64)
    b2g = np.where(mx > 0, arg, -1).astype(np.int32)
    mo[:n_gt], mc[:n_gt], b2g[:n_gt] = 1.0, gt_classes[:n_gt], np.arange(n_gt)
    segms = []
    for b in gt:  # an octagon inside each box
        cx, cy, rx, ry = (b[0] + b[2] + 1) / 2, (b[1] + b[3] + 1) / 2, (b[2] - b[0]) / 2, (b[3] - b[1]) / 2
        a = np.linspace(0, 2 * np.pi, 8, endpoint=False)
        segms.append([np.stack([cx + rx * np.cos(a), cy + ry * np.sin(a)], 1).ravel().tolist()])
    tg = compute_bbox_targets(boxes, mo, mc, gt_classes, is_crowd, bbox_thresh=0.5,
                              cls_agnostic=False, weights=(10.0, 10.0, 5.0, 5.0))
    return dict(image=path, id=image_id, width=w, height=h, flipped=bool(image_id % 2),
                boxes=boxes, gt_classes=gt_classes, is_crowd=is_crowd, max_overlaps=mo,
                max_classes=mc, box_to_gt_ind_map=b2g, bbox_targets=tg, segms=segms,
                seg_areas=np.zeros(R, np.float32), dataset="bench_coco_like")


def make_data(root: Path, n: int, cfg: Any) -> list[dict[str, Any]]:
    root.mkdir(parents=True, exist_ok=True)
    r = np.random.default_rng(0)
    roidb = []
    for i in range(n):
        w, h = COCO_SIZES[i % len(COCO_SIZES)]
        p = root / f"{i:06d}.jpg"
        if not p.exists():
            cv2.imwrite(str(p), _image(r, w, h), [cv2.IMWRITE_JPEG_QUALITY, 90])
        roidb.append(make_entry(r, str(p), i, w, h, cfg))
    return roidb


def fpn_mask_cfg(**overrides: Any) -> Any:
    cfg = get_cfg()
    cfg.merge_from_dict({
        "MODEL.NUM_CLASSES": 81, "MODEL.MASK_ON": True, "MRCNN.RESOLUTION": 28,
        "FPN.FPN_ON": True, "FPN.MULTILEVEL_ROIS": True, "TRAIN.SCALES": (800,),
        "TRAIN.MAX_SIZE": 1333, "TRAIN.IMS_PER_BATCH": 2, "TRAIN.BATCH_SIZE_PER_IM": 512})
    cfg.merge_from_dict(overrides)
    return cfg


# --------------------------------------------------------------------------- floor
class FloorDataset(torch.utils.data.Dataset):
    """Read + decode + resize (uint8) + pad only: what any loader must do at least."""

    def __init__(self, roidb: list[dict[str, Any]], cfg: Any) -> None:
        self.roidb, self.cfg = roidb, cfg

    def __len__(self) -> int:
        return len(self.roidb)

    def __getitems__(self, block: Any) -> Any:
        ims = []
        for i in block:
            im = load_image(self.roidb[i])
            h, w = im.shape[:2]
            s = get_target_scale(min(h, w), max(h, w), 800, 1333)
            ims.append(cv2.resize(im, None, None, fx=s, fy=s, interpolation=cv2.INTER_LINEAR))
        return torch.from_numpy(im_list_to_blob(ims, fpn_on=True, coarsest_stride=32))


# --------------------------------------------------------------------------- running
class RssSampler:
    """Samples the resident memory of this process's children (the workers)."""

    def __init__(self) -> None:
        self.max_rss = 0
        self.max_uss = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(0.2):
            for c in me.children():
                try:
                    info = c.memory_full_info()
                except (psutil.Error, OSError):
                    continue
                self.max_rss = max(self.max_rss, info.rss)
                self.max_uss = max(self.max_uss, info.uss)

    def __enter__(self) -> "RssSampler":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join()


def run_loader(ds: Any, blocks: list[Any], workers: int) -> tuple[float, RssSampler]:
    dl = torch.utils.data.DataLoader(ds, batch_sampler=blocks, collate_fn=lambda b: b,
                                     num_workers=workers, prefetch_factor=4 if workers else None,
                                     multiprocessing_context="fork" if workers else None)
    warm = 2 * max(1, workers)
    n_images = 0
    it = iter(dl)  # fork the workers before the sampler thread starts (fork + threads)
    with RssSampler() as rss:
        for _ in range(warm):
            next(it)
        t0 = time.perf_counter()
        for batch in it:
            n_images += len(batch["_meta"]["indices"]) if isinstance(batch, dict) else len(batch)
        dt = time.perf_counter() - t0
    return n_images / dt, rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--e2e", action="store_true", help="also run benchmarks/e2e_targets.py "
                    "(e2e Mask R-CNN FPN: RPN targets, proposal_labels)")
    ap.add_argument("--images", type=int, default=500)
    ap.add_argument("--root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                   "lit_roidata_bench_jpegs"))
    args = ap.parse_args()
    # One OpenCV thread per process, set before any fork: calling cv2.setNumThreads in
    # a forked worker after the parent used OpenCV's pool deadlocks.
    cv2.setNumThreads(1)
    n = 24 if args.quick else max(500, args.images)
    cfg = fpn_mask_cfg()
    t0 = time.perf_counter()
    roidb = make_data(Path(args.root), n, cfg)
    print(f"data: {n} JPEGs at COCO sizes + 2000 proposals each "
          f"({time.perf_counter() - t0:.1f}s), torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs", flush=True)
    blocks = [Block([i, i + 1], seed=0, pass_index=0, block_index=i // 2)
              for i in range(0, n - 1, 2)]
    res: list[Result] = []
    f0, _ = run_loader(FloorDataset(roidb, cfg), blocks, 0)
    f2, frss = run_loader(FloorDataset(roidb, cfg), blocks, 2)
    res += [Result("floor decode+resize, workers 0", f0), Result("floor decode+resize, workers 2", f2)]
    print(f"  floor: {f0:.1f} images/s (workers 0), {f2:.1f} (workers 2)", flush=True)
    rates: dict[tuple[str, str, int], float] = {}
    variants = [("uint8", "compact"), ("uint8", "detectron"), ("detectron", "detectron")]
    for fmt, masks in variants:
        for w in (0, 2):
            ds = RoIBlockDataset(roidb, cfg, pixel_format=fmt, mask_format=masks)
            rate, rss = run_loader(ds, blocks, w)
            rates[(fmt, masks, w)] = rate
            floor = f0 if w == 0 else f2
            note = f"{rate / floor:.0%} of floor"
            if w:
                note += f", worker RSS {rss.max_rss / 2**20:.0f} MiB (USS {rss.max_uss / 2**20:.0f} MiB)"
            res.append(Result(f"full, pixels {fmt}, masks {masks}, workers {w}", rate, note))
            print(f"  {res[-1].name}: {rate:.1f} images/s ({note})", flush=True)
    ctx = BenchContext(roidb=roidb, make_cfg=fpn_mask_cfg, blocks=blocks, floor_w0=f0,
                       floor_w2=f2, args=args, results=res)
    res += bench_extra_families(ctx)
    print(f"{'measurement':58s} {'images/s':>9s}  note")
    for r in res:
        print(f"{r.name:58s} {r.images_per_s:9.1f}  {r.note}")
    print(f"floor worker RSS {frss.max_rss / 2**20:.0f} MiB")
    for w in (0, 2):
        fast, det = rates[("uint8", "compact", w)], rates[("detectron", "detectron", w)]
        same_masks = rates[("uint8", "detectron", w)]
        print(f"workers {w}: uint8+compact / Detectron float32 blobs {fast / det:.2f}x; "
              f"uint8 / float32 pixels (Detectron masks) {same_masks / det:.2f}x")
    if args.e2e:
        run_e2e(args)


def run_e2e(args: argparse.Namespace) -> None:
    """``--e2e``: the end-to-end family's benchmark, in this process."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from e2e_targets import run

    run(quick=args.quick)


if __name__ == "__main__":
    main()
