"""Loader img/s from a local S3-API server (moto's server mode), with 0 and 20 ms of latency
added to each request by a proxy in front of it, read-ahead on and off, against the same
files on local disk (same run, same loader settings: 2 workers, the demo's images).

Goal (issue #29): from S3 with 20 ms per request and read-ahead on, at least 0.9x the
img/s at 0 ms. The server's CPU time is printed too: a Python S3 server spends a few ms of
CPU per image, which caps every S3 figure on a small machine.

Usage::

    python benchmarks/object_store.py            # 200 images, 2 passes each
    python benchmarks/object_store.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
import tempfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.s3_server import LatencyProxy, S3Server  # noqa: E402

BUCKET = "lit-roidata-bench"


def _roidb(name: str, image_dir: str, annotation_file: str, cache: str):
    from lit_roidata.catalog import Catalog
    from lit_roidata.config import get_cfg
    from lit_roidata.demo.data import DEMO_CATEGORIES
    from lit_roidata.roidb import combined_roidb_for_training

    cat = Catalog(builtins=False)
    cat.register(name, image_dir, annotation_file)
    cfg = get_cfg()
    cfg.merge_from_dict({"MODEL.NUM_CLASSES": len(DEMO_CATEGORIES) + 1})
    return cfg, combined_roidb_for_training([name], [], cfg, cache_dir=cache, catalog=cat)


def _img_per_s(cfg, roidb, passes: int, read_ahead: int, workers: int) -> float:
    from lit_roidata.loader import build_train_loader

    loader = build_train_loader(cfg, roidb, seed=0, num_workers=workers, infinite=True,
                                read_ahead=read_ahead, persistent_workers=True)
    it, warm = iter(loader), 2 * workers
    for _ in range(warm):  # workers started, first reads done
        next(it)
    n = passes * len(roidb) // int(cfg.TRAIN.IMS_PER_BATCH)
    t0 = time.perf_counter()
    for _ in range(n):
        next(it)
    dt = time.perf_counter() - t0
    loader.close()
    return n * int(cfg.TRAIN.IMS_PER_BATCH) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="40 images, 1 pass")
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--latency-ms", type=float, default=20.0)
    args = ap.parse_args()
    n_img, passes = (40, 1) if args.quick else (args.images, 2)
    from lit_roidata import storage
    from lit_roidata.demo.data import ensure_demo_data

    tmp = tempfile.mkdtemp(prefix="object_store_bench_")
    info = ensure_demo_data(tmp, num_images={"demo_train_a": n_img, "demo_train_b": 1,
                                             "demo_val": 1})["demo_train_a"]
    img_dir = Path(info["image_dir"])
    files = {f"imgs/{p.name}": p.read_bytes() for p in img_dir.iterdir()}
    files["train.json"] = Path(info["annotation_file"]).read_bytes()
    server = S3Server().start()
    try:
        server.upload(BUCKET, files)
        cfg, local = _roidb("local", str(img_dir), info["annotation_file"], tmp + "/c")
        rows = [("local disk", "-", _img_per_s(cfg, local, passes, 0, args.workers), None)]
        for ms in (0.0, args.latency_ms):
            proxy = LatencyProxy(server.port, ms / 1000)
            os.environ.update(server.env(proxy.url))
            storage._FS.clear()  # noqa: SLF001 - a client of this proxy
            _, remote = _roidb("s3", f"s3://{BUCKET}/imgs", f"s3://{BUCKET}/train.json",
                               tmp + "/c")
            for ahead in (2, 0):
                cpu = server.cpu_seconds()
                rate = _img_per_s(cfg, remote, passes, ahead, args.workers)
                cpu = server.cpu_seconds() - cpu
                reads = passes * len(remote) + 2 * args.workers * 2
                rows.append((f"S3 +{ms:g} ms", "on" if ahead else "off", rate,
                             1000 * cpu / reads))
            proxy.close()
    finally:
        server.stop()
    print(f"\n{n_img} images (x2 flipped), {args.workers} workers, {passes} pass(es), "
          f"TRAIN.IMS_PER_BATCH={cfg.TRAIN.IMS_PER_BATCH}")
    print(f"{'source':<16}{'read-ahead':>11}{'img/s':>9}{'server CPU ms/img':>19}")
    for name, ahead, rate, cpu in rows:
        print(f"{name:<16}{ahead:>11}{rate:>9.1f}{'-' if cpu is None else f'{cpu:.2f}':>19}")
    rate = {(n, a): r for n, a, r, _ in rows}
    slow, fast = f"S3 +{args.latency_ms:g} ms", "S3 +0 ms"
    ratio = rate[(slow, "on")] / rate[(fast, "on")]
    print(f"\n{slow}, read-ahead on / {fast}, read-ahead on: {ratio:.2f}x (goal >= 0.9x); "
          f"read-ahead off: {rate[(slow, 'off')] / rate[(fast, 'off')]:.2f}x; "
          f"{fast} / local disk: {rate[(fast, 'on')] / rate[('local disk', '-')]:.2f}x")


if __name__ == "__main__":
    main()
