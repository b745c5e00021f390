"""Training loaders side by side, in one run: lit_roidata vs Detectron2 vs torchvision's references.

Generates a COCO-style dataset (``benchmarks/roidb_build.py``'s generator: COCO-like
image sizes, ~7 polygon annotations per image, a few crowd RLEs) and writes its images
as real JPEGs, then measures every pipeline on the same files with the same settings:
batch 2, shortest side drawn from 640-800 (step 32), longest side at most 1333,
horizontal flip, aspect-ratio grouping, ``--workers`` worker processes (default 2).

Rows (images/s over ``--timed`` images after a warm-up, and CPU ms per image summed
over the main process and its workers):

* ``floor``: read + decode + resize (uint8), 1 process and 2 processes;
* ``lit e2e``: ``RoIDataModule(model_type="mask_rcnn_fpn")`` (uint8 pixels, RPN targets
  of 5 FPN levels built in the loader), ``target_format`` compact (default) and
  ``detectron`` (dense blobs from the workers, as before);
* ``lit torchvision``: the same module with ``output_format="torchvision"`` (masks: the
  default compact crops, pasted by ``on_after_batch_transfer`` in the timed process);
* ``lit fast_rcnn``: ``model_type="fast_rcnn_fpn"`` from a proposal file (2000 per image);
* ``detectron2``: ``build_detection_train_loader`` + ``DatasetMapper`` with instance
  masks, from a Detectron2 source checkout (``--d2-src``; skipped with a note without it);
* ``torchvision refs``: ``CocoDetection`` + ``wrap_dataset_for_transforms_v2`` + v2
  transforms (``RandomShortestSize``, flip, ``PILToTensor``, ``ToDtype(float32)``) with
  masks, grouped by orientation;

The e2e comparison with Detectron2 is made at two points, each against the same-run
Detectron2 row:

* (a) the loader's output as the training process receives it: lit's batches from the
  DataLoader, before ``on_after_batch_transfer`` (uint8 pixels, compact targets);
  Detectron2's ``build_detection_train_loader`` output (``DatasetMapper`` does not
  normalise or pad: uint8 CHW images of different sizes);
* (b) the loader + the step that makes a model-ready batch, on the same device (the
  CPU here): lit + ``on_after_batch_transfer`` (means subtracted, padding zeroed,
  compact targets expanded to Detectron's dense blobs); Detectron2 + its model's
  ``preprocess_image``: ``(x - pixel_mean) / pixel_std`` and
  ``ImageList.from_tensors(..., 32)`` (``detectron2.structures`` from the checkout).

then ratios against the peers measured in this run. Also printed:

* bytes per batch out of a worker (``transport.transfer_report``), compact vs
  Detectron targets (item "one copy of every large array"), and the torchvision output
  at 16 images of 800 px with compact vs full masks (their ratio);
* worker private memory (USS, PSS) after 50 and after 500 batches of the e2e loader;
* total PSS of the main process + workers with a COCO train2017-scale annotation file
  (118,287 images), lit_roidata vs Detectron2, after 100 timed images (``--pss-images``;
  0 skips), and each worker's private anonymous memory (private dirty pages of its
  private mappings: heap, anonymous mappings, copy-on-write copies) against Detectron2's
  worker USS. Images of
  that set are not written: both loaders read one of the generated JPEGs, resized to
  the entry's size, through the same hook (a file-name convention), so only the
  per-image metadata differs.

Usage::

    python benchmarks/loader_vs_peers.py --d2-src /path/to/detectron2          # full
    python benchmarks/loader_vs_peers.py --quick --d2-src /path/to/detectron2  # smoke

Each pipeline runs in a fresh subprocess. The machine may be shared: repeat
(``--repeat``) and read the spread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

SCALES = tuple(range(640, 801, 32))
# The (b) rows: loader + the step that makes a model-ready batch on the same device.
E2E_READY = "lit e2e compact + on_after_batch_transfer"
D2_READY = "detectron2 loader + preprocess_image"
MAX_SIZE = 1333


# --------------------------------------------------------------------------- data
def make_dataset(root: Path, n_images: int) -> tuple[str, str]:
    """COCO json (roidb_build's generator) + one real JPEG per image; returns (ann, image dir)."""
    import cv2

    from loader_throughput import _image
    from roidb_build import generate_coco

    root.mkdir(parents=True, exist_ok=True)
    ann, img_dir = root / f"coco_{n_images}.json", root / "images"
    img_dir.mkdir(exist_ok=True)
    if not ann.exists():
        generate_coco(str(ann) + ".tmp", n_images, 7.3, seed=0)
        os.replace(str(ann) + ".tmp", ann)
    with open(ann) as fh:
        images = json.load(fh)["images"]
    r = np.random.default_rng(0)
    for im in images:
        p = img_dir / im["file_name"]
        if not p.exists():
            cv2.imwrite(str(p), _image(r, int(im["width"]), int(im["height"])),
                        [cv2.IMWRITE_JPEG_QUALITY, 90])
    return str(ann), str(img_dir)


def make_big_annotations(root: Path, n_images: int) -> str:
    """A train2017-scale json whose file names say which generated JPEG to read, at what size.

    ``file_name`` becomes ``"<id>__<w>x<h>.jpg"``; :func:`fake_read` decodes pool image
    ``id % pool`` and resizes it to ``w x h``, for both loaders alike.
    """
    from roidb_build import generate_coco

    out = root / f"coco_big_{n_images}.json"
    if out.exists():
        return str(out)
    import orjson

    tmp = str(out) + ".gen"
    generate_coco(tmp, n_images, 7.3, seed=1)
    with open(tmp, "rb") as fh:
        d = orjson.loads(fh.read())
    for im in d["images"]:
        im["file_name"] = f"{im['id']}__{im['width']}x{im['height']}.jpg"
    with open(str(out) + ".tmp", "wb") as fh:
        fh.write(orjson.dumps(d))
    os.replace(str(out) + ".tmp", out)
    os.remove(tmp)
    return str(out)


_POOL: list[str] = []


def fake_read(path: str) -> np.ndarray:
    """BGR image for a big-set file name (see :func:`make_big_annotations`)."""
    import cv2

    name = os.path.basename(path)
    ident, size = name[:-4].split("__")
    w, h = (int(x) for x in size.split("x"))
    im = cv2.imread(_POOL[int(ident) % len(_POOL)], cv2.IMREAD_COLOR)
    return cv2.resize(im, (w, h), interpolation=cv2.INTER_LINEAR)


# --------------------------------------------------------------------------- measuring
def _procs() -> list[Any]:
    import psutil

    me = psutil.Process()
    return [me] + me.children(recursive=True)


def _cpu_seconds() -> float:
    total = 0.0
    for p in _procs():
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except Exception:  # noqa: BLE001 - a worker may just have exited
            pass
    return total


def _memory() -> dict[str, Any]:
    """PSS of main + workers and each worker's USS/PSS (MiB)."""
    out: dict[str, Any] = {"total_pss": 0.0, "workers": []}
    procs = _procs()
    for k, p in enumerate(procs):
        try:
            m = p.memory_full_info()
        except Exception:  # noqa: BLE001
            continue
        out["total_pss"] += m.pss / 2**20
        if k == 0:
            out["main_pss"] = m.pss / 2**20
        else:
            out["workers"].append({"uss": m.uss / 2**20, "pss": m.pss / 2**20,
                                   "anon": _anonymous_mib(p.pid),
                                   "private_anon": _private_anonymous_mib(p.pid),
                                   "file_private": _rollup_mib(p.pid, "Private_Clean:")})
    return out


def _rollup_mib(pid: int, key: str) -> float:
    """One ``/proc/<pid>/smaps_rollup`` field, MiB (``Private_Clean``: file pages, such as
    the memory-mapped roidb columns, that only this process has read)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def _anonymous_mib(pid: int) -> float:
    """Anonymous (heap) memory of a process, MiB: what malloc growth would show in.

    USS also counts clean pages of memory-mapped files only this process has read (the
    roidb columns), which grow as a pass visits more images but are page cache.
    """
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Anonymous:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def _private_anonymous_mib(pid: int) -> float:
    """Private dirty memory not backed by a file a process could share, MiB: the sum of
    ``Private_Dirty`` over its private mappings in ``/proc/<pid>/smaps`` (heap, anonymous
    mappings, stacks, copy-on-write pages of libraries' data), leaving out shared mappings
    (the shared-memory pool, memory-mapped files). Unlike ``Anonymous``, pages still shared
    copy-on-write with the parent are not counted: only what this worker holds alone."""
    total, shared = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as fh:
            for line in fh:
                head = line.split(None, 2)
                if "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
                    shared = "s" in head[1]
                elif head[0] == "Private_Dirty:" and not shared:
                    total += int(head[1])
    except OSError:
        return float("nan")
    return total / 1024.0


def _count(batch: Any) -> int:
    if isinstance(batch, dict) and "_meta" in batch:
        return len(batch["_meta"]["indices"])
    if isinstance(batch, (list, tuple)) and len(batch) == 2 and isinstance(batch[0], (list, tuple)):
        return len(batch[0])  # (images, targets)
    return len(batch)


def time_loader(it: Any, warm: int, timed_images: int, *, mem_at: tuple[int, ...] = (),
                on_batch: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Iterate ``it``: ``warm`` batches, then at least ``timed_images`` images timed."""
    for _ in range(warm):
        next(it)
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    n = batches = 0
    mem: dict[str, Any] = {}
    while n < timed_images or (mem_at and batches < max(mem_at)):
        b = next(it)
        if on_batch is not None:
            on_batch(b)
        n += _count(b)
        batches += 1
        if batches in mem_at:
            mem[str(batches + warm)] = _memory()
        if n >= timed_images and "wall" not in mem:
            mem["wall"] = time.perf_counter() - t0
            mem["cpu"] = _cpu_seconds() - cpu0
            mem["images"] = n
    wall, cpu, images = mem.pop("wall"), mem.pop("cpu"), mem.pop("images")
    return {"images_per_s": images / wall, "cpu_ms_per_image": 1e3 * cpu / images,
            "images": images, "memory": _memory(), "memory_at": mem}


# --------------------------------------------------------------------------- phases
def _lit_module(args: argparse.Namespace, model_type: str, *, check_images: bool = True,
                **kw: Any) -> Any:
    from lit_roidata import RoIDataModule
    from lit_roidata.catalog import DatasetCatalog
    from lit_roidata.roidb import combined_roidb_for_training

    DatasetCatalog.register("bench_train", args.images_dir, args.ann, overwrite=True)
    over = {"MODEL.NUM_CLASSES": 81, "TRAIN.SCALES": list(SCALES), "TRAIN.MAX_SIZE": MAX_SIZE,
            "TRAIN.IMS_PER_BATCH": 2, "TRAIN.ASPECT_GROUPING": True, "TRAIN.USE_FLIPPED": True}
    over.update(kw.pop("overrides", {}))
    from lit_roidata.options import MOVED_OPTIONS

    groups: dict[str, dict[str, Any]] = {"datasets": {"train": ["bench_train"]},
                                         "loader": {"num_workers": args.workers},
                                         "sources": {"cache_dir": args.cache},
                                         "sampling": {"infinite": True}}
    for name, value in kw.items():  # short option names -> their groups
        group, key = MOVED_OPTIONS[name]
        groups.setdefault(group, {})[key] = value
    dm = RoIDataModule(model_type=model_type, overrides=over, **groups)
    if not check_images:  # the big set's images are read through fake_read
        dm.train_roidb = combined_roidb_for_training(
            ["bench_train"], [], dm.cfg, cache_dir=args.cache, catalog=dm.catalog(),
            check_images=False, progress=False)
        return dm
    dm.prepare_data()
    dm.setup("fit")
    return dm


def phase_lit(args: argparse.Namespace) -> dict[str, Any]:
    kw: dict[str, Any] = {}
    model_type = "mask_rcnn_fpn"
    if args.variant == "detectron_targets":
        kw["target_format"] = "detectron"
    elif args.variant == "torchvision":
        kw["output_format"] = "torchvision"
    elif args.variant == "fast_rcnn":
        model_type = "fast_rcnn_fpn"
        kw["train_proposal_files"] = [args.proposals]
        kw["trust_pickle"] = True  # the benchmark wrote the pickle
    dm = _lit_module(args, model_type, **kw)
    loader = dm.train_dataloader()
    # --finish 1: + the step that makes a model-ready batch, in this process (the CPU is
    # the device here): uint8 -> Detectron's float blob (means subtracted, padding
    # zeroed) and the compact targets expanded to Detectron's dense blobs.
    finish = (lambda b: dm.on_after_batch_transfer(b, 0)) if args.finish else None
    res = time_loader(iter(loader), args.warm, args.timed, mem_at=args.mem_at, on_batch=finish)
    if args.finish:
        return res
    if args.variant in ("compact", "detectron_targets"):  # device-side expansion, here CPU
        import torch

        from lit_roidata.minibatch.device import expand_targets

        batch = next(iter(dm.train_dataloader()))
        copies = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in batch.items()}
                  for _ in range(6)]
        t0 = time.perf_counter()
        for c in copies[:3]:
            dm.on_after_batch_transfer(c, 0)
        res["finalize_cpu_ms_per_batch"] = (time.perf_counter() - t0) / 3 * 1e3
        t0 = time.perf_counter()
        for c in copies[3:]:
            expand_targets(c)
        res["expand_cpu_ms_per_batch"] = (time.perf_counter() - t0) / 3 * 1e3
    return res


