"""Per-dataset metadata carried by every roidb entry (the ``dataset`` field)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

import numpy as np

__all__ = ["DatasetInfo", "RoIDBInputError", "COCO_KEYPOINT_NAMES", "COCO_KEYPOINT_FLIP_MAP",
           "keypoint_flip_map"]


class RoIDBInputError(ValueError):
    """Bad input to the roidb builder; the message names the file, image id and fix."""


#: COCO's 17 person keypoint names, in the order of the ``person`` category's
#: ``keypoints`` list (the single definition; the demo data and the tests import it).
COCO_KEYPOINT_NAMES: tuple[str, ...] = (
    "nose", "left_eye", "right_eye", "left_ear", "right_ear", "left_shoulder",
    "right_shoulder", "left_elbow", "right_elbow", "left_wrist", "right_wrist", "left_hip",
    "right_hip", "left_knee", "right_knee", "left_ankle", "right_ankle")

#: Detectron's hard-coded COCO person flip map (Detectron semantics: datasets and catalog):
#: every ``left_X`` of :data:`COCO_KEYPOINT_NAMES` to its ``right_X``, in list order.
COCO_KEYPOINT_FLIP_MAP: dict[str, str] = {
    name: "right_" + name[len("left_"):] for name in COCO_KEYPOINT_NAMES
    if name.startswith("left_")}


def keypoint_flip_map(keypoints: tuple[str, ...]) -> dict[str, str]:
    """The left→right flip map for ``keypoints``."""
    names = set(keypoints)
    out = {l: r for l, r in COCO_KEYPOINT_FLIP_MAP.items() if l in names and r in names}
    for name in keypoints:
        if name.startswith("left_") and "right_" + name[5:] in names:
            out.setdefault(name, "right_" + name[5:])
    return out


@dataclass(frozen=True, eq=True)
class DatasetInfo:
    """Classes, category-id maps and keypoint metadata of one dataset (Detectron semantics: datasets
    and catalog).

    Attributes:
        name: catalog name.
        classes: ``('__background__', name_1, ...)`` in the JSON ``categories`` order
            (or the shared order under ``category_policy="by_name"``).
        json_category_id_to_contiguous_id: JSON category id → contiguous id (1-based).
        contiguous_category_id_to_json_id: the inverse map (for evaluation).
        keypoints: keypoint names of the ``person`` category, or ``None``.
        keypoint_flip_map: left → right names used to flip keypoints, or ``None``.
    """

    name: str
    classes: tuple[str, ...]
    json_category_id_to_contiguous_id: Mapping[int, int] = field(hash=False)
    contiguous_category_id_to_json_id: Mapping[int, int] = field(hash=False)
    keypoints: Optional[tuple[str, ...]] = None
    keypoint_flip_map: Optional[Mapping[str, str]] = field(default=None, hash=False)

    @property
    def num_classes(self) -> int:
        """Number of classes including background (Detectron's ``num_classes``)."""
        return len(self.classes)

    @property
    def num_keypoints(self) -> int:
        """Keypoints per object, 0 if the dataset has none."""
        return 0 if self.keypoints is None else len(self.keypoints)

    def category_lut(self) -> tuple[np.ndarray, np.ndarray]:
        """The JSON category ids, ascending (int64), and their contiguous ids (int32)."""
        keys = sorted(self.json_category_id_to_contiguous_id)
        return (np.array(keys, np.int64),
                np.array([self.json_category_id_to_contiguous_id[k] for k in keys], np.int32))

    def to_json(self) -> dict:
        """A JSON-serialisable dict (stored in the cache's ``meta.json``)."""
        return {"name": self.name, "classes": list(self.classes),
                "json_to_contiguous": [[int(k), int(v)] for k, v in
                                       self.json_category_id_to_contiguous_id.items()],
                "keypoints": None if self.keypoints is None else list(self.keypoints),
                "keypoint_flip_map": None if self.keypoint_flip_map is None
                else dict(self.keypoint_flip_map)}

    @classmethod
    def from_json(cls, d: dict) -> "DatasetInfo":
        """Inverse of :meth:`to_json`."""
        j2c = {int(k): int(v) for k, v in d["json_to_contiguous"]}
        return cls(name=d["name"], classes=tuple(d["classes"]),
                   json_category_id_to_contiguous_id=j2c,
                   contiguous_category_id_to_json_id={v: k for k, v in j2c.items()},
                   keypoints=None if d["keypoints"] is None else tuple(d["keypoints"]),
                   keypoint_flip_map=d["keypoint_flip_map"])
