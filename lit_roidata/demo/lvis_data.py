"""Synthetic LVIS v1-format data: long-tailed categories, federated image labels, real JPEGs.

Train and val splits in Detectron2's LVIS v1 layout, one shape and colour per category;
see docs/lvis_datasets.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import cv2
import numpy as np

from lit_roidata.demo.data import build_once, count_jpegs
from lit_roidata.demo.shapes import annotation, canvas, draw_shape, place, write_jpeg

__all__ = ["LVIS_DEMO_DATASETS", "ensure_lvis_demo_data", "lvis_thresholds",
           "register_lvis_demo_datasets"]


#: Names :func:`register_lvis_demo_datasets` registers (train, val).
LVIS_DEMO_DATASETS: tuple[str, str] = ("lvis_demo_train", "lvis_demo_val")
_SPLITS = {"lvis_demo_train": ("train2017", "lvis_v1_train.json", 1000),
           "lvis_demo_val": ("val2017", "lvis_v1_val.json", 500000)}
_VERSION = 1  # bump when the generated content changes
_MANIFEST = "lvis_demo_manifest.json"
#: shapes.py's drawers: rectangle, ellipse, triangle
_SHAPES = ((3, "rectangle"), (7, "ellipse"), (12, "triangle"))
#: named hues (degrees) for the category colours
_COLOURS = (("red", 0), ("orange", 30), ("yellow", 60), ("green", 120), ("cyan", 180),
            ("blue", 240), ("violet", 270), ("magenta", 310))


def lvis_thresholds(num_train: int) -> tuple[int, int]:
    """``(rare_max, common_max)`` train image counts for ``num_train`` train images:
    LVIS's (10, 100) from 300 images up, proportionally smaller below."""
    rare_max = int(min(10, max(1, num_train // 30)))
    common_max = int(min(100, max(rare_max + 1, num_train // 3)))
    return rare_max, common_max


def _categories(num_categories: int) -> list[dict[str, Any]]:
    """Category records (ids 1..K) with their drawing parameters (``_shape``, ``_bgr``)."""
    n_col = -(-num_categories // len(_SHAPES))
    out = []
    for k in range(num_categories):
        (shape, shape_name), col = _SHAPES[k % len(_SHAPES)], k // len(_SHAPES)
        deg = int(round(360 * col / n_col))  # more colours than named: evenly spaced hues
        cname, deg = (_COLOURS[col * len(_COLOURS) // n_col] if n_col <= len(_COLOURS)
                      else (f"hue{deg}", deg))
        bgr = cv2.cvtColor(np.uint8([[[deg // 2, 230, 210]]]), cv2.COLOR_HSV2BGR)[0, 0]
        name = f"{cname}_{shape_name}"
        out.append({"id": k + 1, "name": name, "synonyms": [name],
                    "def": f"a {cname} {shape_name} (synthetic)", "synset": f"{name}.n.01",
                    "_shape": shape, "_bgr": tuple(int(v) for v in bgr)})
    return out


def _targets(rng: np.random.Generator, n_img: int, n_cat: int, rare_max: int,
             common_max: int) -> list[int]:
    """Planned train image count per category: frequent, common, rare groups by index."""
    n_f = max(1, round(0.25 * n_cat))
    n_r = max(1, round(0.35 * n_cat)) if n_cat > 2 else 0
    groups = ((n_f, common_max + 1, max(common_max + 2, int(0.55 * n_img))),
              (n_cat - n_f - n_r, rare_max + 2, max(rare_max + 3, common_max - 1)),
              (n_r, 1, rare_max + 1))
    return [int(np.exp(rng.uniform(np.log(lo), np.log(hi))))
            for n, lo, hi in groups for _ in range(n)]


def _plan(rng: np.random.Generator, n_img: int, targets: list[int],
          scale: float) -> list[list[int]]:
    """Per image, the category indices planned into it (``targets`` scaled to the split)."""
    targets = [max(1, min(n_img, int(round(t * scale)))) for t in targets]
    per_image: list[list[int]] = [[] for _ in range(n_img)]
    for k, t in enumerate(targets):
        for i in rng.choice(n_img, size=t, replace=False).tolist():
            per_image[i].append(k)
    return per_image


def _draw(rng: np.random.Generator, cats: list[dict], planned: list[int],
          size_range: tuple[int, int]) -> tuple[np.ndarray, list[dict], set]:
    """One image: its planned categories (1-3 instances each), non-overlapping polygons.

    Returns the BGR image, the annotations, and the categories left not exhaustive (one
    drawn instance unannotated)."""
    img = canvas(rng, size_range)
    H, W = img.shape[:2]
    taken: list[tuple[int, int, int, int]] = []
    anns: list[dict] = []
    by_cat: dict[int, list[int]] = {}
    for k in planned:
        cat = cats[k]
        for _ in range(1 + int(rng.random() < 0.35) + int(rng.random() < 0.1)):
            s = int(rng.integers(18, min(64, min(W, H) - 4) + 1))
            w, h = s, int(np.clip(round(s * rng.uniform(0.7, 1.4)), 14, H - 4))
            if (pos := place(rng, taken, W, H, w, h)) is None:
                continue
            mask = np.zeros((H, W), np.uint8)
            draw_shape(mask, cat["_shape"], pos[0], pos[1], w, h)
            if (ann := annotation(mask, cat["_shape"], crowd=False)) is None:
                continue
            ann.pop("iscrowd")  # LVIS has no crowd annotations
            ann["category_id"] = cat["id"]
            taken.append((pos[0], pos[1], w, h))
            shade = np.array(cat["_bgr"]) + rng.integers(-12, 13, size=3)
            img[mask > 0] = shade.clip(0, 255).astype(np.uint8)
            by_cat.setdefault(cat["id"], []).append(len(anns))
            anns.append(ann)
    drop, not_exhaustive = set(), set()
    for cid, rows in by_cat.items():
        if len(rows) >= 2 and rng.random() < 0.3:
            drop.add(rows[int(rng.integers(len(rows)))])
            not_exhaustive.add(cid)
    return img, [a for j, a in enumerate(anns) if j not in drop], not_exhaustive


def _make_split(root: Path, name: str, n_img: int, seed: int, cats: list[dict],
                targets: list[int], scale: float, size_range: tuple[int, int]
                ) -> tuple[list, list]:
    folder, _, id_base = _SPLITS[name]
    split_index, img_dir = list(_SPLITS).index(name), root / "coco" / folder
    img_dir.mkdir(parents=True, exist_ok=True)
    plan = _plan(np.random.default_rng(np.random.SeedSequence([seed, split_index, 0])), n_img,
                 targets, scale)
    images, annotations, all_ids = [], [], np.arange(1, len(cats) + 1)
    for i in range(n_img):
        rng = np.random.default_rng(np.random.SeedSequence([seed, split_index, 1, i]))
        image_id = id_base + 7 * i + 1
        img, anns, not_exh = _draw(rng, cats, plan[i], size_range)
        fn = f"{image_id:012d}.jpg"
        write_jpeg(img_dir / fn, img)
        present = {a["category_id"] for a in anns} | not_exh
        absent = np.setdiff1d(all_ids, sorted(present))
        n_neg = int(min(absent.size, rng.integers(0, 4)))
        neg = sorted(rng.choice(absent, size=n_neg, replace=False).tolist()) if n_neg else []
        images.append({
            "id": image_id, "width": img.shape[1], "height": img.shape[0], "license": 1,
            "coco_url": f"http://images.cocodataset.org/{folder}/{fn}",
            "flickr_url": f"http://farm1.staticflickr.com/demo/{fn}",
            "date_captured": "2013-11-14 16:28:13",
            "neg_category_ids": neg, "not_exhaustive_category_ids": sorted(not_exh)})
        annotations += [{"image_id": image_id, **a} for a in anns]
    return images, [{"id": id_base * 10 + j, **a} for j, a in enumerate(annotations, 1)]


def _category_records(cats: list[dict], train_anns: list, thresholds: tuple[int, int]
                      ) -> list[dict]:
    rare_max, common_max = thresholds
    img_sets: dict[int, set] = {c["id"]: set() for c in cats}
    inst = dict.fromkeys(img_sets, 0)
    for a in train_anns:
        img_sets[a["category_id"]].add(a["image_id"])
        inst[a["category_id"]] += 1
    return [{**{k: v for k, v in c.items() if not k.startswith("_")},
             "frequency": "r" if n <= rare_max else "c" if n <= common_max else "f",
             "image_count": n, "instance_count": inst[c["id"]]}
            for c, n in ((c, len(img_sets[c["id"]])) for c in cats)]


def _layout(root: Path, counts: dict[str, int]) -> dict[str, dict[str, Any]]:
    return {name: {"image_dir": str(root / "coco"),
                   "annotation_file": str(root / "lvis" / _SPLITS[name][1]),
                   "num_images": int(counts[name]), "format": "lvis"} for name in _SPLITS}


def _files_ok(root: Path, wanted: dict[str, Any]) -> bool:
    return all(Path(info["annotation_file"]).is_file()
               and count_jpegs(Path(info["image_dir"]) / _SPLITS[name][0]) == info["num_images"]
               for name, info in _layout(root, wanted["num_images"]).items())


def ensure_lvis_demo_data(root: str | os.PathLike, *, seed: int = 0, num_train: int = 300,
                          num_val: int = 60, num_categories: int = 12,
                          size_range: tuple[int, int] = (160, 320)) -> dict[str, dict[str, Any]]:
    """Create the synthetic LVIS v1-format data under ``root`` unless it is already there.

    Safe from every DDP rank at once, as :func:`~lit_roidata.demo.ensure_demo_data`. The
    defaults give 12 categories: 3 frequent, 5 common, 4 rare.

    Args:
        root: data root (created if needed); the files follow Detectron2's LVIS layout.
        seed: generation seed; equal arguments give identical files.
        num_train, num_val: images per split (at least 1 each).
        num_categories: categories (ids 1..``num_categories``), at least 1.
        size_range: (short side, long side) bounds of the images in pixels.

    Returns:
        ``{"lvis_demo_train": {...}, "lvis_demo_val": {...}}``, each with ``image_dir``
        (``root/coco``), ``annotation_file``, ``num_images`` and ``format`` (``"lvis"``).

    Raises:
        ValueError: a count below 1. TimeoutError: the lock was held for 10 minutes.
    """
    for what, v in (("num_train", num_train), ("num_val", num_val),
                    ("num_categories", num_categories)):
        if int(v) < 1:
            raise ValueError(f"{what}={v}; need at least 1")
    counts = {"lvis_demo_train": int(num_train), "lvis_demo_val": int(num_val)}
    wanted = {"version": _VERSION, "seed": int(seed), "num_images": counts,
              "num_categories": int(num_categories), "size_range": [int(v) for v in size_range]}
    root = build_once(root, ".lvis_demo_data.lock", _MANIFEST, wanted,
                      lambda r: _files_ok(r, wanted), lambda tmp: _build(tmp, wanted))
    return _layout(root, counts)


def _build(tmp: Path, wanted: dict[str, Any]) -> tuple[str, ...]:
    counts, seed = wanted["num_images"], wanted["seed"]
    n_train, cats = counts["lvis_demo_train"], _categories(wanted["num_categories"])
    thresholds = lvis_thresholds(n_train)
    targets = _targets(np.random.default_rng(np.random.SeedSequence([seed, 99])), n_train,
                       len(cats), *thresholds)
    splits = {name: _make_split(tmp, name, n, seed, cats, targets, n / n_train,
                                tuple(wanted["size_range"])) for name, n in counts.items()}
    records = _category_records(cats, splits["lvis_demo_train"][1], thresholds)
    (tmp / "lvis").mkdir()
    for name, (images, anns) in splits.items():
        doc = {"info": {"description": f"lit_roidata synthetic LVIS v1-format data ({name})",
                        "version": "1.0", "year": 2026,
                        "frequency_thresholds": {"rare_max_images": thresholds[0],
                                                 "common_max_images": thresholds[1]}},
               "licenses": [{"id": 1, "name": "CC BY 4.0", "url": ""}],
               "images": images, "annotations": anns, "categories": records}
        (tmp / "lvis" / _SPLITS[name][1]).write_text(json.dumps(doc))
    return ("lvis", "coco/train2017", "coco/val2017")


def register_lvis_demo_datasets(root: str | os.PathLike, catalog: Optional[Any] = None,
                                **kwargs: Any) -> tuple[str, str]:
    """Ensure the LVIS demo data under ``root`` and register ``lvis_demo_train`` /
    ``lvis_demo_val`` (``format="lvis"``) in ``catalog`` (default
    :data:`lit_roidata.catalog.DatasetCatalog`); ``kwargs`` go to
    :func:`ensure_lvis_demo_data`. Returns the two names."""
    if catalog is None:
        from lit_roidata.catalog import DatasetCatalog as catalog
    for name, info in ensure_lvis_demo_data(root, **kwargs).items():
        catalog.register(name, info["image_dir"], info["annotation_file"], format="lvis",
                         overwrite=True)
    return LVIS_DEMO_DATASETS
