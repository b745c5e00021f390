"""Benchmark: the cold roidb build at Objects365 scale, in bounded memory, vs Detectron2.

Generates (in bounded memory, chunk by chunk) a COCO-style box-only annotation file in
the shape of Objects365 v2 train: 1,742,292 images, ~25.4M annotations, 365 categories,
~3.2 GiB of minified JSON, with Objects365's image and annotation fields (``license``,
``url``, ``isfake``, ``isreflected`` the roidb does not read). Then, each in a fresh
process:

* **ours, cold**: ``combined_roidb_for_training`` with an empty cache (decode in windows,
  clean, write). Peak memory is the *whole process tree's*: the benchmark process and
  the forked builder are sampled together every 50 ms (sum of RSS over the tree, via
  ``psutil``), and the maximum of the sums is reported; ``ru_maxrss`` of the children is
  printed next to it as a cross-check (it is the largest single process, not a sum).
* **ours, warm**: the same call with the cache present.
* **loader PSS** (``--loader-pss``): total PSS of the main process + 2 workers of the e2e
  loader (``benchmarks/loader_vs_peers.py``'s ``pss_lit`` phase) over this roidb, after
  100 timed images.
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
