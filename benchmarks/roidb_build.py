"""Benchmark: columnar roidb build/open/worker memory vs a Detectron-style list-of-dicts build.

Generates a COCO train2017-scale annotation file (118,287 images, ~860k annotations with
polygons, crowd RLEs of both kinds and person keypoints) and a proposal file with 1000
boxes per image, then measures, each phase in a fresh subprocess:

* ours, cold: ``combined_roidb_for_training`` with an empty cache (parse, clean, write);
* ours, warm: the same call with the cache present (fingerprints + memory maps);
* ours, worker: private memory a forked DataLoader worker adds while reading every entry;
* ours, warm + verify: the warm open with ``verify=True`` (every cache array re-read and
  checksummed, what the first open after a reboot costs);
* baseline: ``tests/oracles/reference.py`` (pycocotools ``COCO`` + Detectron's per-entry
  code, a list of dicts) - build time, peak memory and the same worker measurement;
* Detectron2: ``detectron2.data.datasets.coco.load_coco_json`` on the same file, from a
  detectron2 source checkout given with ``--d2-src`` (imported from there, never copied;
  the row is skipped with a note when absent). Our cold gt build is reported as a ratio
  of it (the issue's target is <= 0.25x).

Figures are printed with ratios (baseline / ours). The machine may be shared: wall times
include whatever else runs. Usage::

    python benchmarks/roidb_build.py --quick          # ~5k images, ~1 minute
    python benchmarks/roidb_build.py                  # full scale (several minutes, ~10 GB)
    python benchmarks/roidb_build.py --baseline-images 20000   # smaller baseline sample
    python benchmarks/roidb_build.py --quick --d2-src /tmp/d2   # + Detectron2's loader

Proposal files default to Detectron's pickle; ``--proposal-format npz`` writes our flat
``.npz`` variant (faster to generate at 118k x 1000).

``--proposals-vs-d2 --d2-src /path/to/detectron2`` runs only the proposal-loading
comparison (:func:`proposals_vs_d2`): converting the pickle once
(``convert_proposals``), cold builds from the pickle and from the ``.npz``, against
Detectron2's ``load_coco_json`` + ``load_proposals_into_dataset`` +
``DatasetFromList(serialize=True)`` from that source checkout, each in its own process
(wall time, CPU user + system, peak RSS; ratios ours / Detectron2). The pickle build and
Detectron2 alternate, ``--repeat`` times. For our cold builds it also prints the bytes the
build wrote (``write_bytes`` of ``/proc/self/io``, which includes the forked builder once
reaped) against the size of the cache it left (the issue's target: <= 1.2x)::

    python benchmarks/roidb_build.py --proposals-vs-d2 --d2-src /tmp/d2 --images 20000
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lit_roidata.roidb.info import COCO_KEYPOINT_NAMES  # noqa: E402

KEYPOINTS = list(COCO_KEYPOINT_NAMES)


# ----------------------------------------------------------------------------- data
def _rect_counts(h: int, w: int, x0: int, y0: int, x1: int, y1: int) -> list:
    """Uncompressed COCO RLE of a filled rectangle (column-major runs)."""
    counts, run = [], x0 * h + y0
    for _ in range(x0, x1):
        counts += [run, y1 - y0]
        run = h - (y1 - y0)
    counts.append(run - y0 + (w - x1) * h)
    return counts


def generate_coco(path: str, n_images: int, anns_per_image: float, seed: int = 0) -> int:
    """Write a synthetic COCO file; returns the number of annotations."""
    import orjson
    from pycocotools import mask as mask_util

    rng = np.random.default_rng(seed)
    ids = np.sort(rng.choice(np.arange(1, 5 * n_images + 1), n_images, replace=False))
    widths = rng.integers(320, 641, n_images)
    heights = rng.integers(240, 481, n_images)
    n_per = rng.poisson(anns_per_image, n_images)
    n = int(n_per.sum())
    img_of = np.repeat(np.arange(n_images), n_per)
    w_i, h_i = widths[img_of], heights[img_of]
    bw = np.minimum(np.exp(rng.normal(3.5, 1.0, n)), w_i - 1).round(2)
    bh = np.minimum(np.exp(rng.normal(3.5, 1.0, n)), h_i - 1).round(2)
    bx = (rng.random(n) * (w_i - bw)).round(2)
    by = (rng.random(n) * (h_i - bh)).round(2)
    cat_ids = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                        22, 23, 24, 25, 27, 28, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42,
                        43, 44, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61,
                        62, 63, 64, 65, 67, 70, 72, 73, 74, 75, 76, 77, 78, 79, 80, 81, 82, 84,
                        85, 86, 87, 88, 89, 90])
    cats = np.where(rng.random(n) < 0.3, 1, rng.choice(cat_ids[1:], n))
    crowd = rng.random(n) < 0.01
    n_polys = np.where(rng.random(n) < 0.9, 1, 2)
    n_pts = rng.integers(8, 30, int(n_polys.sum()))
    coords = rng.random(int(2 * n_pts.sum())).round(2) * 100
    coord_lists = np.split(coords, np.cumsum(2 * n_pts)[:-1])
    zeros_kp = [0] * 51
    anns = []
    poly_i = 0
    for a in range(n):
        x, y, w, h = float(bx[a]), float(by[a]), float(bw[a]), float(bh[a])
        if crowd[a]:
            H, W = int(h_i[a]), int(w_i[a])
            cnt = _rect_counts(H, W, int(x), int(y), int(x + w), int(y + h))
            seg = {"size": [H, W], "counts": cnt}
            if a % 2:
                seg["counts"] = mask_util.frPyObjects(seg, H, W)["counts"].decode("ascii")
            poly_i += int(n_polys[a])
        else:
            # 2 decimals, as in COCO's own files
            seg = [(coord_lists[poly_i + k] + [x, y] * int(n_pts[poly_i + k])).round(2).tolist()
                   for k in range(int(n_polys[a]))]
            poly_i += int(n_polys[a])
        if cats[a] == 1:
            kp = np.zeros((17, 3), np.int64)
            vis = rng.random(17) < 0.55
            kp[vis, 0] = (x + rng.random(int(vis.sum())) * w).astype(np.int64)
            kp[vis, 1] = (y + rng.random(int(vis.sum())) * h).astype(np.int64)
            kp[vis, 2] = 2
            kps = kp.ravel().tolist()
        else:
            kps = zeros_kp
        anns.append({"segmentation": seg, "num_keypoints": 0, "area": round(w * h * 0.6, 2),
                     "iscrowd": int(crowd[a]), "keypoints": kps, "image_id": int(ids[img_of[a]]),
                     "bbox": [x, y, w, h], "category_id": int(cats[a]), "id": a + 1})
    images = [{"license": 1, "file_name": f"{int(i):012d}.jpg", "coco_url": "",
               "height": int(h), "width": int(w), "date_captured": "2013-11-14 11:18:45",
               "flickr_url": "", "id": int(i)} for i, w, h in zip(ids, widths, heights)]
    categories = [{"supercategory": "x", "id": int(c), "name": "person" if c == 1 else f"c{c}"}
                  for c in cat_ids]
    categories[0]["keypoints"] = KEYPOINTS
    categories[0]["skeleton"] = [[16, 14], [14, 12]]
    with open(path, "wb") as fh:
        fh.write(orjson.dumps({"info": {}, "licenses": [], "images": images,
                               "annotations": anns, "categories": categories}))
    return n


def generate_proposals(ann_path: str, path: str, per_image: int, fmt: str, seed: int = 1) -> None:
    """Detectron-style proposals (descending score) for every image of ``ann_path``."""
    import orjson

    with open(ann_path, "rb") as fh:
        images = orjson.loads(fh.read())["images"]
    rng = np.random.default_rng(seed)
    ids = np.array([im["id"] for im in images])
    w = np.array([im["width"] for im in images], np.float32)
    h = np.array([im["height"] for im in images], np.float32)
    n = ids.size
    boxes = np.empty((n * per_image, 4), np.float32)
    step = max(1, 2_000_000 // per_image)
    for s in range(0, n, step):
        e = min(n, s + step)
        k = (e - s) * per_image
        ww = np.repeat(w[s:e], per_image)
        hh = np.repeat(h[s:e], per_image)
        x1 = rng.random(k, np.float32) * ww
        y1 = rng.random(k, np.float32) * hh
        boxes[s * per_image:e * per_image] = np.stack(
            [x1, y1, x1 + rng.random(k, np.float32) * ww / 2,
             y1 + rng.random(k, np.float32) * hh / 2], 1)
    scores = np.tile(np.linspace(1, 0, per_image, dtype=np.float32), n)
    if fmt == "npz":
        np.savez(path, ids=ids, counts=np.full(n, per_image), boxes=boxes, scores=scores)
    else:
        with open(path, "wb") as fh:
            pickle.dump({"boxes": list(boxes.reshape(n, per_image, 4)),
                         "scores": list(scores.reshape(n, per_image)), "ids": ids.tolist(),
                         "cfg": ""}, fh, protocol=4)


# ----------------------------------------------------------------------------- phases
def _private_dirty_kb() -> int:
    with open("/proc/self/smaps_rollup") as fh:
        for line in fh:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1])
    return 0


class _Touch:
    def __init__(self, db):
        self.db = db

    def __len__(self):
        return 1

    def __getitem__(self, _):
        before = _private_dirty_kb()
        t0 = time.perf_counter()
        acc = 0.0
        for i in range(len(self.db)):
            e = self.db[i]
            acc += float(e["boxes"][:, 2].sum()) + len(e["segms"]) + float(e["max_overlaps"].sum())
        return _private_dirty_kb() - before, time.perf_counter() - t0, acc


def _worker_memory(db) -> tuple[float, float]:
    import gc

    import torch.utils.data

    gc.collect()
    gc.freeze()
    loader = torch.utils.data.DataLoader(_Touch(db), batch_size=None, num_workers=1,
                                         multiprocessing_context="fork")
    (delta_kb, secs, _), = list(loader)
    return delta_kb / 1024.0, secs


def _catalog(ann: str):
    from lit_roidata.catalog import Catalog

    cat = Catalog(builtins=False)
    cat.register("bench", os.path.dirname(ann), ann)
    return cat


class _MemoryPeak:
    """Peak memory of this process tree while it runs, sampled every 200 ms: the sum of the
    PSS of this process and its children (the forked builder, its workers and the pickle
    reader run at the same time; PSS counts shared pages once) plus the growth of the
    machine's shared memory (``Shmem`` in /proc/meminfo: the shared scratch file a proposal
    pickle is staged in, which no process maps). Machine-wide: run the benchmark alone."""

    def __init__(self) -> None:
        import psutil

        self._me, self.base, self.peak = psutil.Process(), self._shmem(), 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _shmem() -> float:
        with open("/proc/meminfo") as fh:
            return next((int(x.split()[1]) / 1024.0 for x in fh if x.startswith("Shmem:")), 0.0)

    @staticmethod
    def _pss(pid: int) -> float:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                return next((int(x.split()[1]) / 1024.0 for x in fh if x.startswith("Pss:")),
                            0.0)
        except OSError:  # ended meanwhile
            return 0.0

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            try:
                pids = [self._me.pid] + [c.pid for c in self._me.children(recursive=True)]
            except psutil.Error:
                continue
            total = sum(map(self._pss, pids)) + max(0.0, self._shmem() - self.base)
            self.peak = max(self.peak, total)

    def stop(self) -> float:
        """The peak in MiB."""
        self._stop.set()
        self._thread.join()
        return self.peak


def phase_ours(args) -> dict:
    from lit_roidata.config import get_cfg
    from lit_roidata.roidb import combined_roidb_for_training

    props = [args.proposals] if args.proposals else ()
    cfg, catalog = get_cfg(), _catalog(args.ann)  # config parsing is not the roidb's time
    mem = _MemoryPeak()
    c0, t0, io0, us0 = _cpu_s(), time.perf_counter(), _write_bytes(), _user_sys()
    db = combined_roidb_for_training("bench", props, cfg, args.cache,
                                     catalog=catalog, check_images=False,
                                     progress=False, verify=True if args.verify else None,
                                     trust_pickle=True)  # the benchmark wrote the file
    secs = time.perf_counter() - t0
    us1 = _user_sys()
    tree_mb = mem.stop()
    out = {"seconds": secs, "entries": len(db), "maxrss_mb": max(_maxrss_mb(), tree_mb),
           "tree_peak_mb": tree_mb,
           "cpu_s": _cpu_s() - c0, "user_s": us1[0] - us0[0], "sys_s": us1[1] - us0[1],
           "written_gb": (_write_bytes() - io0) / 1e9,
           "cache_gb": sum(os.path.getsize(os.path.join(db.path, f))
                           for f in os.listdir(db.path)) / 1e9}
    if args.worker:
        out["worker_mb"], out["worker_touch_s"] = _worker_memory(db)
    return out


def phase_d2(args) -> dict:
    """Detectron2's ``load_coco_json`` (its dataset dicts), imported from ``--d2-src``."""
    import logging

    sys.path.insert(0, os.path.abspath(args.d2_src))
    logging.disable(logging.WARNING)
    from detectron2.data.datasets.coco import load_coco_json

    c0, t0 = _cpu_s(), time.perf_counter()
    dicts = load_coco_json(args.ann, os.path.dirname(args.ann), "bench")
    secs = time.perf_counter() - t0
    return {"seconds": secs, "entries": len(dicts), "maxrss_mb": _maxrss_mb(),
            "cpu_s": _cpu_s() - c0}


