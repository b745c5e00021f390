"""Benchmark: the cold roidb build at Objects365 scale, in bounded memory, vs Detectron2.

Generates (in bounded memory, chunk by chunk) a COCO-style box-only annotation file in
the shape of Objects365 v2 train: 1,742,292 images, ~25.4M annotations, 365 categories,
~3.2 GiB of minified JSON, with Objects365's image and annotation fields (``license``,
``url``, ``isfake``, ``isreflected`` the roidb does not read). Then, each in a fresh
process:

* **ours, cold**: ``combined_roidb_for_training`` with an empty cache (decode in windows,
  clean, write). Peak memory is the *whole process tree's*: the benchmark process and
  the forked builder are sampled together every 200 ms (sum of RSS over the tree, via
  ``psutil``), and the maximum of the sums is reported; ``ru_maxrss`` of the children is
  printed next to it as a cross-check (it is the largest single process, not a sum).
* **ours, warm**: the same call with the cache present.
* **loader PSS** (``--loader-pss``): total PSS of the main process + 2 workers of the e2e
  loader (Faster R-CNN FPN targets; images synthesised at each entry's size) over this
  roidb after 100 timed images, and each worker's private anonymous memory, measured
  as ``benchmarks/loader_vs_peers.py`` measures them.
* **Detectron2**: ``detectron2.data.datasets.coco.load_coco_json`` on the same file, from
  a source checkout (``--d2-src``), under an address-space limit (``RLIMIT_AS``,
  ``--d2-limit-gib``, default 8) set in its child process so it fails cleanly instead of
  swapping the machine: the row reports how far it got (seconds, peak RSS at failure)
  or its figures if it fits.

Usage::

    python benchmarks/roidb_build_o365.py --d2-src /path/to/detectron2      # full scale
    python benchmarks/roidb_build_o365.py --images 200000 --repeat 2       # scaled down

The generated file is written under ``--workdir`` (default ``/tmp/roidb-o365``) and
removed at the end unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roidb_build import warm_page_cache  # noqa: E402

O365_IMAGES = 1_742_292
O365_ANNS_PER_IMAGE = 25_400_000 / O365_IMAGES
O365_CATEGORIES = 365


# ----------------------------------------------------------------------------- data
def generate_o365(path: str, n_images: int, anns_per_image: float = O365_ANNS_PER_IMAGE,
                  seed: int = 0, chunk: int = 50_000) -> int:
    """Write an Objects365-shaped box-only COCO json, ``chunk`` images at a time.

    Memory is bounded by the chunk (the text of ``chunk`` images and their boxes); the
    file is minified, as Objects365's own. Returns the number of annotations.
    """
    rng = np.random.default_rng(seed)
    ann_id = 0
    with open(path, "w", encoding="utf-8") as fh:
        fh.write('{"images":[')
        for s in range(0, n_images, chunk):
            e = min(n_images, s + chunk)
            ids = np.arange(s, e) + 1
            w, h = _sizes(seed, s, e)
            fh.write(("," if s else "") + ",".join(
                f'{{"height":{hh},"id":{i},"license":5,"width":{ww},"file_name":'
                f'"images/v2/patch{i % 51}/objects365_v2_{i:08d}.jpg","url":""}}'
                for i, ww, hh in zip(ids.tolist(), w.tolist(), h.tolist())))
        fh.write('],"annotations":[')
        rng = np.random.default_rng(seed + 1)
        first = True
        for s in range(0, n_images, chunk):
            e = min(n_images, s + chunk)
            w_i, h_i = _sizes(seed, s, e)
            n_per = rng.poisson(anns_per_image, e - s)
            img = np.repeat(np.arange(s, e) + 1, n_per)
            wi, hi = np.repeat(w_i, n_per), np.repeat(h_i, n_per)
            n = img.size
            bw = np.minimum(np.exp(rng.normal(3.6, 1.1, n)), wi - 1)
            bh = np.minimum(np.exp(rng.normal(3.6, 1.1, n)), hi - 1)
            bx = rng.random(n) * (wi - bw)
            by = rng.random(n) * (hi - bh)
            cat = rng.integers(1, O365_CATEGORIES + 1, n)
            crowd = (rng.random(n) < 0.002).astype(np.int64)
            ids = np.arange(ann_id, ann_id + n) + 1
            ann_id += n
            area = bw * bh
            cols = [ids, crowd, area.round(2), bx.round(2), by.round(2), bw.round(2),
                    bh.round(2), img, cat]
            text = ",".join(
                f'{{"id":{a},"iscrowd":{c},"isfake":0,"area":{ar},"isreflected":0,'
                f'"bbox":[{x},{y},{ww},{hh}],"image_id":{im},"category_id":{ct}}}'
                for a, c, ar, x, y, ww, hh, im, ct in zip(*(c_.tolist() for c_ in cols)))
            if text:
                fh.write(("" if first else ",") + text)
                first = False
        fh.write('],"categories":[' + ",".join(
            f'{{"name":"object{c}","id":{c}}}' for c in range(1, O365_CATEGORIES + 1))
            + '],"licenses":[{"name":"x","id":5,"url":""}]}')
    return ann_id


def _sizes(seed: int, s: int, e: int) -> tuple:
    """Widths and heights of images ``s:e`` (the same in both passes)."""
    r = np.random.default_rng([seed, s])
    return r.integers(300, 1025, e - s), r.integers(300, 1025, e - s)


# ----------------------------------------------------------------------------- phases
def _catalog(ann: str):
    from lit_roidata.catalog import Catalog

    cat = Catalog(builtins=False)
    cat.register("o365", os.path.dirname(ann), ann)
    return cat


def phase_ours(args) -> dict:
    """Our build (cold when the cache is empty, else the warm open)."""
    from lit_roidata.config import get_cfg
    from lit_roidata.roidb import combined_roidb_for_training

    cfg, catalog = get_cfg(), _catalog(args.ann)
    t0 = time.perf_counter()
    db = combined_roidb_for_training("o365", (), cfg, args.cache, catalog=catalog,
                                     check_images=False, progress=False)
    secs = time.perf_counter() - t0
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"seconds": secs, "entries": len(db), "children_maxrss_mb": ch.ru_maxrss / 1024,
            "children_user_s": ch.ru_utime, "children_sys_s": ch.ru_stime}


def phase_loader(args) -> dict:
    """The e2e loader (Faster R-CNN FPN targets, 2 workers, aspect grouping, flips) over
    the built roidb: images/s, and after 100 timed images the total PSS of the main
    process and its workers and each worker's private anonymous memory
    (``loader_vs_peers.py``'s measures). Images are not read from disk (the file has no
    images): each entry gets one of 8 noise images resized to its size, as a decoder
    would return it."""
    import cv2

    from loader_vs_peers import time_loader
    from lit_roidata.config import get_cfg
    from lit_roidata.loader import build_train_loader
    from lit_roidata.minibatch.model_type import flags_for_model_type
    from lit_roidata.roidb import combined_roidb_for_training

    catalog = _catalog(args.ann)
    db = combined_roidb_for_training("o365", (), get_cfg(), args.cache, catalog=catalog,
                                     check_images=False, progress=False)
    cfg = get_cfg()
    cfg.merge_from_dict({**flags_for_model_type("faster_rcnn_fpn"),
                         "MODEL.NUM_CLASSES": O365_CATEGORIES + 1, "TRAIN.IMS_PER_BATCH": 2,
                         "TRAIN.SCALES": [640, 672, 704, 736, 768, 800], "TRAIN.MAX_SIZE": 1333})
    cfg.infer()
    rng = np.random.default_rng(0)
    pool = [rng.integers(0, 256, (480, 640, 3), np.uint8) for _ in range(8)]

    def fake_read(entry):
        return cv2.resize(pool[hash(entry["image"]) % 8],
                          (int(entry["width"]), int(entry["height"])))

    loader = build_train_loader(cfg, db, num_workers=2, prefetch_factor=2, infinite=True)
    loader.dataset.loader = fake_read
    res = time_loader(iter(loader), 4, 100, mem_at=())
    res["entries"] = len(db)
    return res


def phase_d2(args) -> dict:
    """Detectron2's ``load_coco_json`` under ``RLIMIT_AS`` (set here, in the child)."""
    import logging

    limit = int(args.d2_limit_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.path.insert(0, os.path.abspath(args.d2_src))
    logging.disable(logging.WARNING)
    t0 = time.perf_counter()
    try:
        from detectron2.data.datasets.coco import load_coco_json

        dicts = load_coco_json(args.ann, os.path.dirname(args.ann), "o365")
    except MemoryError:
        return {"seconds": time.perf_counter() - t0, "failed": "MemoryError",
                "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    return {"seconds": time.perf_counter() - t0, "entries": len(dicts),
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_phase(name: str, **kw) -> dict:
    """Run a phase in a fresh process (its input read into the page cache first); sample
    the RSS of its whole process tree."""
    import psutil

    if kw.get("ann"):
        warm_page_cache(kw["ann"])

    cmd = [sys.executable, os.path.abspath(__file__), "--phase", name]
    for k, v in kw.items():
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0, 0]
    done = threading.Event()

    def sample() -> None:
        try:
            p = psutil.Process(proc.pid)
        except psutil.Error:
            return
        while not done.is_set():
            total, n = 0, 0
            try:
                for q in [p] + p.children(recursive=True):
                    try:
                        total += q.memory_info().rss
                        n += 1
                    except psutil.Error:
                        pass
            except psutil.Error:
                break
            if total > peak[0]:
                peak[:] = [total, n]
            time.sleep(0.2)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate()
    done.set()
    th.join()
    if proc.returncode != 0:
        raise RuntimeError(f"phase {name} failed:\n{err[-4000:]}")
    res = json.loads(out.strip().splitlines()[-1])
    res["tree_peak_rss_mb"] = peak[0] / 2**20
    res["tree_processes_at_peak"] = peak[1]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=O365_IMAGES)
    p.add_argument("--repeat", type=int, default=1, help="cold builds (spread)")
    p.add_argument("--workdir", default="/tmp/roidb-o365")
    p.add_argument("--reuse", action="store_true", help="reuse a generated file in --workdir")
    p.add_argument("--keep", action="store_true", help="keep the generated file")
    p.add_argument("--d2-src", default=None, help="a detectron2 source checkout")
    p.add_argument("--d2-limit-gib", type=float, default=8.0)
    p.add_argument("--loader-pss", action="store_true",
                   help="also measure the e2e loader's memory (2 workers) over the roidb")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ann", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        print(json.dumps({"ours": phase_ours, "d2": phase_d2,
                          "loader": phase_loader}[args.phase](args)))
        return
    os.makedirs(args.workdir, exist_ok=True)
    ann = os.path.join(args.workdir, f"o365_{args.images}.json")
    cache = os.path.join(args.workdir, "cache")
    if not (args.reuse and os.path.exists(ann)):
        t = time.perf_counter()
        n = generate_o365(ann + ".tmp", args.images)
        os.replace(ann + ".tmp", ann)
        print(f"generated {args.images} images, {n} annotations "
              f"({os.path.getsize(ann) / 2**30:.2f} GiB) in {time.perf_counter() - t:.0f} s")
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}", flush=True)
    try:
        colds = []
        for _ in range(max(1, args.repeat)):
            shutil.rmtree(cache, ignore_errors=True)
            colds.append(run_phase("ours", ann=ann, cache=cache))
            r = colds[-1]
            print(f"ours cold: {r['seconds']:.1f} s wall, whole-tree peak RSS "
                  f"{r['tree_peak_rss_mb'] / 1024:.2f} GiB (sampled sum over "
                  f"{r['tree_processes_at_peak']} processes; builder ru_maxrss "
                  f"{r['children_maxrss_mb'] / 1024:.2f} GiB), builder CPU "
                  f"{r['children_user_s']:.1f} s user + {r['children_sys_s']:.1f} s system, "
                  f"{r['entries']} entries", flush=True)
        warm = [run_phase("ours", ann=ann, cache=cache) for _ in range(3)]
        secs = ", ".join(f"{w['seconds']:.3f}" for w in warm)
        print(f"ours warm open: {secs} s", flush=True)
        size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(cache)
                   for f in fs)
        print(f"cache size: {size / 2**30:.2f} GiB")
        if args.loader_pss:
            r = run_phase("loader", ann=ann, cache=cache)
            m = r["memory"]
            ws = ", ".join(f"USS {w['uss']:.0f} / private anonymous {w['private_anon']:.0f}"
                           for w in m["workers"])
            print(f"loader (e2e Faster R-CNN FPN targets, 2 workers, after {r['images']} "
                  f"timed images): {r['images_per_s']:.0f} img/s; total PSS "
                  f"{m['total_pss']:.0f} MiB (main {m['main_pss']:.0f} MiB); workers MiB: "
                  f"{ws}", flush=True)
        if args.d2_src:
            try:
                d = run_phase("d2", ann=ann, d2_src=args.d2_src, d2_limit_gib=args.d2_limit_gib)
            except RuntimeError as exc:  # e.g. killed: report what we know
                print(f"detectron2 load_coco_json: failed ({str(exc)[-300:]})")
            else:
                what = (f"stopped by {d['failed']} under RLIMIT_AS={args.d2_limit_gib:g} GiB"
                        if "failed" in d else f"{d['entries']} dicts")
                print(f"detectron2 load_coco_json: {what} after {d['seconds']:.1f} s, peak RSS "
                      f"{d['maxrss_mb'] / 1024:.2f} GiB (sampled tree "
                      f"{d['tree_peak_rss_mb'] / 1024:.2f} GiB)")
                best = min(c["seconds"] for c in colds)
                if "failed" not in d:
                    print(f"ratio ours cold / detectron2: {best / d['seconds']:.2f}x")
                else:
                    print(f"ours finished the whole build in {best:.1f} s within "
                          f"{max(c['tree_peak_rss_mb'] for c in colds) / 1024:.2f} GiB; "
                          f"detectron2 had not finished loading after {d['seconds']:.1f} s "
                          f"when it reached {args.d2_limit_gib:g} GiB of address space")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if not args.keep:
            os.remove(ann)


if __name__ == "__main__":
    main()
