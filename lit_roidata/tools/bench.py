"""``lit-roidata bench``: the train loader's images/s and per-batch latency on your data.

Builds the data module of the config (same roidb, sampler, workers and blob family as
training), iterates the train loader as the training loop would, and reports images/s
and the time the loop waits per batch (p50/p90/p99/max) after a warm-up. For scale it
also measures, in the same run, the single-process floor of decoding and resizing the
same number of images (no targets, no workers) and prints the ratio.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import numpy as np
from rich.console import Console

from lit_roidata.tools.common import data_module_from, tool_parser

__all__ = ["main", "bench_loader", "decode_resize_floor"]


def bench_loader(dm: Any, num_batches: int = 50, warmup: int = 5) -> dict[str, float]:
    """Time ``num_batches`` batches of ``dm.train_dataloader()`` after ``warmup``.

    Returns:
        ``images_per_s``, ``batches``, ``images``, and latency percentiles in ms
        (``p50_ms``, ``p90_ms``, ``p99_ms``, ``max_ms``).
    """
    dm.prepare_data()
    dm.setup("fit")
    loader = dm.train_dataloader()
    it, lat, images = iter(loader), [], 0
    for k in range(int(warmup) + int(num_batches)):
        t = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:  # epoch mode: the next pass
            it = iter(loader)
            batch = next(it)
        dt = time.perf_counter() - t
        if k >= warmup:
            lat.append(dt)
            # Detectron blobs, or torchvision's (images, targets)
            images += int(batch["data"].shape[0]) if isinstance(batch, dict) else len(batch[0])
    del it
    lat_ms = np.asarray(lat) * 1e3
    return {"images_per_s": images / max(float(np.sum(lat)), 1e-9), "batches": len(lat),
            "images": images, **{f"p{q}_ms": float(np.percentile(lat_ms, q)) for q in (50, 90, 99)},
            "max_ms": float(lat_ms.max())}


def decode_resize_floor(dm: Any, num_images: int) -> float:
    """Images/s of decode + Detectron scaling alone, one process (the baseline)."""
    from lit_roidata.minibatch.decode import load_image
    from lit_roidata.minibatch.image import scale_image

    roidb, cfg = dm.train_roidb, dm.cfg
    n, t = min(int(num_images), len(roidb)), time.perf_counter()
    for i in range(n):
        scale_image(load_image(roidb[i]), cfg.TRAIN.SCALES[i % len(cfg.TRAIN.SCALES)],
                    cfg.TRAIN.MAX_SIZE, pixel_format=dm.output.pixel_format,
                    pixel_means=cfg.PIXEL_MEANS)
    return n / max(time.perf_counter() - t, 1e-9)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = tool_parser("bench", __doc__.split("\n\n")[0])
    parser.add_argument("--num_batches", type=int, default=50, help="batches to time")
    parser.add_argument("--warmup", type=int, default=5, help="batches before timing")
    parser.add_argument("--floor", type=bool, default=True,
                        help="also measure the decode+resize floor (baseline)")
    cfg, dm = data_module_from(parser, argv or ())
    res = bench_loader(dm, cfg.num_batches, cfg.warmup)
    from rich.table import Column, Table

    table = Table(*(Column(c, justify="right") for c in ("images/s", "p50 ms", "p90 ms",
                                                         "p99 ms", "max ms", "batches")),
                  title=f"train loader ({dm.loader.num_workers} workers, "
                        f"{dm.cfg.TRAIN.IMS_PER_BATCH} images/batch, {dm.output.pixel_format})")
    table.add_row(f"{res['images_per_s']:.1f}", f"{res['p50_ms']:.1f}", f"{res['p90_ms']:.1f}",
                  f"{res['p99_ms']:.1f}", f"{res['max_ms']:.1f}", str(res["batches"]))
    con = Console()
    con.print(table)
    if cfg.floor:
        floor = decode_resize_floor(dm, res["images"])
        con.print(f"decode+resize floor (1 process, no targets): {floor:.1f} images/s; "
                  f"loader / floor = {res['images_per_s'] / floor:.2f}x")
    return 0
