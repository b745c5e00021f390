"""Benchmark: LVIS roidb build vs Detectron2's ``load_lvis_json``, and vs our COCO path.

Writes a synthetic LVIS v1-shaped annotation file (no images): ``--images`` images with
about 12 polygon annotations each over 1203 categories (LVIS v1 train averages ~12.7),
``coco_url`` names, and per-image neg (~8) and not-exhaustive (~1) lists. The same
content in COCO form is written next to it: ``file_name`` instead of ``coco_url`` and no lists.
Each phase runs in a fresh subprocess, ``--repeat`` times:

* ``lvis``: a cold ``roidb_for_evaluation`` of the LVIS file (``format="lvis"``);
* ``coco``: the same for the COCO copy (the LVIS extras' cost is ``lvis / coco``);
* ``d2``: Detectron2's ``load_lvis_json`` on the LVIS file, imported from a source
  checkout given with ``--d2-src`` (its ``lvis.py`` without ``detectron2/data/__init__``;
  needs ``fvcore``, ``iopath`` and ``lvis``). The row is skipped with a note when absent.

The output is wall seconds (min / median / max), CPU seconds (median; ours includes the
forked builder), peak RSS (Detectron2's includes the modules it imports, torch among
them), and the ratios ``ours / Detectron2`` and ``lvis / coco``, of wall and CPU time. The machine may be shared, so compare rows from
the same run. Usage::

    python benchmarks/lvis_roidb_build.py --images 20000 --d2-src ../d2src
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def make_files(out: str, n_images: int, seed: int = 0) -> tuple[str, str]:
    """Write ``lvis.json`` and ``coco.json`` (the same content in COCO form) under ``out``."""
    import orjson

    rng = np.random.default_rng(seed)
    n_cat = 1203
    cats = [{"id": i, "name": f"cat_{i}", "synonyms": [f"cat_{i}"], "def": "", "synset": "",
             "frequency": "rfc"[i % 3], "image_count": 1, "instance_count": 1}
            for i in range(1, n_cat + 1)]
    # long-tailed category draw (Zipf-like weights over a random order)
    w = 1.0 / np.arange(1, n_cat + 1) ** 1.1
    w = w[rng.permutation(n_cat)]
    w /= w.sum()
    images, anns = [], []
    aid = 0
    for i in range(n_images):
        iid = 1 + 3 * i
        W, H = int(rng.integers(320, 641)), int(rng.integers(240, 481))
        k = int(rng.poisson(12))
        cids = rng.choice(n_cat, size=k, p=w) + 1
        for c in cids.tolist():
            x, y = float(rng.uniform(0, W - 20)), float(rng.uniform(0, H - 20))
            bw, bh = float(rng.uniform(4, W - x)), float(rng.uniform(4, H - y))
            t = np.linspace(0, 2 * np.pi, 16, endpoint=False)
            poly = np.stack([x + bw / 2 * (1 + np.cos(t)), y + bh / 2 * (1 + np.sin(t))], 1)
            aid += 1
            anns.append({"id": aid, "image_id": iid, "category_id": c,
                         "bbox": [round(x, 2), round(y, 2), round(bw, 2), round(bh, 2)],
                         "area": round(bw * bh * 0.78, 2),
                         "segmentation": [np.round(poly, 2).reshape(-1).tolist()]})
        present = set(cids.tolist())
        neg = rng.choice(n_cat, size=int(rng.poisson(8)), replace=False) + 1
        images.append({"id": iid, "width": W, "height": H,
                       "coco_url": f"http://images.cocodataset.org/train2017/{iid:012d}.jpg",
                       "neg_category_ids": sorted(set(neg.tolist()) - present),
                       "not_exhaustive_category_ids": sorted(present)[:int(rng.integers(0, 2))]})
    lvis_path, coco_path = os.path.join(out, "lvis.json"), os.path.join(out, "coco.json")
    with open(lvis_path, "wb") as fh:
        fh.write(orjson.dumps({"images": images, "annotations": anns, "categories": cats}))
    coco_images = [{"id": im["id"], "width": im["width"], "height": im["height"],
                    "file_name": im["coco_url"].split("/")[-1]} for im in images]
    with open(coco_path, "wb") as fh:
        fh.write(orjson.dumps({"images": coco_images, "annotations": anns,
                               "categories": cats}))
    return lvis_path, coco_path


def _cpu_s() -> float:
    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def _maxrss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    return round(max(own, child), 1)


def phase(args: argparse.Namespace) -> dict:
    if args.phase == "d2":
        src = os.path.abspath(args.d2_src)
        for name, sub in (("detectron2", ""), ("detectron2.data", "data"),
                          ("detectron2.data.datasets", "data/datasets")):
            m = types.ModuleType(name)
            m.__path__ = [os.path.join(src, "detectron2", sub)]
            sys.modules[name] = m
        cat = importlib.import_module("detectron2.data.catalog")
        sys.modules["detectron2.data"].DatasetCatalog = cat.DatasetCatalog
        sys.modules["detectron2.data"].MetadataCatalog = cat.MetadataCatalog
        load = importlib.import_module("detectron2.data.datasets.lvis").load_lvis_json
        c0, t0 = _cpu_s(), time.perf_counter()
        n = len(load(args.ann, "/images/"))
    else:
        from lit_roidata.catalog import Catalog
        from lit_roidata.roidb import roidb_for_evaluation

        catalog = Catalog(builtins=False)
        catalog.register("bench", "/images", args.ann, format=args.phase)
        c0, t0 = _cpu_s(), time.perf_counter()
        n = len(roidb_for_evaluation("bench", None, args.cache, catalog=catalog,
                                     check_images=False, progress=False, rebuild=True))
    return {"seconds": time.perf_counter() - t0, "cpu_s": _cpu_s() - c0, "images": n,
            "maxrss_mb": _maxrss_mb()}


def run(name: str, ann: str, cache: str, d2_src: str | None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", name, "--ann", ann,
           "--cache", cache] + (["--d2-src", d2_src] if d2_src else [])
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"phase {name} failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--d2-src", default=None, help="a Detectron2 source checkout")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ann", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.phase:
        print(json.dumps(phase(args)))
        return
    d2_ok = bool(args.d2_src) and os.path.isfile(
        os.path.join(args.d2_src, "detectron2", "data", "datasets", "lvis.py"))
    with tempfile.TemporaryDirectory(prefix="lvis_bench_") as tmp:
        lvis_path, coco_path = make_files(tmp, args.images)
        mb = os.path.getsize(lvis_path) / 2 ** 20
        print(f"{args.images} images, {mb:.0f} MB LVIS json; {args.repeat} runs per row")
        rows: dict[str, list] = {"lvis": [], "coco": []} | ({"d2": []} if d2_ok else {})
        for _ in range(args.repeat):  # interleaved, so load changes hit every row alike
            for name in rows:
                ann = coco_path if name == "coco" else lvis_path
                rows[name].append(run(name, ann, os.path.join(tmp, "cache"), args.d2_src))
    med, cpu = {}, {}
    label = {"lvis": "ours, LVIS file (format lvis)", "coco": "ours, same content as COCO",
             "d2": "Detectron2 load_lvis_json"}
    for name, rs in rows.items():
        s = sorted(r["seconds"] for r in rs)
        med[name] = statistics.median(s)
        cpu[name] = statistics.median(r["cpu_s"] for r in rs)
        print(f"{label[name]:34s} wall {s[0]:7.2f} / {med[name]:7.2f} / {s[-1]:7.2f} s  "
              f"cpu {cpu[name]:7.2f} s  "
              f"peak {max(r['maxrss_mb'] for r in rs):7.0f} MB")
    print(f"ratio lvis / coco (median wall): {med['lvis'] / med['coco']:.2f}, "
          f"(median cpu): {cpu['lvis'] / cpu['coco']:.2f}")
    if d2_ok:
        print(f"ratio ours (lvis) / Detectron2 (median wall): {med['lvis'] / med['d2']:.3f}, "
              f"(median cpu): {cpu['lvis'] / cpu['d2']:.3f}")
    else:
        print("note: no Detectron2 row (pass --d2-src <detectron2 source checkout>)")


if __name__ == "__main__":
    main()