def phase_baseline(args) -> dict:
    from lit_roidata.config import get_cfg
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from oracles.reference import ReferenceDataset, reference_combined_roidb

    t0 = time.perf_counter()
    ds = ReferenceDataset("bench", os.path.dirname(args.ann), args.ann)
    db = reference_combined_roidb([ds], [args.proposals or None], get_cfg())
    secs = time.perf_counter() - t0
    out = {"seconds": secs, "entries": len(db), "maxrss_mb": _maxrss_mb()}
    if args.worker:
        out["worker_mb"], out["worker_touch_s"] = _worker_memory(db)
    return out


def _write_bytes() -> int:
    """Bytes this process and its reaped children (the forked builder) sent towards the
    disk (``write_bytes`` of ``/proc/self/io``: counted when a page is dirtied, so scratch
    files deleted before writeback count too); -1 where it is not available."""
    try:
        with open("/proc/self/io") as fh:
            for line in fh:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _user_sys() -> tuple[float, float]:
    """User and system CPU seconds of this process and its waited-for children."""
    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + b.ru_utime, a.ru_stime + b.ru_stime


def _cpu_s() -> float:
    """CPU seconds (user + system) of this process and its waited-for children (the
    forked builder): on a shared machine a steadier measure than wall time."""
    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def phase_convert(args) -> dict:
    from lit_roidata.roidb.proposals import convert_proposals

    c0, t0 = _cpu_s(), time.perf_counter()
    info = convert_proposals(args.proposals, args.out, trust_pickle=True)
    return {"seconds": time.perf_counter() - t0, "entries": info["images"],
            "maxrss_mb": _maxrss_mb(), "boxes": info["boxes"], "cpu_s": _cpu_s() - c0}


