"""Image decoders side by side, in one run: which one reads what Detectron's ``cv2.imread`` reads?

Detectron reads every training image with ``cv2.imread(path)`` (``IMREAD_COLOR``: BGR,
EXIF orientation applied, grayscale / CMYK / palette / alpha converted to three channels,
16-bit samples reduced to their high byte). The candidates decode the same bytes in
memory, as a loader worker does:

* ``cv2.imdecode``: OpenCV's decoder on a buffer (``IMREAD_COLOR``, BGR);
* ``torchvision.io.decode_image``: ``mode=RGB, apply_exif_orientation=True`` (deprecated
  since torchvision 0.29);
* ``torchcodec.decoders.decode_image``: ``mode="RGB"`` (TorchCodec; it has no EXIF
  option and applies the orientation itself).

Two sets of files:

* bench JPEGs: COCO-like sizes and texture (``loader_throughput``'s generator), quality 90,
  as ``loader_vs_peers.py`` writes them;
* edge cases: EXIF orientation 6 and 3, grayscale JPEG/PNG, CMYK JPEG, palette PNG (with
  and without transparency), RGBA PNG, 16-bit gray and RGB PNG, progressive and 4:4:4 JPEG.

Printed: for each candidate, how many files decode bit-identical to ``cv2.imread`` (after
putting its channels in BGR order), which edge cases differ, and the per-image decode time
on the bench JPEGs (bytes in memory -> ``(H, W, 3)`` uint8 in the decoder's own channel
order; one thread, as in a loader worker) with the ratio against the others, measured in
this run. The machine may be shared: ``--repeat`` rounds, best and spread printed.

Usage::

    python benchmarks/decode.py [--images 200] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import cv2
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

COCO_SIZES = [(640, 480), (640, 427), (500, 375), (480, 640), (640, 426), (427, 640),
              (500, 333), (612, 612), (640, 360), (375, 500)]


def make_files(root: Path, n: int) -> tuple[list[Path], dict[str, Path]]:
    """``n`` bench JPEGs and the edge-case files, under ``root``."""
    from PIL import Image

    from loader_throughput import _image

    root.mkdir(parents=True, exist_ok=True)
    r = np.random.default_rng(0)
    bench = []
    for i in range(n):
        w, h = COCO_SIZES[i % len(COCO_SIZES)]
        p = root / f"bench_{i}.jpg"
        if not p.exists():
            cv2.imwrite(str(p), _image(r, w, h), [cv2.IMWRITE_JPEG_QUALITY, 90])
        bench.append(p)
    bgr = _image(np.random.default_rng(1), 96, 64)
    rgb = np.ascontiguousarray(bgr[:, :, ::-1])
    edge: dict[str, Path] = {}

    def put(name: str, save: Callable[[Path], Any]) -> None:
        p = root / name
        save(p)
        edge[name] = p

    for o in (6, 3):
        def exif_jpeg(p: Path, o: int = o) -> None:
            im = Image.fromarray(rgb)
            ex = im.getexif()
            ex[0x0112] = o
            im.save(p, exif=ex, quality=95)
        put(f"exif_orientation_{o}.jpg", exif_jpeg)
    put("gray.jpg", lambda p: Image.fromarray(rgb[:, :, 0]).save(p, quality=95))
    put("gray.png", lambda p: Image.fromarray(rgb[:, :, 0]).save(p))
    put("cmyk.jpg", lambda p: Image.fromarray(rgb).convert("CMYK").save(p, quality=95))
    put("palette.png", lambda p: Image.fromarray(rgb).convert("P").save(p))
    put("palette_transparent.png",
        lambda p: Image.fromarray(rgb).convert("P").save(p, transparency=0))
    put("rgba.png", lambda p: Image.fromarray(np.dstack([rgb, np.full(rgb.shape[:2], 17,
                                                                       np.uint8)])).save(p))
    put("gray16.png", lambda p: cv2.imwrite(str(p), rgb[:, :, 0].astype(np.uint16) * 257 + 3))
    put("rgb16.png", lambda p: cv2.imwrite(str(p), bgr.astype(np.uint16) * 257 + 5))
    put("progressive.jpg", lambda p: Image.fromarray(rgb).save(p, quality=90, progressive=True))
    put("subsampling444.jpg", lambda p: Image.fromarray(rgb).save(p, quality=90, subsampling=0))
    put("rgb.png", lambda p: cv2.imwrite(str(p), bgr))
    return bench, edge


def candidates() -> dict[str, tuple[Callable[[bytes], np.ndarray], str]]:
    """name -> (bytes -> (H, W, 3) uint8 in the decoder's own order, that order)."""
    import torch

    out: dict[str, tuple[Callable[[bytes], np.ndarray], str]] = {}

    def cv2_imdecode(data: bytes) -> np.ndarray:
        return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)

    out["cv2.imdecode"] = (cv2_imdecode, "bgr")
    try:
        from torchvision.io import ImageReadMode, decode_image

        def tv(data: bytes) -> np.ndarray:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8),
                                 mode=ImageReadMode.RGB, apply_exif_orientation=True)
            if t.dtype != torch.uint8:
                t = (t.to(torch.int32) >> 8).to(torch.uint8)
            return np.ascontiguousarray(t.permute(1, 2, 0).numpy())

        out["torchvision.io.decode_image"] = (tv, "rgb")
    except ImportError:
        pass
    try:
        from torchcodec.decoders import decode_image as tc_decode

        def tc(data: bytes) -> np.ndarray:
            t = tc_decode(data, mode="RGB")
            if t.dim() == 4:  # animated formats: the first frame
                t = t[0]
            return np.ascontiguousarray(t.permute(1, 2, 0).numpy())

        out["torchcodec decode_image"] = (tc, "rgb")
    except ImportError:
        print("note: torchcodec is not installed: its row is skipped")
    return out


