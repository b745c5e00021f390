"""Synthetic COCO-style demo data: images, annotation JSON and Detectron proposal files.

Two training sets and a validation set that exercise every part of the pipeline (columnar
proposal files, crowd RLE, polygons, person keypoints, portrait and empty images; docs/demo.md).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np
from filelock import FileLock, Timeout

from lit_roidata.boxes import bbox_overlaps
from lit_roidata.demo.shapes import DEMO_CATEGORIES, draw_image, write_jpeg
from lit_roidata.osutil import atomic_write

__all__ = ["DEMO_CATEGORIES", "DEMO_NUM_IMAGES", "DEMO_TRAIN_DATASETS", "DEMO_VAL_DATASETS",
           "DemoDatasets", "ensure_demo_data", "is_demo_data", "register_demo_datasets"]

log = logging.getLogger(__name__)

DEMO_TRAIN_DATASETS: tuple[str, ...] = ("demo_train_a", "demo_train_b")
DEMO_VAL_DATASETS: tuple[str, ...] = ("demo_val",)
#: Images per dataset by default.
DEMO_NUM_IMAGES: dict[str, int] = {"demo_train_a": 200, "demo_train_b": 100, "demo_val": 60}
_ID_BASE = {"demo_train_a": 100000, "demo_train_b": 200000, "demo_val": 300000}
_VERSION = 3  # bump when the generated content changes
_MANIFEST = "demo_manifest.json"
_SIZE_RANGE = (160, 320)
_LOCK_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class DemoDatasets:
    """What :func:`register_demo_datasets` registered: names and proposal files.

    The train/val catalog names, their proposal files (aligned) and the catalog used."""

    train_datasets: tuple[str, ...]
    train_proposal_files: tuple[str, ...]
    val_datasets: tuple[str, ...]
    val_proposal_files: tuple[str, ...]
    catalog: Any = None


def _proposals(rng: np.random.Generator, gt: np.ndarray, W: int, H: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Jittered gt boxes (high scores) plus random boxes, sorted by descending score."""
    total = int(rng.integers(100, 301))
    g = np.repeat(gt.astype(np.float64), 24, axis=0)  # 24 jittered copies per gt box
    w, h = g[:, 2] - g[:, 0] + 1, g[:, 3] - g[:, 1] + 1
    sigma = rng.choice([0.03, 0.08, 0.15, 0.3], size=len(g))
    cx = g[:, 0] + 0.5 * w + rng.normal(0, 1, len(g)) * sigma * w
    cy = g[:, 1] + 0.5 * h + rng.normal(0, 1, len(g)) * sigma * h
    w = w * np.exp(rng.normal(0, 1, len(g)) * sigma)
    h = h * np.exp(rng.normal(0, 1, len(g)) * sigma)
    jit = np.stack([cx - 0.5 * w, cy - 0.5 * h, cx + 0.5 * w - 1, cy + 0.5 * h - 1], 1)
    n_rand = max(20, total - len(jit))
    x1, y1 = rng.uniform(0, W - 2, n_rand), rng.uniform(0, H - 2, n_rand)
    rw = np.exp(rng.uniform(np.log(4), np.log(W), n_rand))
    rh = np.exp(rng.uniform(np.log(4), np.log(H), n_rand))
    rand = np.stack([x1, y1, x1 + rw - 1, y1 + rh - 1], 1)
    boxes = np.concatenate([jit, rand])
    boxes[:, 0::2] = boxes[:, 0::2].clip(0, W - 1)
    boxes[:, 1::2] = boxes[:, 1::2].clip(0, H - 1)
    boxes[:, 2:] = np.maximum(boxes[:, 2:], boxes[:, :2])
    boxes = boxes.astype(np.float32)
    iou = (bbox_overlaps(boxes, gt.astype(np.float32)).max(axis=1) if len(gt)
           else np.zeros(len(boxes), np.float32))
    scores = np.where(np.arange(len(boxes)) < len(jit),
                      0.3 + 0.7 * iou * rng.uniform(0.8, 1.0, len(boxes)),
                      rng.uniform(0.0, 0.4, len(boxes))).astype(np.float32)
    order = np.argsort(-scores, kind="stable")
    return boxes[order], scores[order]