def phase_d2_proposals(args) -> dict:
    """Detectron2's whole load with proposals, as its ``get_detection_dataset_dicts`` +
    ``build_detection_train_loader`` do it (from a source checkout; nothing vendored)."""
    sys.path.insert(0, os.path.abspath(args.d2_src))
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    from detectron2.data.build import load_proposals_into_dataset
    from detectron2.data.common import DatasetFromList
    from detectron2.data.datasets.coco import load_coco_json

    base = _maxrss_mb()
    c0, t0 = _cpu_s(), time.perf_counter()
    dicts = load_coco_json(args.ann, os.path.dirname(args.ann))
    dicts = load_proposals_into_dataset(dicts, args.proposals)
    ds = DatasetFromList(dicts, copy=False, serialize=True)
    secs = time.perf_counter() - t0
    return {"seconds": secs, "entries": len(ds), "maxrss_mb": _maxrss_mb(),
            "import_rss_mb": base, "cpu_s": _cpu_s() - c0}


def _maxrss_mb() -> float:
    """Peak RSS of this process image or of a forked builder child (VmHWM: ``ru_maxrss``
    would include the memory of the benchmark parent this process was forked from)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                own = int(line.split()[1]) / 1024.0
    # the builder runs in a forked child (lit_roidata.roidb.build._in_child)
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    return max(own, child)


def warm_page_cache(*paths: str) -> None:
    """Read ``paths`` once (untimed), so that every timed phase starts with its inputs in
    the page cache: on a machine with proactive memory reclaim an input left idle for a
    minute is partly evicted, and the phase would time the disk instead."""
    buf = bytearray(1 << 24)
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def run_phase(name: str, **kw) -> dict:
    """Run a phase in a fresh process, its input files read into the page cache first."""
    warm_page_cache(*(kw[k] for k in ("ann", "proposals") if kw.get(k)))
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", name]
    for k, v in kw.items():
        if v is True:
            cmd.append(f"--{k.replace('_', '-')}")
        elif v not in (None, False):
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"phase {name} failed (exit status {res.returncode}):\n"
                           f"{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def subsample(ann: str, out: str, n: int) -> None:
    import orjson

    with open(ann, "rb") as fh:
        d = orjson.loads(fh.read())
    keep = {im["id"] for im in d["images"][:n]}
    d["images"] = d["images"][:n]
    d["annotations"] = [a for a in d["annotations"] if a["image_id"] in keep]
    with open(out, "wb") as fh:
        fh.write(orjson.dumps(d))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="~5k images")
    p.add_argument("--images", type=int, default=118_287)
    p.add_argument("--anns-per-image", type=float, default=7.3)
    p.add_argument("--proposals-per-image", type=int, default=1000)
    p.add_argument("--proposal-format", choices=["pkl", "npz"], default="pkl")
    p.add_argument("--baseline-images", type=int, default=None,
                   help="run the list-of-dicts baseline on the first N images (default: all)")
    p.add_argument("--baseline-proposals", action="store_true",
                   help="also run the baseline with proposals (default: only with --quick)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--reuse", action="store_true",
                   help="reuse the generated files already in --workdir")
    p.add_argument("--proposals-vs-d2", action="store_true",
                   help="only the proposal-loading comparison with Detectron2 (see above)")
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ann", default=None, help=argparse.SUPPRESS)
    p.add_argument("--proposals", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--d2-src", default=None,
                   help="a detectron2 source checkout: adds Detectron2's rows (load_coco_json; "
                        "with --proposals-vs-d2, its proposal loading)")
    p.add_argument("--repeat", type=int, default=1,
                   help="repeat the cold gt build and the Detectron2 row N times (spread); "
                        "with --proposals-vs-d2, each proposal-comparison phase")
    p.add_argument("--gt-only", action="store_true",
                   help="annotations only: no proposal file, no proposal rows")
    p.add_argument("--skip-baseline", action="store_true",
                   help="skip the list-of-dicts baseline (Detectron's port)")
    args = p.parse_args()
    if args.phase:
        fn = {"ours": phase_ours, "baseline": phase_baseline, "convert": phase_convert,
              "d2props": phase_d2_proposals, "d2": phase_d2}[args.phase]
        print(json.dumps(fn(args)))
        return
    if args.quick:
        args.images = 5000
        args.baseline_proposals = True
    if args.proposals_vs_d2:
        proposals_vs_d2(args)
        return
    work = args.workdir or tempfile.mkdtemp(prefix="roidb-bench-")
    os.makedirs(work, exist_ok=True)
    ann = os.path.join(work, "instances.json")
    prop = os.path.join(work, f"proposals.{args.proposal_format}")
    if not (args.reuse and os.path.exists(ann) and (args.gt_only or os.path.exists(prop))):
        t = time.perf_counter()
        n_anns = generate_coco(ann, args.images, args.anns_per_image)
        print(f"generated {args.images} images, {n_anns} annotations "
              f"({os.path.getsize(ann) / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f}s")
    if not args.gt_only and not (args.reuse and os.path.exists(prop)):
        t = time.perf_counter()
        generate_proposals(ann, prop, args.proposals_per_image, args.proposal_format)
        print(f"generated {args.proposals_per_image} proposals/image "
              f"({os.path.getsize(prop) / 2**20:.0f} MiB) in {time.perf_counter() - t:.0f}s")
    cache = os.path.join(work, "cache")
    shutil.rmtree(cache, ignore_errors=True)  # a cold build must start from nothing
    rows = {}
    d2_ok = bool(args.d2_src) and os.path.isdir(os.path.join(args.d2_src, "detectron2"))
    colds, d2s = [], []
    for _ in range(max(1, args.repeat)):  # interleaved, so both see the same load
        shutil.rmtree(cache, ignore_errors=True)
        colds.append(run_phase("ours", ann=ann, cache=cache))
        if d2_ok:
            d2s.append(run_phase("d2", ann=ann, d2_src=args.d2_src))
    rows["ours gt cold"] = min(colds, key=lambda r: r["seconds"])
    rows["ours gt cold"]["all"] = [r["seconds"] for r in colds]
    rows["ours gt cold"]["all_cpu"] = [r["cpu_s"] for r in colds]
    rows["ours gt cold"]["cpu_s"] = min(r["cpu_s"] for r in colds)
    if d2s:
        rows["detectron2 load"] = min(d2s, key=lambda r: r["seconds"])
        rows["detectron2 load"]["all"] = [r["seconds"] for r in d2s]
        rows["detectron2 load"]["all_cpu"] = [r["cpu_s"] for r in d2s]
        rows["detectron2 load"]["cpu_s"] = min(r["cpu_s"] for r in d2s)
    rows["ours gt warm"] = run_phase("ours", ann=ann, cache=cache, worker=True)
    rows["ours warm+verify"] = run_phase("ours", ann=ann, cache=cache, verify=True)
    if not args.gt_only:
        rows["ours +props cold"] = run_phase("ours", ann=ann, cache=cache, proposals=prop)
        rows["ours +props warm"] = run_phase("ours", ann=ann, cache=cache, proposals=prop,
                                             worker=True)
    b_ann, scale = ann, 1.0
    if args.baseline_images and args.baseline_images < args.images:
        b_ann = os.path.join(work, "baseline.json")
        subsample(ann, b_ann, args.baseline_images)
        scale = args.images / args.baseline_images
    if not args.skip_baseline:
        rows["baseline gt"] = run_phase("baseline", ann=b_ann, worker=True)
        if args.baseline_proposals and not args.gt_only:
            rows["baseline +props"] = run_phase("baseline", ann=b_ann, proposals=prop,
                                                worker=True)
    report(rows, scale, args)
    if not d2_ok:
        print("note: no Detectron2 row (pass --d2-src <detectron2 source checkout>)")


def proposals_vs_d2(args) -> None:
    """Proposal loading: ours (convert once; cold builds from .pkl and .npz) vs Detectron2.

    Every phase runs in a fresh process; peak RSS is that process's high-water mark (or
    of its forked builder child). Our cold builds start from an empty cache each time.
    """
    work = args.workdir or tempfile.mkdtemp(prefix="roidb-props-bench-")
    os.makedirs(work, exist_ok=True)
    ann = os.path.join(work, "instances.json")
    pkl = os.path.join(work, "proposals.pkl")
    npz = os.path.join(work, "proposals.npz")
    if not (args.reuse and os.path.exists(ann) and os.path.exists(pkl)):
        t = time.perf_counter()
        n_anns = generate_coco(ann, args.images, args.anns_per_image)
        generate_proposals(ann, pkl, args.proposals_per_image, "pkl")
        print(f"generated {args.images} images, {n_anns} annotations, "
              f"{args.proposals_per_image} proposals/image "
              f"({os.path.getsize(pkl) / 2**20:.0f} MiB pickle) in "
              f"{time.perf_counter() - t:.0f}s")
    cache = os.path.join(work, "cache")
    rows: dict = {}

    def run(name, phase, **kw):
        if phase == "ours":
            shutil.rmtree(cache, ignore_errors=True)
        try:
            r = run_phase(phase, **kw)
        except RuntimeError as exc:  # e.g. killed for memory on a shared machine: go on
            print(f"{name}: FAILED ({str(exc).strip()[-300:]})", flush=True)
            return
        finally:
            if phase == "ours":
                shutil.rmtree(cache, ignore_errors=True)  # GBs: do not leave them for the next
        rows[name].append(r)
        print(f"{name}: {json.dumps(r)}", flush=True)  # kept even if a later phase fails

    has_d2 = bool(args.d2_src) and os.path.isdir(os.path.join(args.d2_src, "detectron2"))
    d2_name = "detectron2: load + proposals + serialize"
    d2_gt = "detectron2: load_coco_json (gt only)"
    for k in ("ours: cold build from .pkl", d2_name, "ours: convert .pkl -> .npz",
              "ours: cold build from .npz", "ours: cold build, gt only", d2_gt):
        if k not in (d2_name, d2_gt) or has_d2:
            rows[k] = []
    for _ in range(max(1, args.repeat)):  # interleaved, so both see the same load
        run("ours: cold build from .pkl", "ours", ann=ann, cache=cache, proposals=pkl)
        if has_d2:
            run(d2_name, "d2props", ann=ann, proposals=pkl, **{"d2-src": args.d2_src})
    for _ in range(max(1, args.repeat)):
        run("ours: convert .pkl -> .npz", "convert", proposals=pkl, out=npz)
        run("ours: cold build from .npz", "ours", ann=ann, cache=cache, proposals=npz)
        run("ours: cold build, gt only", "ours", ann=ann, cache=cache)
        if has_d2:
            run(d2_gt, "d2", ann=ann, **{"d2-src": args.d2_src})
    rows = {k: v for k, v in rows.items() if v}
    d2 = rows.get(d2_name)
    print(f"\n{args.images} images x {args.proposals_per_image} proposals "
          f"({os.path.getsize(pkl) / 2**20:.0f} MiB pickle), {max(1, args.repeat)} run(s) "
          f"each; median [min-max]")
    print("peak memory: ours, the larger of the largest single-process RSS and the sampled sum "
          "of the process tree's PSS plus the shared scratch a pickle is staged in; "
          "Detectron2, its RSS")
    print(f"{'phase':<42}{'wall s':>20}{'CPU s':>20}{'peak memory MiB':>22}"
          f"{'wall/d2':>9}{'CPU/d2':>8}{'mem/d2':>8}")
    med = lambda v: float(np.median(v))  # noqa: E731
    for k, rs in rows.items():
        cols = ""
        for key, fmt in (("seconds", ".1f"), ("cpu_s", ".1f"), ("maxrss_mb", ".0f")):
            v = [r[key] for r in rs]
            cols += f"{med(v):>9{fmt}} [{min(v):{fmt}}-{max(v):{fmt}}]".rjust(20 if key !=
                                                                              "maxrss_mb" else 22)
        ratios = ""
        for key in ("seconds", "cpu_s", "maxrss_mb"):
            ratios += (f"{med([r[key] for r in rs]) / med([r[key] for r in d2]):>8.2f}"
                       if d2 else f"{'-':>8}")
        print(f"{k:<42}{cols} {ratios}")
    print("\nours, bytes written by the build (write_bytes of the process and its forked "
          "builder) vs the cache it leaves; CPU split user / system (median):")
    for k, rs in rows.items():
        if "written_gb" not in rs[0] or "cold" not in k:
            continue
        w = [r["written_gb"] for r in rs]
        c = [r["cache_gb"] for r in rs]
        print(f"  {k:<40} written {med(w):6.2f} GB [{min(w):.2f}-{max(w):.2f}], cache "
              f"{med(c):6.2f} GB, written/cache {med(w) / med(c):5.2f}x (target <= 1.2x); "
              f"user {med([r['user_s'] for r in rs]):.1f} s, sys "
              f"{med([r['sys_s'] for r in rs]):.1f} s")
    if d2 is None:
        print("detectron2 row skipped: pass --d2-src pointing at a detectron2 source checkout")
    else:
        pk = rows["ours: cold build from .pkl"]
        pairs = "; ".join(f"{a['seconds']:.1f}/{b['seconds']:.1f}" for a, b in zip(pk, d2))
        print(f"\ncold build from the pickle / Detectron2, wall: "
              f"{med([r['seconds'] for r in pk]) / med([r['seconds'] for r in d2]):.2f}x "
              f"(target <= 0.5x; per run, ours/d2 s: {pairs})")
        gt, dg = rows.get("ours: cold build, gt only"), rows.get(d2_gt)
        if gt and dg:
            pairs = "; ".join(f"{a['seconds']:.1f}/{b['seconds']:.1f}" for a, b in zip(gt, dg))
            print(f"cold gt build / Detectron2's load_coco_json, wall: "
                  f"{med([r['seconds'] for r in gt]) / med([r['seconds'] for r in dg]):.2f}x "
                  f"(target <= 0.25x, i.e. 4x faster; per run, ours/d2 s: {pairs})")
    print("note: the machine may be shared with other jobs; wall times include their load.")


def report(rows: dict, scale: float, args) -> None:
    print(f"\n{'phase':<18}{'entries':>9}{'time s':>10}{'peak RSS MiB':>14}"
          f"{'worker +MiB':>13}{'touch-all s':>13}")
    for k, r in rows.items():
        print(f"{k:<18}{r['entries']:>9}{r['seconds']:>10.2f}{r['maxrss_mb']:>14.0f}"
              f"{r.get('worker_mb', float('nan')):>13.1f}{r.get('worker_touch_s', float('nan')):>13.1f}")
    o, w = rows["ours gt cold"], rows["ours gt warm"]
    if "detectron2 load" in rows:
        d = rows["detectron2 load"]
        spread = lambda r, k="all": "/".join(f"{x:.1f}" for x in r[k])  # noqa: E731
        print(f"\ncold gt build vs Detectron2's load_coco_json, same run (best of "
              f"{len(o['all'])}; all: ours {spread(o)} s, detectron2 {spread(d)} s):")
        print(f"  ours / detectron2: {o['seconds'] / d['seconds']:6.2f}x wall  (target <= 0.25x; "
              f"per run pair: {', '.join(f'{a / b:.2f}' for a, b in zip(o['all'], d['all']))})")
        print(f"  ours / detectron2: {o['cpu_s'] / d['cpu_s']:6.2f}x CPU (best of each; all: "
              f"ours {spread(o, 'all_cpu')} s, detectron2 {spread(d, 'all_cpu')} s; steadier "
              f"than wall on a shared machine)")
    v = rows["ours warm+verify"]
    print(f"  checksum verification (warm open with verify=True): {v['seconds']:.2f}s vs "
          f"{w['seconds']:.3f}s without")
    if "baseline gt" not in rows:
        print("note: the machine may be shared with other jobs; wall times include their load.")
        return
    note = "" if scale == 1.0 else f" (baseline on a 1/{scale:.1f} sample, scaled linearly)"
    b = rows["baseline gt"]
    print(f"\nratios, baseline / ours{note}:")
    print(f"  build (gt):        {b['seconds'] * scale / o['seconds']:8.1f}x  "
          f"(ours cold {o['seconds']:.1f}s, target < 20s at full scale)")
    print(f"  open (warm):       {b['seconds'] * scale / w['seconds']:8.1f}x  "
          f"(ours warm {w['seconds']:.3f}s, target < 0.5s)")
    floor = w["maxrss_mb"]  # imports (torch, numpy, ...) + an opened roidb
    print(f"  peak memory (gt):  {b['maxrss_mb'] * scale / o['maxrss_mb']:8.1f}x  (above "
          f"imports: baseline {b['maxrss_mb'] - floor:.0f} MiB"
          f"{' x scale' if scale != 1.0 else ''}, ours {o['maxrss_mb'] - floor:.0f} MiB)")
    print(f"  worker memory:     {b['worker_mb'] * scale / max(w['worker_mb'], 0.1):8.1f}x  "
          f"(ours +{w['worker_mb']:.1f} MiB private per worker)")
    if "baseline +props" in rows:
        bp, op = rows["baseline +props"], rows["ours +props cold"]
        print(f"  build (+props):    {bp['seconds'] * scale / op['seconds']:8.1f}x")
        print(f"  worker (+props):   {bp['worker_mb'] * scale / max(rows['ours +props warm']['worker_mb'], 0.1):8.1f}x")
    print("note: the machine may be shared with other jobs; wall times include their load.")


if __name__ == "__main__":
    main()
