"""Reusable shared-memory slots (``loader.shm_pool``) against a new segment per array.

Runs lit_roidata's e2e Mask R-CNN FPN loader (and, with ``--variants``, its torchvision
output) twice per repeat on the same images, ``shm_pool`` on and off, alternating, and
prints images/s, CPU ms per image (main process + workers, and each apart) and the
ratio pool/no-pool
of each repeat, measured in the same run. With the pool on it also prints the pool's
counters: blocks, arrays placed in a slot vs given a new segment, slot reuse.

Usage (the images and COCO json of ``benchmarks/loader_vs_peers.py``)::

    python benchmarks/shm_pool.py --images-dir DIR --ann coco.json --cache /tmp/cache

The machine may be shared: read the spread of the repeats.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loader_vs_peers as L  # noqa: E402


def run_once(args: argparse.Namespace, variant: str, pool: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {"output_format": "torchvision"} if variant == "torchvision" else {}
    dm = L._lit_module(args, "mask_rcnn_fpn", **kw)
    dm.loader = dataclasses.replace(dm.loader, shm_pool=pool)
    loader = dm.train_dataloader()
    it = iter(loader)
    for _ in range(args.warm):
        next(it)
    procs = L._procs()
    main0, all0, t0 = time.process_time(), L._cpu_seconds(), time.perf_counter()
    n = 0
    while n < args.timed:
        n += L._count(next(it))
    wall = time.perf_counter() - t0
    main_cpu, all_cpu = time.process_time() - main0, L._cpu_seconds() - all0
    stats = loader.shm_pool.stats() if loader.shm_pool is not None else None
    del it
    assert len(procs) == args.workers + 1, "the workers changed during the run"
    return {"images_per_s": n / wall, "cpu_ms_per_image": 1e3 * all_cpu / n,
            "main_cpu_ms_per_image": 1e3 * main_cpu / n,
            "worker_cpu_ms_per_image": 1e3 * (all_cpu - main_cpu) / n, "pool": stats}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images-dir", required=True)
    ap.add_argument("--ann", required=True)
    ap.add_argument("--cache", required=True, help="roidb cache directory (written)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--warm", type=int, default=10, help="batches before timing")
    ap.add_argument("--timed", type=int, default=200, help="images timed per run")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--variants", default="e2e", help="comma list: e2e, torchvision")
    args = ap.parse_args()
    import cv2
    import torch

    cv2.setNumThreads(1)
    torch.set_num_threads(1)  # as loader_vs_peers.py's phases
    report: dict[str, Any] = {}
    for variant in args.variants.split(","):
        rows: dict[str, list] = {"off": [], "on": []}
        for _ in range(args.repeat):
            for pool in (False, True):
                rows["on" if pool else "off"].append(run_once(args, variant, pool))
        ratios = [on["cpu_ms_per_image"] / off["cpu_ms_per_image"]
                  for on, off in zip(rows["on"], rows["off"])]
        speed = [on["images_per_s"] / off["images_per_s"]
                 for on, off in zip(rows["on"], rows["off"])]
        report[variant] = {
            "cpu_ms_per_image_off": [round(r["cpu_ms_per_image"], 2) for r in rows["off"]],
            "cpu_ms_per_image_on": [round(r["cpu_ms_per_image"], 2) for r in rows["on"]],
            "main_cpu_ms_per_image_off": [round(r["main_cpu_ms_per_image"], 2)
                                          for r in rows["off"]],
            "main_cpu_ms_per_image_on": [round(r["main_cpu_ms_per_image"], 2)
                                         for r in rows["on"]],
            "worker_cpu_ms_per_image_off": [round(r["worker_cpu_ms_per_image"], 2)
                                            for r in rows["off"]],
            "worker_cpu_ms_per_image_on": [round(r["worker_cpu_ms_per_image"], 2)
                                           for r in rows["on"]],
            "cpu_ratio_on_over_off": [round(x, 3) for x in ratios],
            "cpu_ratio_median": round(statistics.median(ratios), 3),
            "images_per_s_off": [round(r["images_per_s"], 1) for r in rows["off"]],
            "images_per_s_on": [round(r["images_per_s"], 1) for r in rows["on"]],
            "speed_ratio_median": round(statistics.median(speed), 3),
            "pool_stats_last": rows["on"][-1]["pool"],
        }
        print(f"=== {variant}: shm_pool on vs off ({args.workers} workers) ===")
        print(json.dumps(report[variant], indent=1))


if __name__ == "__main__":
    main()