def _make_dataset(out: Path, name: str, num_images: int, seed: int, ds_index: int) -> None:
    """Write ``out/<name>/{images/, annotations.json, proposals.npz}``."""
    img_dir = out / name / "images"
    img_dir.mkdir(parents=True)
    images, annotations, props = [], [], []
    for i in range(num_images):
        rng = np.random.default_rng(np.random.SeedSequence([seed, ds_index, i]))
        image_id = _ID_BASE[name] + 3 * i + 1
        img, anns = draw_image(rng, portrait=i % 6 == 5, empty=i % 37 == 36,
                               crowd=i % 8 == 3, size_range=_SIZE_RANGE)
        H, W = img.shape[:2]
        file_name = f"{name}_{image_id:07d}.jpg"
        write_jpeg(img_dir / file_name, img)
        images.append({"id": image_id, "file_name": file_name, "width": W, "height": H})
        annotations += [{"image_id": image_id, **a} for a in anns]
        gt = np.array([[a["bbox"][0], a["bbox"][1], a["bbox"][0] + a["bbox"][2] - 1,
                        a["bbox"][1] + a["bbox"][3] - 1] for a in anns]).reshape(-1, 4)
        props.append((image_id, *_proposals(rng, gt, W, H)))
    annotations = [{"id": _ID_BASE[name] + j, **a} for j, a in enumerate(annotations, 1)]
    coco = {"info": {"description": f"lit_roidata synthetic demo dataset {name}",
                     "version": "1.0", "year": 2024}, "licenses": [], "images": images,
            "annotations": annotations, "categories": [dict(c) for c in DEMO_CATEGORIES]}
    (out / name / "annotations.json").write_text(json.dumps(coco))
    # The columnar proposal format (read without unpickling; see convert_proposals).
    ids, boxes, scores = zip(*props)
    np.savez(out / name / "proposals.npz", ids=np.asarray(ids, np.int64),
             counts=np.asarray([len(b) for b in boxes], np.int64),
             boxes=np.concatenate(boxes).astype(np.float32, copy=False),
             scores=np.concatenate(scores).astype(np.float32, copy=False))


def _layout(root: Path, counts: Mapping[str, int]) -> dict[str, dict[str, Any]]:
    return {name: {"image_dir": str(root / name / "images"),
                   "annotation_file": str(root / name / "annotations.json"),
                   "proposal_file": str(root / name / "proposals.npz"),
                   "num_images": int(n)} for name, n in counts.items()}


def _files_ok(root: Path, counts: Mapping[str, int]) -> bool:
    return all((root / name / "annotations.json").is_file()
               and (root / name / "proposals.npz").is_file()
               and count_jpegs(root / name / "images") == n for name, n in counts.items())


def count_jpegs(folder: Path) -> int:
    """The ``.jpg`` files in ``folder`` (0 when it does not exist)."""
    try:
        return sum(1 for e in os.scandir(folder) if e.name.endswith(".jpg"))
    except FileNotFoundError:
        return 0


def _wanted(seed: int, num_images: Mapping[str, int] | None) -> dict[str, Any]:
    counts = dict(DEMO_NUM_IMAGES)
    for name, n in (num_images or {}).items():
        if name not in counts:
            raise ValueError(f"num_images: unknown demo dataset {name!r}; "
                             f"choose from {sorted(counts)}")
        if int(n) < 1:
            raise ValueError(f"num_images[{name!r}] = {n}; need at least 1 image")
        counts[name] = int(n)
    return {"version": _VERSION, "seed": int(seed), "num_images": counts}


def is_demo_data(root: str | os.PathLike, *, seed: int = 0,
                 num_images: Mapping[str, int] | None = None) -> bool:
    """Whether ``root`` holds the complete demo data :func:`ensure_demo_data` makes with
    these arguments (which it would reuse untouched)."""
    root, wanted = Path(root).expanduser().resolve(), _wanted(seed, num_images)
    return is_built(root, _MANIFEST, wanted, lambda r: _files_ok(r, wanted["num_images"]))


