"""Drawing one synthetic demo image and its COCO annotations (used by :mod:`.data`).

Each category is one shape in one colour; objects never overlap, so a drawn mask is the
object's segmentation and its tight pixel bounds the COCO box (``w = x2 - x1 + 1``).
"""

from __future__ import annotations

from typing import Any

import cv2
import numpy as np
from pycocotools import mask as mask_utils

from lit_roidata.roidb.info import COCO_KEYPOINT_NAMES
from lit_roidata.roidb.segms import mask_to_uncompressed_counts

__all__ = ["COCO_KEYPOINT_NAMES", "DEMO_CATEGORIES", "annotation", "canvas", "draw_image",
           "draw_shape", "place", "rle_uncompressed", "write_jpeg"]

_SKELETON = [[16, 14], [14, 12], [17, 15], [15, 13], [12, 13], [6, 12], [7, 13], [6, 7],
             [6, 8], [7, 9], [8, 10], [9, 11], [2, 3], [1, 2], [1, 3], [2, 4], [3, 5], [4, 6],
             [5, 7]]

#: COCO category records, in JSON order. Ids are deliberately not contiguous so that the
#: contiguous <-> json id maps are exercised (Detectron semantics: datasets and catalog).
DEMO_CATEGORIES: tuple[dict[str, Any], ...] = (
    {"id": 1, "name": "person", "supercategory": "person",
     "keypoints": list(COCO_KEYPOINT_NAMES), "skeleton": _SKELETON},
    *({"id": i, "name": name, "supercategory": "shape"}
      for i, name in ((3, "rectangle"), (7, "circle"), (12, "triangle"))))
_COLOURS_BGR = {1: (120, 20, 110), 3: (40, 40, 220), 7: (220, 70, 30), 12: (40, 170, 40)}

# A front-facing person: the person's left is on the image's right (COCO convention).
_KP_TEMPLATE = np.array([
    (0.50, 0.10), (0.58, 0.07), (0.42, 0.07), (0.64, 0.09), (0.36, 0.09), (0.72, 0.25),
    (0.28, 0.25), (0.86, 0.42), (0.14, 0.42), (0.95, 0.56), (0.05, 0.56), (0.62, 0.58),
    (0.38, 0.58), (0.66, 0.78), (0.34, 0.78), (0.70, 0.96), (0.30, 0.96)], dtype=np.float64)
_LIMBS = [(5, 7), (7, 9), (6, 8), (8, 10), (11, 13), (13, 15), (12, 14), (14, 16)]
#: ``keypoints`` of an object without keypoints: a keypoint dataset needs the field on
#: every object (Detectron crashes, Detectron quirk Q23 (docs/detectron_quirks.md))
_NO_KEYPOINTS = [0] * (3 * len(COCO_KEYPOINT_NAMES))


def write_jpeg(path: Any, img: np.ndarray) -> None:
    """Write a demo image as a quality-92 JPEG (``OSError`` if OpenCV cannot)."""
    if not cv2.imwrite(str(path), img, [cv2.IMWRITE_JPEG_QUALITY, 92]):
        raise OSError(f"could not write demo image {path}")


def rle_uncompressed(mask: np.ndarray) -> dict[str, Any]:
    """COCO's uncompressed RLE (column-major runs, starting with zeros), as in crowd JSON."""
    return {"size": [int(mask.shape[0]), int(mask.shape[1])],
            "counts": mask_to_uncompressed_counts(mask)}