def phase_floor(args: argparse.Namespace) -> dict[str, Any]:
    import cv2
    import torch

    from lit_roidata.minibatch.image import get_target_scale, im_list_to_blob

    dm = _lit_module(args, "mask_rcnn_fpn")
    roidb = dm.train_roidb
    paths = [roidb[i]["image"] for i in range(len(roidb))]

    class Floor(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(paths)

        def __getitems__(self, idx: list[int]) -> torch.Tensor:
            r = np.random.default_rng(idx[0])
            ims = []
            for i in idx:
                im = cv2.imread(paths[i], cv2.IMREAD_COLOR)
                h, w = im.shape[:2]
                s = get_target_scale(min(h, w), max(h, w), SCALES[r.integers(len(SCALES))],
                                     MAX_SIZE)
                ims.append(cv2.resize(im, None, None, fx=s, fy=s, interpolation=cv2.INTER_LINEAR))
            return torch.from_numpy(im_list_to_blob(ims, fpn_on=True, coarsest_stride=32))

    order = np.random.default_rng(0).permutation(len(paths))
    batches = [order[i:i + 2].tolist() for i in range(0, len(order) - 1, 2)] * 50
    nw = args.workers
    dl = torch.utils.data.DataLoader(Floor(), batch_sampler=batches, collate_fn=lambda b: b,
                                     num_workers=nw, prefetch_factor=2 if nw else None)
    return time_loader(iter(dl), args.warm, args.timed)


def _d2_loader(args: argparse.Namespace, ann: str, img_dir: str) -> Any:
    sys.path.insert(0, args.d2_src)
    import detectron2.data.detection_utils as d2_utils
    from detectron2.config import get_cfg
    from detectron2.data import build_detection_train_loader
    from detectron2.data.datasets import register_coco_instances

    if args.fake_read:  # the big set: same image hook as lit's (see make_big_annotations)
        from PIL import Image

        orig = d2_utils.read_image

        def read_image(file_name: str, format: Any = None) -> np.ndarray:
            if "__" not in os.path.basename(file_name):
                return orig(file_name, format)
            im = fake_read(file_name)
            return d2_utils.convert_PIL_to_numpy(Image.fromarray(im[:, :, ::-1]), format)

        d2_utils.read_image = read_image
    cfg = get_cfg()
    register_coco_instances("bench_train", {}, ann, img_dir)
    cfg.DATASETS.TRAIN = ("bench_train",)
    cfg.INPUT.MIN_SIZE_TRAIN = SCALES
    cfg.INPUT.MIN_SIZE_TRAIN_SAMPLING = "choice"
    cfg.INPUT.MAX_SIZE_TRAIN = MAX_SIZE
    cfg.MODEL.MASK_ON = True
    cfg.SOLVER.IMS_PER_BATCH = 2
    cfg.DATALOADER.NUM_WORKERS = args.workers
    cfg.DATALOADER.ASPECT_RATIO_GROUPING = True
    return build_detection_train_loader(cfg)  # DatasetMapper(cfg, True): instance masks


def _d2_model_ready(args: argparse.Namespace) -> Callable[[Any], Any]:
    """Detectron2's ``GeneralizedRCNN.preprocess_image`` on the CPU, from the checkout.

    ``DatasetMapper`` leaves uint8 CHW images of different sizes; the model then does
    ``(x - pixel_mean) / pixel_std`` per image (uint8 minus float32 -> float32) and
    ``ImageList.from_tensors(images, size_divisibility)`` (zero padding to a multiple of
    the FPN backbone's 32). ``detectron2.structures`` imports without compiled
    extensions, so its own ``ImageList`` is used.
    """
    import torch
    from detectron2.config import get_cfg
    from detectron2.structures import ImageList

    cfg = get_cfg()
    mean = torch.tensor(cfg.MODEL.PIXEL_MEAN).view(-1, 1, 1)
    std = torch.tensor(cfg.MODEL.PIXEL_STD).view(-1, 1, 1)

    def preprocess(batch: list[dict[str, Any]]) -> Any:
        images = [(x["image"] - mean) / std for x in batch]
        return ImageList.from_tensors(images, 32)

    return preprocess


def phase_d2(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    logging.disable(logging.WARNING)
    loader = _d2_loader(args, args.ann, args.images_dir)
    finish = _d2_model_ready(args) if args.finish else None
    return time_loader(iter(loader), args.warm, args.timed, mem_at=args.mem_at, on_batch=finish)


def phase_tv(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torchvision
    from torchvision.datasets import CocoDetection, wrap_dataset_for_transforms_v2
    from torchvision.transforms import v2

    torchvision.disable_beta_transforms_warning() if hasattr(
        torchvision, "disable_beta_transforms_warning") else None
    tf = v2.Compose([v2.RandomShortestSize(min_size=list(SCALES), max_size=MAX_SIZE),
                     v2.RandomHorizontalFlip(0.5), v2.PILToTensor(),
                     v2.ToDtype(torch.float32, scale=True), v2.SanitizeBoundingBoxes()])
    ds = CocoDetection(args.images_dir, args.ann, transforms=tf)
    ds = wrap_dataset_for_transforms_v2(ds, target_keys=("boxes", "labels", "masks", "image_id"))
    coco = ds._dataset.coco  # the references drop images without (non-crowd) annotations
    keep = [k for k, i in enumerate(ds._dataset.ids)
            if any(not a["iscrowd"] for a in coco.imgToAnns[i])]
    imgs = [coco.imgs[ds._dataset.ids[k]] for k in keep]
    horz = np.array([im["width"] >= im["height"] for im in imgs])

    def batches() -> Any:  # aspect grouping, as the references' GroupedBatchSampler
        r = np.random.default_rng(0)
        while True:
            pending: dict[bool, list[int]] = {True: [], False: []}
            for j in r.permutation(len(keep)):
                g = pending[bool(horz[j])]
                g.append(keep[j])
                if len(g) == 2:
                    yield list(g)
                    g.clear()

    class Sampler:
        def __iter__(self) -> Any:
            return batches()

    dl = torch.utils.data.DataLoader(ds, batch_sampler=Sampler(), num_workers=args.workers,
                                     collate_fn=lambda b: tuple(zip(*b)))
    return time_loader(iter(dl), args.warm, args.timed)


def phase_pss_lit(args: argparse.Namespace) -> dict[str, Any]:
    """Total PSS of main + workers, lit e2e loader over the big annotation file."""
    import torch

    from lit_roidata.loader import StatefulRoIDataLoader

    _POOL.extend(sorted(str(p) for p in Path(args.images_dir).glob("*.jpg")))
    args.ann = args.big_ann
    dm = _lit_module(args, "mask_rcnn_fpn", check_images=False)
    sampler = dm.make_sampler()
    ds = dm.make_dataset(sampler=sampler)
    ds.loader = lambda entry: fake_read(entry["image"])
    loader = StatefulRoIDataLoader(ds, sampler, num_workers=args.workers, prefetch_factor=2)
    res = time_loader(iter(loader), args.warm, args.timed)
    res["entries"] = len(dm.train_roidb)
    del torch
    return res


def phase_pss_cache(args: argparse.Namespace) -> dict[str, Any]:
    """Build (or open) the big set's roidb cache, in a process of its own."""
    args.ann = args.big_ann
    t0 = time.perf_counter()
    dm = _lit_module(args, "mask_rcnn_fpn", check_images=False)
    return {"entries": len(dm.train_roidb), "seconds": time.perf_counter() - t0}


def phase_pss_d2(args: argparse.Namespace) -> dict[str, Any]:
    import logging

    logging.disable(logging.WARNING)
    _POOL.extend(sorted(str(p) for p in Path(args.images_dir).glob("*.jpg")))
    args.fake_read = True
    loader = _d2_loader(args, args.big_ann, args.images_dir)
    return time_loader(iter(loader), args.warm, args.timed)


PHASES = {"lit": phase_lit, "floor": phase_floor, "d2": phase_d2, "tv": phase_tv,
          "pss_lit": phase_pss_lit, "pss_d2": phase_pss_d2, "pss_cache": phase_pss_cache}


def run_phase(args: argparse.Namespace, phase: str, **kw: Any) -> dict[str, Any] | None:
    cmd = [sys.executable, __file__, "--phase", phase, "--ann", args.ann,
           "--images-dir", args.images_dir, "--cache", args.cache, "--warm", str(args.warm),
           "--timed", str(kw.pop("timed", args.timed)),
           "--workers", str(kw.pop("workers", args.workers))]
    for k, v in kw.items():
        if isinstance(v, (tuple, list)):
            v = ",".join(str(x) for x in v)
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    if args.d2_src:
        cmd += ["--d2-src", args.d2_src]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        print(f"  !! {phase} {kw} failed:\n{res.stderr[-3000:]}", flush=True)
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- bytes copied
def bytes_copied(args: argparse.Namespace) -> list[tuple[str, dict[str, int]]]:
    """``transfer_report`` of e2e batches built as in a worker (target_format both ways),
    and of the torchvision output at 16 images of 800 px (mask_format both ways)."""
    import lit_roidata.dataset as dataset_mod
    from lit_roidata.minibatch.transport import transfer_report

    dataset_mod._in_worker = lambda: True  # allocate as a worker does (this process only)
    rows = []
    tv16 = {"output_format": "torchvision",
            "overrides": {"TRAIN.IMS_PER_BATCH": 16, "TRAIN.SCALES": [800]}}
    for name, kw in (("e2e compact targets", {}),
                     ("e2e detectron targets", {"target_format": "detectron"}),
                     ("tv x16 compact masks", dict(tv16, mask_format="compact")),
                     ("tv x16 full masks", dict(tv16, mask_format="detectron"))):
        dm = _lit_module(args, "mask_rcnn_fpn", **kw)
        sampler = dm.make_sampler()
        ds = dm.make_dataset(sampler=sampler)
        reps = [transfer_report(ds.__getitems__(b)) for b, _ in zip(sampler, range(6))]
        for r in reps:
            r["total_bytes"] = r["copied_bytes"] + r["shared_bytes"]
        rows.append((name, {k: int(np.mean([r[k] for r in reps])) for k in reps[0]}))
    return rows


# --------------------------------------------------------------------------- main
def _fmt(res: dict[str, Any] | None) -> str:
    if res is None:
        return "failed"
    return f"{res['images_per_s']:8.1f} img/s  {res['cpu_ms_per_image']:6.1f} CPU ms/img"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--d2-src", default=None, help="Detectron2 source checkout (not installed)")
    ap.add_argument("--images", type=int, default=1000, help="JPEGs to generate")
    ap.add_argument("--timed", type=int, default=300, help="timed images per pipeline")
    ap.add_argument("--warm", type=int, default=5, help="warm-up batches")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="measure every pipeline N times")
    ap.add_argument("--pss-images", type=int, default=118287,
                    help="images of the big annotation file for the PSS rows (0: skip)")
    ap.add_argument("--mem-batches", default="50,500", help="worker memory after these batches")
    ap.add_argument("--root", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                   "lit_roidata_peers"))
    ap.add_argument("--only", default="", help="comma-separated subset of rows (debugging)")
    # internal (phases)
    ap.add_argument("--phase", default=None)
    ap.add_argument("--variant", default="compact")
    ap.add_argument("--ann", default="")
    ap.add_argument("--big-ann", default="")
    ap.add_argument("--images-dir", default="")
    ap.add_argument("--proposals", default="")
    ap.add_argument("--cache", default="")
    ap.add_argument("--mem-at", default="")
    ap.add_argument("--fake-read", action="store_true")
    ap.add_argument("--finish", type=int, default=0)
    args = ap.parse_args()
    args.mem_at = tuple(int(x) for x in args.mem_at.split(",") if x)
    if args.d2_src and not os.path.isdir(os.path.join(args.d2_src, "detectron2")):
        ap.error(f"--d2-src {args.d2_src}: no detectron2/ package inside")
    if args.phase:
        import cv2

        cv2.setNumThreads(1)
        import torch

        torch.set_num_threads(1)
        print(json.dumps(PHASES[args.phase](args)))
        return
    if args.quick:
        args.images, args.timed = min(args.images, 60), min(args.timed, 24)
        args.mem_batches = "5,30" if args.mem_batches == "50,500" else args.mem_batches
        args.pss_images = min(args.pss_images, 3000)
    root = Path(args.root)
    t0 = time.perf_counter()
    args.ann, args.images_dir = make_dataset(root / f"n{args.images}", args.images)
    args.cache = str(root / f"n{args.images}" / "cache")
    from roidb_build import generate_proposals

    props = str(root / f"n{args.images}" / "proposals.pkl")
    if not os.path.exists(props):
        generate_proposals(args.ann, props, 2000, "pkl")
    print(f"data: {args.images} JPEGs + COCO json ({time.perf_counter() - t0:.0f} s); "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; batch 2, scales "
          f"{SCALES[0]}-{SCALES[-1]}, max {MAX_SIZE}, flip, aspect grouping, "
          f"{args.workers} workers, {args.timed} timed images", flush=True)
    only = set(filter(None, args.only.split(",")))
    rows: dict[str, list[dict[str, Any]]] = {}
    plan: list[tuple[str, str, dict[str, Any]]] = [
        ("floor, 1 process", "floor", {"workers": 0}),
        ("floor, 2 processes", "floor", {"workers": 2}),
        ("lit e2e mask_rcnn_fpn (compact targets)", "lit", {"variant": "compact"}),
        (E2E_READY, "lit", {"variant": "compact", "finish": 1}),
        ("lit e2e mask_rcnn_fpn (detectron targets)", "lit", {"variant": "detectron_targets"}),
        ("lit torchvision output (masks)", "lit", {"variant": "torchvision", "finish": 1}),
        ("lit fast_rcnn_fpn from proposals", "lit", {"variant": "fast_rcnn", "proposals": props}),
        ("torchvision references", "tv", {}),
    ]
    if args.d2_src:
        plan.append(("detectron2 build_detection_train_loader", "d2", {}))
        plan.append((D2_READY, "d2", {"finish": 1}))
    else:
        print("note: no --d2-src given: the Detectron2 rows are skipped", flush=True)
    for rep in range(args.repeat):
        for name, phase, kw in plan:
            if only and phase not in only:
                continue
            res = run_phase(args, phase, **kw)
            rows.setdefault(name, []).append(res)
            print(f"  [{rep + 1}/{args.repeat}] {name:45s} {_fmt(res)}", flush=True)

    def best(name: str) -> dict[str, Any] | None:
        ok = [r for r in rows.get(name, []) if r]
        return max(ok, key=lambda r: r["images_per_s"]) if ok else None

    def spread(name: str) -> str:
        ok = [r["images_per_s"] for r in rows.get(name, []) if r]
        return f"{min(ok):.1f}-{max(ok):.1f}" if len(ok) > 1 else ""

    print("\n=== throughput (best of repeats; spread in img/s) ===")
    for name in rows:
        print(f"{name:48s} {_fmt(best(name))}  {spread(name)}")
    d2 = best("detectron2 build_detection_train_loader")
    tv = best("torchvision references")
    floor2 = best("floor, 2 processes")
    e2e = best("lit e2e mask_rcnn_fpn (compact targets)")
    dense = best("lit e2e mask_rcnn_fpn (detectron targets)")
    tvo = best("lit torchvision output (masks)")
    fast = best("lit fast_rcnn_fpn from proposals")

    def ratio(a: Any, b: Any, what: str, a_name: str = "", b_name: str = "") -> None:
        if a and b:
            paired = [f"{x['images_per_s'] / y['images_per_s']:.2f}"
                      for x, y in zip(rows.get(a_name, []), rows.get(b_name, [])) if x and y]
            print(f"  {what}: {a['images_per_s'] / b['images_per_s']:.2f}x images/s (best of "
                  f"each; per round {', '.join(paired)}), "
                  f"{b['cpu_ms_per_image'] / a['cpu_ms_per_image']:.2f}x less CPU per image")
    print("=== ratios (same run; under load, CPU per image is the steadier figure) ===")
    names = {"e2e": "lit e2e mask_rcnn_fpn (compact targets)",
             "dense": "lit e2e mask_rcnn_fpn (detectron targets)",
             "d2": "detectron2 build_detection_train_loader", "tv": "torchvision references",
             "tvo": "lit torchvision output (masks)", "fast": "lit fast_rcnn_fpn from proposals",
             "floor2": "floor, 2 processes"}
    ratio(e2e, d2, "(a) loader output: lit e2e (compact) / Detectron2 (target >= 2x)",
          names["e2e"], names["d2"])
    ratio(best(E2E_READY), best(D2_READY), "(b) model-ready batch on the same device (CPU): "
          "lit e2e + on_after_batch_transfer / Detectron2 + normalise + ImageList pad",
          E2E_READY, D2_READY)
    ratio(dense, d2, "lit e2e (detectron targets) / Detectron2", names["dense"], names["d2"])
    ratio(e2e, dense, "lit e2e compact / detectron targets", names["e2e"], names["dense"])
    ratio(tvo, tv, "lit torchvision output / torchvision references (target >= 2x)",
          names["tvo"], names["tv"])
    ratio(fast, floor2, "lit fast_rcnn_fpn from proposals / floor 2 processes (target >= 0.8)",
          names["fast"], names["floor2"])
    ratio(e2e, floor2, "lit e2e (compact) / floor 2 processes", names["e2e"], names["floor2"])
    if e2e and "finalize_cpu_ms_per_batch" in e2e:
        print(f"  on_after_batch_transfer on the CPU (normalise + expand targets): "
              f"{e2e['finalize_cpu_ms_per_batch']:.1f} ms/batch (compact), "
              f"{(dense or {}).get('finalize_cpu_ms_per_batch', float('nan')):.1f} (detectron); "
              f"the target expansion alone {e2e['expand_cpu_ms_per_batch']:.1f} ms/batch "
              "(benchmarks/gpu_check.py times it on a GPU)")

    if not only or "bytes" in only:
        print("=== bytes out of a worker per batch (transfer_report) ===")
        rows = dict(bytes_copied(args))
        for name, rep in rows.items():
            print(f"  {name:24s} {rep['total_bytes'] / 2**20:7.2f} MiB in all; copied "
                  f"{rep['copied_bytes'] / 2**20:7.2f} MiB "
                  f"(packed {rep['packed_bytes'] / 2**20:.2f}, moved by the pickler "
                  f"{rep['moved_bytes'] / 2**20:.2f}); sent by handle, no copy "
                  f"{rep['shared_bytes'] / 2**20:.2f} MiB; {rep['tensors']} tensors")
        compact, full = (rows[f"tv x16 {k} masks"]["total_bytes"] for k in ("compact", "full"))
        print(f"  torchvision output, 16 images: compact / full masks {compact / full:.3f}x "
              "bytes per batch (target <= 0.45)")

    if not only or "mem" in only:
        mb = tuple(int(x) for x in args.mem_batches.split(","))
        print(f"=== worker memory after {mb[0]} and {mb[1]} batches (lit e2e, compact) ===")
        res = run_phase(args, "lit", variant="compact", timed=2, mem_at=mb)
        if res:
            at = res["memory_at"]
            a, b = at[str(mb[0] + args.warm)], at[str(mb[1] + args.warm)]
            for k, (wa, wb) in enumerate(zip(a["workers"], b["workers"])):
                print(f"  worker {k}: USS {wa['uss']:.0f} -> {wb['uss']:.0f} MiB "
                      f"({wb['uss'] / wa['uss'] - 1:+.1%}), PSS {wa['pss']:.0f} -> "
                      f"{wb['pss']:.0f} MiB ({wb['pss'] / wa['pss'] - 1:+.1%}), anonymous "
                      f"{wa.get('anon', 0):.0f} -> {wb.get('anon', 0):.0f} MiB "
                      f"({wb.get('anon', 0) / max(wa.get('anon', 0), 1e-9) - 1:+.1%}), "
                      f"private clean (file pages read) {wa.get('file_private', 0):.0f} -> "
                      f"{wb.get('file_private', 0):.0f} MiB")

    if args.pss_images and (not only or "pss" in only):
        t0 = time.perf_counter()
        big = make_big_annotations(root, args.pss_images)
        print(f"=== total PSS, main + {args.workers} workers, {args.pss_images} images "
              f"(json {time.perf_counter() - t0:.0f} s) ===", flush=True)
        # The cache first, in a process of its own: training opens an existing cache, and a
        # cold build in the measured process would leave its heap and the written columns'
        # mappings behind in the accounting (one run: 965 vs 745 MiB total).
        built = run_phase(args, "pss_cache", big_ann=big, timed=1)
        if built:
            print(f"  roidb cache: {built['entries']} entries ({built['seconds']:.1f} s)",
                  flush=True)
        lit = run_phase(args, "pss_lit", big_ann=big, timed=100)
        print(f"  lit_roidata e2e: {lit['memory']['total_pss']:.0f} MiB" if lit else "  lit failed",
              flush=True)
        d2m = run_phase(args, "pss_d2", big_ann=big, timed=100) if args.d2_src else None
        if d2m:
            print(f"  detectron2:      {d2m['memory']['total_pss']:.0f} MiB")
        if lit and d2m:
            print(f"  lit / detectron2 total PSS: "
                  f"{lit['memory']['total_pss'] / d2m['memory']['total_pss']:.2f}x "
                  "(target <= 0.5)")
        if lit:
            lw, dw = lit["memory"]["workers"], (d2m or {"memory": {"workers": []}})["memory"]["workers"]
            print("  per worker after 100 timed images: lit private anonymous (private dirty, "
                  "not file-backed) / USS; detectron2 USS / private anonymous")
            for k, w in enumerate(lw):
                d = dw[k] if k < len(dw) else None
                ref = (f"; detectron2 worker {k}: USS {d['uss']:.0f} MiB / private anonymous "
                       f"{d['private_anon']:.0f} MiB -> lit anonymous / d2 USS "
                       f"{w['private_anon'] / d['uss']:.2f}x (target <= 1)") if d else ""
                print(f"  lit worker {k}: private anonymous {w['private_anon']:.0f} MiB / USS "
                      f"{w['uss']:.0f} MiB (file pages read by it alone "
                      f"{w['file_private']:.0f} MiB){ref}")

if __name__ == "__main__":
    main()
