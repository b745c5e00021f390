"""Pascal VOC trees (``format="voc"`` in the catalog) as Detectron2's standard dataset dicts.

A VOC tree holds ``Annotations/<id>.xml``, ``ImageSets/Main/<split>.txt`` and
``JPEGImages/<id>.jpg``; a ``format="voc"`` catalog record names the split list as its
annotation file. See docs/custom_datasets.md (Pascal VOC).
"""

from __future__ import annotations

import functools
import hashlib
import os
import xml.etree.ElementTree as ET
from typing import Any, Sequence

__all__ = ["VOC_CLASSES", "load_voc_instances", "parse_voc_xml", "voc_image_ids",
           "voc_root_split", "voc_fingerprint", "voc_source"]

#: The 20 Pascal VOC classes, in the devkit's (and Detectron2's) order.
VOC_CLASSES = ("aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car", "cat", "chair",
               "cow", "diningtable", "dog", "horse", "motorbike", "person", "pottedplant",
               "sheep", "sofa", "train", "tvmonitor")
#: Detectron2's ``BoxMode.XYXY_ABS`` (an ``IntEnum`` equal to 0).
XYXY_ABS = 0


def voc_root_split(split_file: str) -> tuple[str, str]:
    """``(VOC root, split)`` of a split list ``<root>/ImageSets/Main/<split>.txt``."""
    main = os.path.dirname(os.path.abspath(split_file))
    if not split_file.endswith(".txt") or main.split(os.sep)[-2:] != ["ImageSets", "Main"]:
        raise ValueError(f"{split_file}: a VOC dataset's annotation file is its split list "
                         f"<VOC root>/ImageSets/Main/<split>.txt")
    return os.path.dirname(os.path.dirname(main)), os.path.basename(split_file)[:-4]


def voc_image_ids(dirname: str, split: str) -> list[str]:
    """The image ids listed in ``<dirname>/ImageSets/Main/<split>.txt`` (first column;
    blank lines and ``#`` comments skipped)."""
    with open(os.path.join(dirname, "ImageSets", "Main", split + ".txt"), encoding="utf-8") as f:
        return [w[0] for w in (line.split("#")[0].split() for line in f) if w]


def parse_voc_xml(path: str) -> tuple[int, int, list[tuple[str, list[float], bool]]]:
    """``(height, width, objects)`` of a VOC annotation file; each object is ``(class name,
    [xmin, ymin, xmax, ymax] as written (1-based, inclusive), difficult)``."""
    root = ET.parse(path).getroot()
    objects = []
    for obj in root.findall("object"):
        box = obj.find("bndbox")
        objects.append((obj.findtext("name"),
                        [float(box.findtext(k)) for k in ("xmin", "ymin", "xmax", "ymax")],
                        int(obj.findtext("difficult") or 0) != 0))
    return int(root.findtext("size/height")), int(root.findtext("size/width")), objects


def load_voc_instances(dirname: str, split: str,
                       class_names: Sequence[str] = VOC_CLASSES) -> list[dict[str, Any]]:
    """Detectron2's standard dataset dicts of a VOC split, equal to Detectron2's
    ``load_voc_instances``: string ``image_id``, 0-based ``category_id`` in ``class_names``,
    ``XYXY_ABS`` boxes (the file's ``xmin, ymin`` minus 1), difficult objects kept.
    ValueError: an object whose class is not in ``class_names`` (names the file).
    """
    index = {name: i for i, name in reversed(list(enumerate(class_names)))}
    out = []
    for fid in voc_image_ids(dirname, split):
        xml = os.path.join(dirname, "Annotations", fid + ".xml")
        height, width, objects = parse_voc_xml(xml)
        for name, _, _ in objects:
            if name not in index:
                raise ValueError(f"{xml}: class {name!r} is not one of {list(class_names)}")
        out.append({"file_name": os.path.join(dirname, "JPEGImages", fid + ".jpg"),
                    "image_id": fid, "height": height, "width": width,
                    "annotations": [{"category_id": index[name], "bbox_mode": XYXY_ABS,
                                     "bbox": [x1 - 1.0, y1 - 1.0, x2, y2]}
                                    for name, (x1, y1, x2, y2), _ in objects]})
    return out


def voc_fingerprint(dirname: str, split: str) -> str:
    """A digest of the VOC root, the split's image ids and the size and mtime of each of
    their annotation files: the cache key of the split's records."""
    h = hashlib.sha1(os.path.abspath(dirname).encode())
    for fid in voc_image_ids(dirname, split):
        st = os.stat(os.path.join(dirname, "Annotations", fid + ".xml"))
        h.update(f"{fid} {st.st_size} {st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def voc_source(spec: Any) -> dict[str, Any]:
    """What the registered-function path needs of a ``format="voc"`` catalog record (its
    ``annotation_file`` is the split list): ``function`` (the split's dicts, ids in split
    order), ``thing_classes`` (the 20 VOC classes) and ``version`` (:func:`voc_fingerprint`)."""
    root, split = voc_root_split(spec.annotation_file)
    return {"function": functools.partial(load_voc_instances, root, split),
            "thing_classes": VOC_CLASSES, "version": voc_fingerprint(root, split)}