def as_bgr(im: np.ndarray, order: str) -> np.ndarray:
    return im[:, :, ::-1] if order == "rgb" else im


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=200, help="bench JPEGs")
    ap.add_argument("--repeat", type=int, default=3, help="timing rounds")
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "lit_roidata_decode"))
    args = ap.parse_args()
    cv2.setNumThreads(1)
    import torch

    torch.set_num_threads(1)
    bench, edge = make_files(Path(args.root), args.images)
    cands = candidates()
    print(f"{len(bench)} bench JPEGs + {len(edge)} edge cases; cv2 {cv2.__version__}, "
          f"torch {torch.__version__}; 1 thread; load average {os.getloadavg()[0]:.1f}")

    print("=== bit-identical to cv2.imread(path) (BGR, IMREAD_COLOR) ===")
    for name, (fn, order) in cands.items():
        same, diff = 0, []
        for p in bench:
            got = as_bgr(fn(p.read_bytes()), order)
            ref = cv2.imread(str(p))
            same += got.shape == ref.shape and bool(np.array_equal(got, ref))
        for ename, p in edge.items():
            ref = cv2.imread(str(p))
            try:
                got = as_bgr(fn(p.read_bytes()), order)
            except Exception as exc:  # noqa: BLE001 - a decoder that refuses a file
                diff.append(f"{ename} (error: {str(exc).splitlines()[0][:60]})")
                continue
            if got.shape != ref.shape:
                diff.append(f"{ename} (shape {got.shape} vs {ref.shape})")
            elif not np.array_equal(got, ref):
                d = np.abs(got.astype(int) - ref)
                diff.append(f"{ename} (max |diff| {d.max()}, {np.mean(d > 0):.0%} of values)")
        n_edge = len(edge) - len(diff)
        print(f"  {name:30s} bench {same}/{len(bench)}, edge cases {n_edge}/{len(edge)}"
              + (f"; differ: {', '.join(diff)}" if diff else ""))

    datas = [p.read_bytes() for p in bench]
    times: dict[str, list[float]] = {name: [] for name in cands}
    for _ in range(args.repeat):
        for name, (fn, _order) in cands.items():
            t0 = time.perf_counter()
            for d in datas:
                fn(d)
            times[name].append((time.perf_counter() - t0) / len(datas) * 1e3)
    print(f"=== decode time per bench JPEG (ms; best of {args.repeat}, spread) ===")
    best = {name: min(t) for name, t in times.items()}
    for name, t in times.items():
        print(f"  {name:30s} {best[name]:6.2f} ms  ({min(t):.2f}-{max(t):.2f})")
    if "cv2.imdecode" in best:
        for name in best:
            if name != "cv2.imdecode":
                per_round = ", ".join(f"{b / a:.2f}" for a, b in
                                      zip(times["cv2.imdecode"], times[name]))
                print(f"  {name} / cv2.imdecode time: {best[name] / best['cv2.imdecode']:.2f}x"
                      f" (per round {per_round})")


if __name__ == "__main__":
    main()
