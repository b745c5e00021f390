"""Test oracle: the typed decoder as it was before polygons and keypoints became raw text.

``decode_fast`` below is the msgspec decoder that built a Python float per polygon
coordinate and keypoint value (``list[list[float]]`` / ``list[int | float]`` fields), kept
verbatim as the reference the vectorised decoder (:mod:`lit_roidata.roidb.numtext`) must
match bit for bit. Tests only; not part of the package.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import Optional, Union

import msgspec
import numpy as np
import orjson

from lit_roidata.roidb.decode import SEG_MISSING, SEG_POLY, SEG_RLE, RawCoco

_NULL = msgspec.Raw(b"null")


# gc=False: decoded JSON holds no reference cycles, so the structs need not be tracked by
# the cyclic GC (cheaper to create and free; msgspec's documented option)
class _Img(msgspec.Struct, gc=False):
    id: int
    width: int
    height: int
    file_name: str


class _RLE(msgspec.Struct, gc=False):
    size: list[int]
    counts: Union[list[int], str]


class _Ann(msgspec.Struct, kw_only=True, gc=False):
    id: int = -1
    image_id: int
    category_id: int
    bbox: tuple[float, float, float, float]
    area: float
    iscrowd: Union[int, bool] = 0
    ignore: float = 0.0
    segmentation: Union[list[list[float]], _RLE, None] = None
    # int | float: keypoints are mostly small integers (0 for unlabelled), which Python
    # shares instead of allocating a float each
    keypoints: Optional[list[Union[int, float]]] = None


class _Top(msgspec.Struct):
    images: list[_Img]
    annotations: Optional[list[_Ann]] = None
    categories: msgspec.Raw = _NULL


_DECODER = msgspec.json.Decoder(_Top)
_EMPTY: tuple = ()



def decode_fast(raw: bytes, source: str) -> Optional[RawCoco]:
    """The typed msgspec decode; ``None`` if the file is not strictly well-typed.

    Only the fields the roidb reads are decoded (``coco_url``, ``num_keypoints`` and the
    like are skipped by msgspec without building objects, and annotations become
    slotted structs instead of dicts); numbers go from the decoded lists into NumPy
    arrays with C-level iteration.
    """
    try:
        top = _DECODER.decode(raw)
        cats = orjson.loads(bytes(top.categories)) or []
    except (msgspec.ValidationError, msgspec.DecodeError, orjson.JSONDecodeError):
        return None
    if not isinstance(cats, list):
        return None
    images = top.images
    anns = top.annotations or []
    n, na = len(images), len(anns)
    img_id = np.fromiter(map(attrgetter("id"), images), np.int64, n)
    img_w = np.fromiter(map(attrgetter("width"), images), np.float64, n)
    img_h = np.fromiter(map(attrgetter("height"), images), np.float64, n)
    names = list(map(attrgetter("file_name"), images))
    bbox = np.fromiter(chain.from_iterable(map(attrgetter("bbox"), anns)), np.float64,
                       4 * na).reshape(-1, 4)
    segs = list(map(attrgetter("segmentation"), anns))
    types = list(map(type, segs))
    per = [s_ if t is list else _EMPTY for s_, t in zip(segs, types)]
    poly_n = np.fromiter(map(len, per), np.int64, na)
    polys = list(chain.from_iterable(per))
    coord_n = np.fromiter(map(len, polys), np.int64, len(polys))
    coords = np.fromiter(chain.from_iterable(polys), np.float64, int(coord_n.sum()))
    seg_kind = np.fromiter((SEG_POLY if t is list else SEG_MISSING if s_ is None else SEG_RLE
                            for s_, t in zip(segs, types)), np.int8, na)
    rles = {i: {"size": segs[i].size, "counts": segs[i].counts}
            for i in np.flatnonzero(seg_kind == SEG_RLE).tolist()}
    kps = list(map(attrgetter("keypoints"), anns))
    kp_len = np.fromiter((-1 if k is None else len(k) for k in kps), np.int64, na)
    kp_vals = np.fromiter(chain.from_iterable(k for k in kps if k is not None), np.float64,
                          int(np.maximum(kp_len, 0).sum()))
    return RawCoco(
        source=source, categories=cats, img_id=img_id, img_w=img_w, img_h=img_h,
        file_names=names, ann_id=np.fromiter(map(attrgetter("id"), anns), np.int64, na),
        ann_img=np.fromiter(map(attrgetter("image_id"), anns), np.int64, na),
        ann_cat=np.fromiter(map(attrgetter("category_id"), anns), np.int64, na),
        ann_bbox=bbox, ann_area=np.fromiter(map(attrgetter("area"), anns), np.float64, na),
        ann_crowd=np.fromiter(map(attrgetter("iscrowd"), anns), np.int64, na),
        ann_ignore=np.fromiter(map(attrgetter("ignore"), anns), np.float64, na),
        seg_kind=seg_kind, poly_n=poly_n, coord_n=coord_n, coords=coords, rles=rles,
        kp_len=kp_len, kp_vals=kp_vals, decoder="fast")