def draw_shape(mask: np.ndarray, cat: int, x: int, y: int, w: int, h: int) -> np.ndarray | None:
    """Draw category ``cat`` into ``mask`` within box (x, y, w, h); keypoints for persons."""
    if cat == 3:
        cv2.rectangle(mask, (x, y), (x + w - 1, y + h - 1), 1, thickness=-1)
    elif cat == 7:
        cv2.ellipse(mask, (x + w // 2, y + h // 2), (max(w // 2 - 1, 1), max(h // 2 - 1, 1)),
                    0, 0, 360, 1, thickness=-1)
    elif cat == 12:
        pts = np.array([[x + w // 2, y], [x + w - 1, y + h - 1], [x, y + h - 1]], np.int32)
        cv2.fillPoly(mask, [pts], 1)
    else:
        kp = np.array([x, y]) + _KP_TEMPLATE * np.array([w - 1, h - 1])
        p, t = np.round(kp).astype(np.int32), max(2, w // 9)
        cv2.circle(mask, tuple(int(v) for v in p[0]), max(2, int(0.09 * h)), 1, -1)
        cv2.fillPoly(mask, [p[[5, 6, 12, 11]]], 1)
        cv2.line(mask, tuple(map(int, p[0])), tuple(map(int, (p[5] + p[6]) // 2)), 1, t)
        for a, b in _LIMBS:
            cv2.line(mask, tuple(map(int, p[a])), tuple(map(int, p[b])), 1, t)
        return kp
    return None


def annotation(mask: np.ndarray, cat: int, *, crowd: bool) -> dict[str, Any] | None:
    """The COCO record of the object drawn in ``mask`` (RLE if ``crowd``, else polygons);
    ``None`` when nothing is drawn."""
    ys, xs = np.nonzero(mask)
    if xs.size == 0:
        return None
    x0, x1, y0, y1 = int(xs.min()), int(xs.max()), int(ys.min()), int(ys.max())
    ann: dict[str, Any] = {"category_id": cat, "iscrowd": int(crowd), "area": float(xs.size),
                           "bbox": [float(x0), float(y0), float(x1 - x0 + 1), float(y1 - y0 + 1)]}
    if crowd:
        ann["segmentation"] = rle_uncompressed(mask)
    else:
        contours, _ = cv2.findContours(mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
        polys = [c.reshape(-1).astype(float).tolist() for c in contours if len(c) >= 3]
        if not polys:
            return None
        ann["segmentation"] = polys
        # COCO's area for a polygon is that of its rasterisation, not of the drawn mask.
        rles = mask_utils.frPyObjects(polys, mask.shape[0], mask.shape[1])
        ann["area"] = float(mask_utils.area(mask_utils.merge(rles)))
    return ann


def _keypoints(kp: np.ndarray, rng: np.random.Generator) -> tuple[list[float], int]:
    vis = np.where(rng.random(len(kp)) < 0.12, 0, np.where(rng.random(len(kp)) < 0.2, 1, 2))
    out = np.column_stack([np.round(kp, 1), vis]).astype(np.float64)
    out[vis == 0, :2] = 0  # COCO writes unlabelled keypoints as (0, 0, 0)
    return out.reshape(-1).tolist(), int((vis > 0).sum())


def place(rng: np.random.Generator, taken: list[tuple[int, int, int, int]], W: int, H: int,
           w: int, h: int, gap: int = 4) -> tuple[int, int] | None:
    """A free top-left corner for a ``w`` x ``h`` box ``gap`` pixels from the boxes
    ``taken`` (30 tries; ``None``: no room)."""
    if w >= W - 2 or h >= H - 2:
        return None
    for _ in range(30):
        x, y = int(rng.integers(1, W - w - 1)), int(rng.integers(1, H - h - 1))
        if all(x + w + gap <= a or a + c + gap <= x or y + h + gap <= b or b + d + gap <= y
               for a, b, c, d in taken):
            return x, y
    return None


def canvas(rng: np.random.Generator, size_range: tuple[int, int],
           portrait: bool | None = None) -> np.ndarray:
    """A noisy plain BGR background of a random size within ``size_range``, taller than
    wide if ``portrait`` (``None``: drawn, with probability 0.2)."""
    lo, hi = size_range
    a, b = int(rng.integers(lo, (lo + hi) // 2 + 1)), int(rng.integers((lo + hi) // 2, hi + 1))
    W, H = (a, b) if (rng.random() < 0.2 if portrait is None else portrait) else (b, a)
    base = rng.integers(165, 245, size=3)
    return (base[None, None, :] + rng.normal(0, 6, size=(H, W, 3))).clip(0, 255).astype(np.uint8)


def draw_image(rng: np.random.Generator, *, portrait: bool, empty: bool, crowd: bool,
               size_range: tuple[int, int]) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """One BGR uint8 image and its annotation records (without ``id``/``image_id``), from
    the image's own generator: taller than wide if ``portrait``, no objects if ``empty``,
    one ``iscrowd=1`` cluster of small shapes (RLE) if ``crowd``; ``size_range``: (short
    side, long side) bounds in pixels."""
    img = canvas(rng, size_range, portrait)
    H, W = img.shape[:2]
    anns: list[dict[str, Any]] = []
    taken: list[tuple[int, int, int, int]] = []
    masks: list[tuple[np.ndarray, int]] = []

    def add(mask: np.ndarray, cat: int, box: tuple[int, int, int, int],
            kp: np.ndarray | None = None, crowd: bool = False) -> None:
        if (ann := annotation(mask, cat, crowd=crowd)) is not None:
            ann["keypoints"], ann["num_keypoints"] = (
                (list(_NO_KEYPOINTS), 0) if kp is None else _keypoints(kp, rng))
            taken.append(box)
            anns.append(ann)
            masks.append((mask, cat))

    if crowd:
        cat, side = int(rng.choice([3, 7])), int(rng.integers(44, min(80, min(W, H) - 4) + 1))
        if (pos := place(rng, taken, W, H, side, side)) is not None:
            mask = np.zeros((H, W), np.uint8)
            for cy in range(pos[1] + 3, pos[1] + side - 8, 11):
                for cx in range(pos[0] + 3, pos[0] + side - 8, 11):
                    draw_shape(mask, cat, cx, cy, 7, 7)
            add(mask, cat, (pos[0], pos[1], side, side), crowd=True)
    for _ in range(0 if empty else int(rng.integers(1, 5))):
        cat = int(rng.choice([c["id"] for c in DEMO_CATEGORIES]))
        if cat == 1:
            h = int(rng.integers(48, min(112, H - 4) + 1))
            w = max(16, int(round(h * rng.uniform(0.45, 0.6))))
        else:
            s = int(rng.integers(22, min(90, min(W, H) - 4) + 1))
            w, h = s, int(np.clip(round(s * rng.uniform(0.7, 1.4)), 16, H - 4))
        if (pos := place(rng, taken, W, H, w, h)) is not None:
            mask = np.zeros((H, W), np.uint8)
            add(mask, cat, (pos[0], pos[1], w, h), draw_shape(mask, cat, pos[0], pos[1], w, h))
    for mask, cat in masks:
        shade = np.array(_COLOURS_BGR[cat]) + rng.integers(-15, 16, size=3)
        img[mask > 0] = shade.clip(0, 255).astype(np.uint8)
    return img, anns