def ensure_demo_data(root: str | os.PathLike, *, seed: int = 0,
                     num_images: Mapping[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """Create the synthetic demo datasets under ``root`` unless they are already there.

    Safe from every DDP rank at once; a complete folder with the same parameters is reused
    untouched, anything else regenerated (docs/demo.md: how it is built).

    Args:
        root: folder for the data (created if needed).
        seed: generation seed; equal seeds give identical files.
        num_images: images per dataset; defaults to :data:`DEMO_NUM_IMAGES`
            (``demo_train_a`` 200, ``demo_train_b`` 100, ``demo_val`` 60).

    Returns:
        ``{name: {"image_dir", "annotation_file", "proposal_file", "num_images"}}`` for
        ``demo_train_a``, ``demo_train_b`` and ``demo_val``.

    Raises:
        ValueError: unknown dataset name or a count below 1 in ``num_images``.
        TimeoutError: another process held the lock for more than 10 minutes.
    """
    wanted = _wanted(seed, num_images)
    root = build_once(root, ".demo_data.lock", _MANIFEST, wanted,
                      lambda r: _files_ok(r, wanted["num_images"]), lambda tmp: _build(tmp, wanted))
    return _layout(root, wanted["num_images"])


def is_built(root: Path, manifest: str, wanted: Mapping[str, Any],
             files_ok: Callable[[Path], bool]) -> bool:
    """Whether ``root/manifest`` records ``wanted`` and ``files_ok(root)``."""
    try:
        found = json.loads((root / manifest).read_text())
    except (OSError, ValueError):
        return False
    return {k: found.get(k) for k in wanted} == wanted and files_ok(root)


def build_once(root: str | os.PathLike, lock_name: str, manifest: str, wanted: Mapping[str, Any],
               files_ok: Callable[[Path], bool], make: Callable[[Path], Iterable[str]]) -> Path:
    """Generate a data folder unless it is there (:func:`is_built`), once across processes;
    returns the folder's resolved path (created if needed).

    Under a file lock (checked again after the wait), ``make(tmp)`` writes into a temporary
    folder and returns the paths it made; they replace those of ``root``, then the manifest
    (``wanted``) is written, marking the folder complete. ``TimeoutError`` after 10 minutes.
    """
    root = Path(root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    if is_built(root, manifest, wanted, files_ok):
        return root
    try:
        with FileLock(str(root / lock_name), timeout=_LOCK_TIMEOUT_S):
            if is_built(root, manifest, wanted, files_ok):
                return root
            log.info("generating synthetic demo data in %s (%s)", root, wanted["num_images"])
            (root / manifest).unlink(missing_ok=True)
            tmp = root / f".build-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                for sub in make(tmp):
                    shutil.rmtree(root / sub, ignore_errors=True)
                    (root / sub).parent.mkdir(parents=True, exist_ok=True)
                    os.replace(tmp / sub, root / sub)
                with atomic_write(root / manifest, "w") as f:
                    json.dump(wanted, f, indent=1)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except Timeout as e:
        raise TimeoutError(f"waited {_LOCK_TIMEOUT_S:.0f} s for the demo-data lock "
                           f"{root / lock_name}; if no other process is generating "
                           f"the data, delete that file and retry") from e
    return root


def _build(tmp: Path, wanted: dict[str, Any]) -> list[str]:
    for ds_index, (name, n) in enumerate(sorted(wanted["num_images"].items())):
        _make_dataset(tmp, name, n, wanted["seed"], ds_index)
    return list(wanted["num_images"])


def register_demo_datasets(root: str | os.PathLike, catalog: Any = None, *, seed: int = 0,
                           num_images: Mapping[str, int] | None = None) -> DemoDatasets:
    """Ensure the demo data exists under ``root`` and register its names in a catalog.

    Args:
        root: demo data folder (see :func:`ensure_demo_data`).
        catalog: an object with ``register(name, image_dir, annotation_file,
            image_prefix="")`` (default :class:`lit_roidata.catalog.DatasetCatalog`); a new
            catalog that ``register`` returns (frozen-value catalogs) is used from then on.
        seed, num_images: passed to :func:`ensure_demo_data`.

    Returns:
        A :class:`DemoDatasets` with the train/val names and their proposal files.
    """
    layout = ensure_demo_data(root, seed=seed, num_images=num_images)
    if catalog is None:  # lazy: the catalog imports the roidb side
        from lit_roidata.catalog import DatasetCatalog as catalog
    try:
        params = inspect.signature(catalog.register).parameters
    except (TypeError, ValueError):
        params = {}
    for name, info in layout.items():
        # overwrite: another demo root replaces the earlier registration
        extra = {k: v for k, v in (("overwrite", True), ("proposal_file", info["proposal_file"]))
                 if k in params}
        result = catalog.register(name, info["image_dir"], info["annotation_file"],
                                  image_prefix="", **extra)
        if result is not None and hasattr(result, "register"):
            catalog = result
    files = {name: info["proposal_file"] for name, info in layout.items()}
    return DemoDatasets(DEMO_TRAIN_DATASETS, tuple(files[n] for n in DEMO_TRAIN_DATASETS),
                        DEMO_VAL_DATASETS, tuple(files[n] for n in DEMO_VAL_DATASETS), catalog)
