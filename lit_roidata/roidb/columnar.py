"""The columnar, memory-mapped ``RoIDB`` and its Detectron-style entry view.

Layout (one ``.npy`` file per column in the cache directory, opened with
``np.load(mmap_mode="r")``, so every rank and DataLoader worker shares one copy in the
page cache):

* images (originals of all datasets, in Detectron order): ``img_id``, ``img_width``,
  ``img_height``, ``img_dataset``, ``img_path_bytes`` + ``img_path_off``,
  ``img_has_vis_kp``, ``img_gt_off``, ``img_prop_off``;
* gt rows: ``gt_boxes``, ``gt_classes``, ``gt_seg_areas``, ``gt_is_crowd``,
  ``gt_keypoints`` and the ``segm_*`` columns (:mod:`lit_roidata.roidb.segms`);
* proposal rows: ``prop_boxes``, ``prop_max_overlaps``, ``prop_max_classes``,
  ``prop_gt_map`` (the last two in the narrowest integer dtype their values fit,
  :func:`lit_roidata.roidb.proposals.proposal_dtypes`, or int32 in caches written before;
  entries widen them to Detectron's int64 / int32 either way);
* entries (after flipping and filtering): ``entry_img`` and ``entry_flipped``;
* LVIS only (a roidb with an LVIS dataset): ``img_neg_off`` + ``neg_classes`` and
  ``img_nexh_off`` + ``nexh_classes``, each image's ``neg_category_ids`` /
  ``not_exhaustive_category_ids`` as contiguous class ids (:mod:`lit_roidata.roidb.lvis`).

A flipped entry is the index of its original plus a flag; boxes, segms and keypoints
are mirrored when read (Detectron semantics: flipping). ``gt_overlaps`` is rebuilt from
``max_overlaps`` and ``max_classes``: every row holds one non-zero value or is all -1
(Detectron semantics: ground-truth cleaning; proposals).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Iterator, Mapping, Optional

import numpy as np
import scipy.sparse

from lit_roidata.boxes import flip_boxes
from lit_roidata.osutil import map_readonly
from lit_roidata.roidb.cache import CacheError, hold_in_use, npy_data_offset, validate_cache
from lit_roidata.roidb.info import DatasetInfo
from lit_roidata.roidb.lvis import IMAGE_LIST_COLUMNS
from lit_roidata.roidb.segms import SegmColumns, decode_segms
from lit_roidata.roidb.targets import compute_bbox_targets

__all__ = ["RoIDB", "RoIEntry", "ENTRY_FIELDS", "LVIS_ENTRY_FIELDS", "flip_keypoints"]

#: The fields of every entry (``gt_keypoints`` only for datasets with keypoints).
ENTRY_FIELDS = ("image", "id", "width", "height", "flipped", "boxes", "gt_classes",
                "seg_areas", "gt_overlaps", "is_crowd", "box_to_gt_ind_map", "max_classes",
                "max_overlaps", "bbox_targets", "segms", "gt_keypoints",
                "has_visible_keypoints", "dataset")
_FIELDS_NO_KEYPOINTS = tuple(k for k in ENTRY_FIELDS if k != "gt_keypoints")
#: Entry fields that are one image column's value: field -> (column, type)
_IMAGE_VALUES = {"id": ("img_id", int), "width": ("img_width", int),
                 "height": ("img_height", int), "has_visible_keypoints": ("img_has_vis_kp", bool)}
#: Entry fields of gt rows only (proposal rows get ``fill``): field -> the ``_rows``
#: arguments (column, no proposal column, fill, dtype)
_GT_ONLY = {"gt_classes": ("gt_classes", None, 0, np.int32),
            "seg_areas": ("gt_seg_areas", None, 0, np.float32),
            "is_crowd": ("gt_is_crowd", None, False, bool)}
#: Fields added to every entry of a roidb with an LVIS dataset: int32 contiguous class
#: ids (like ``gt_classes``), JSON order; empty for images of COCO datasets.
LVIS_ENTRY_FIELDS = tuple(IMAGE_LIST_COLUMNS)


def flip_keypoints(kps: np.ndarray, info: DatasetInfo, width: int) -> np.ndarray:
    """Detectron's ``flip_keypoints`` (Detectron semantics: flipping): swap left/right, mirror x,
    zero x where v=0."""
    out = kps.copy()
    names = list(info.keypoints or ())
    for left, right in (info.keypoint_flip_map or {}).items():
        li, ri = names.index(left), names.index(right)
        out[:, :, [li, ri]] = kps[:, :, [ri, li]]
    out[:, 0, :] = width - out[:, 0, :] - 1
    out[:, 0, :][out[:, 2, :] == 0] = 0  # x of invisible keypoints
    return out


def _load(path: str, rec: dict) -> np.ndarray:
    """Memory-map one array file of a cache (never unpickles, holds no file descriptor);
    errors name the file."""
    fn = os.path.join(path, rec["file"])
    try:
        offset = npy_data_offset(fn, rec)
        if offset is not None:
            return map_readonly(fn, rec["dtype"], offset, tuple(rec["shape"]))
        return np.asarray(np.load(fn, mmap_mode="r", allow_pickle=False))
    except (OSError, ValueError) as exc:
        raise CacheError(f"{fn}: cannot be opened as a roidb array ({exc}); the cache is "
                         f"damaged: delete {path} (or `lit-roidata cache clean`) and it is "
                         f"rebuilt") from None


def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _per_entry(column: str, doc: str) -> functools.cached_property:
    """A cached read-only property: image column ``column`` gathered per entry."""
    def get(self: "RoIDB") -> np.ndarray:
        return _ro(np.asarray(self._a[column])[self._entry_img])
    get.__doc__ = doc
    return functools.cached_property(get)


class RoIDB:
    """Detectron's combined roidb, columnar and memory-mapped (Detectron semantics: roidb building).

    ``len(roidb)`` entries; ``roidb[i]`` is a read-only :class:`RoIEntry` mapping with
    Detectron's field names. ``widths``, ``heights``, ``ids`` and ``flipped`` are
    per-entry arrays for code that must not touch every entry (aspect grouping).
    Pickling stores only the cache path: a worker re-opens the memory maps.

    Args:
        path: a cache directory written by the builder.
    """

    def __init__(self, path: str, manifest: Optional[dict] = None) -> None:
        self.path = os.path.abspath(path)
        self.manifest = manifest = validate_cache(self.path) if manifest is None else manifest
        # Plain ndarray views of the memory maps: slicing an np.memmap costs Python-level
        # __getitem__/__array_finalize__ calls on every access.
        self._a = {name: _load(self.path, rec) for name, rec in manifest["arrays"].items()}
        hold_in_use(self.path, self)  # `lit-roidata cache clean` skips it while self lives
        self.datasets: tuple[DatasetInfo, ...] = tuple(
            DatasetInfo.from_json(d) for d in manifest["datasets"])
        t = manifest["targets"]
        self._targets_cfg = (float(t["bbox_thresh"]), bool(t["cls_agnostic"]),
                             tuple(float(w) for w in t["weights"]))
        a = self._a
        self._entry_img = _ro(np.asarray(a["entry_img"], np.int64))
        self.flipped: np.ndarray = _ro(np.asarray(a["entry_flipped"], bool))
        self._segms = SegmColumns.from_arrays(a)
        self._image_lists = {key: (a[o], a[c]) for key, (o, c) in IMAGE_LIST_COLUMNS.items()
                             if o in a}
        extra = tuple(self._image_lists)
        self._fields = (ENTRY_FIELDS + extra, _FIELDS_NO_KEYPOINTS + extra)

    # Per-entry image columns, gathered on first use (aspect grouping needs them; opening
    # the roidb, and a worker reading entries, do not).
    widths = _per_entry("img_width", "Image width of every entry (read-only).")
    heights = _per_entry("img_height", "Image height of every entry (read-only).")
    ids = _per_entry("img_id", "Image id of every entry (read-only).")

    @property
    def entry_image_rows(self) -> np.ndarray:
        """The image-table row of every entry (read-only int64, ``len(self)``); an
        original and its flipped copy share it."""
        return self._entry_img

    def column(self, name: str) -> np.ndarray:
        """The cache column ``name`` (read-only), e.g. ``img_gt_off`` or ``gt_classes``
        (the layout is in the module doc).

        Raises:
            KeyError: no such column (the message lists them).
        """
        try:
            return self._a[name]
        except KeyError:
            raise KeyError(f"no roidb column {name!r}; columns: {sorted(self._a)}") from None

    # ------------------------------------------------------------------ sequence
    def __len__(self) -> int:
        return int(self._entry_img.size)

    def __getitem__(self, i: int) -> "RoIEntry":
        n = len(self)
        i = int(i) + n if int(i) < 0 else int(i)
        if not 0 <= i < n:
            raise IndexError(f"roidb index {i} out of range for {n} entries")
        return RoIEntry(self, i)

    def __iter__(self) -> Iterator["RoIEntry"]:
        return (RoIEntry(self, i) for i in range(len(self)))

    def dataset_of(self, i: int) -> str:
        """Catalog name of the dataset entry ``i`` comes from."""
        return self.datasets[self.dataset_index(i)].name

    def dataset_index(self, i: int) -> int:
        """Position in :attr:`datasets` of entry ``i``'s dataset."""
        return int(self._a["img_dataset"][self._entry_img[i]])

    def image_index(self, i: int) -> int:
        """Row of entry ``i`` in the image table (originals and flips share it)."""
        return int(self._entry_img[i])

    @property
    def report(self) -> dict:
        """The build report kept with the cache (counts by reason, histogram)."""
        return self.manifest.get("report", {})

    def __getstate__(self) -> dict:
        return {"path": self.path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])

    def __repr__(self) -> str:
        names = ", ".join(d.name for d in self.datasets)
        return f"RoIDB({len(self)} entries from [{names}], cache={self.path!r})"


class RoIEntry(Mapping):
    """A read-only view of one roidb entry with Detectron's field names (Detectron semantics: roidb
    building).

    Fields are computed on first access and memoised: RPN code that reads only
    ``boxes`` and ``gt_classes`` never pays for ``segms`` or ``bbox_targets``.
    Use :meth:`to_dict` for a plain dict (e.g. to pickle an entry).
    """

    __slots__ = ("_db", "_i", "_img", "_cache", "_info")

    def __init__(self, db: RoIDB, i: int) -> None:
        self._db, self._i, self._img = db, i, int(db._entry_img[i])
        self._info = db.datasets[int(db._a["img_dataset"][self._img])]
        self._cache: dict[str, Any] = {}

    def _keys(self) -> tuple[str, ...]:
        return self._db._fields[self._info.keypoints is None]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __contains__(self, key: object) -> bool:
        return key in self._keys()

    def __getitem__(self, key: str) -> Any:
        if key in self._cache:
            return self._cache[key]
        if key not in self._keys():
            raise KeyError(key)
        if key in _IMAGE_VALUES:
            col, typ = _IMAGE_VALUES[key]
            value = typ(self._a[col][self._img])
        elif key in _GT_ONLY:
            value = self._rows(*_GT_ONLY[key])
        elif key in self._db._image_lists:  # LVIS: the image's class list
            off, classes = self._db._image_lists[key]
            value = np.array(classes[self._span(off)], np.int32)
        else:
            value = getattr(self, "_f_" + key)()
        self._cache[key] = value = _ro(value) if isinstance(value, np.ndarray) else value
        return value

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict."""
        return {k: self[k] for k in self._keys()}

    def __repr__(self) -> str:
        return (f"RoIEntry(index={self._i}, id={self['id']}, flipped={self['flipped']}, "
                f"rows={self['boxes'].shape[0]}, dataset={self._info.name!r})")

    # ------------------------------------------------------------------ helpers
    @property
    def _a(self) -> Mapping[str, np.ndarray]:
        return self._db._a

    def _span(self, off: Any) -> slice:
        """This image's rows of the column ``off`` (an offset column, or its name) indexes."""
        off = self._a[off] if isinstance(off, str) else off
        return slice(int(off[self._img]), int(off[self._img + 1]))

    def _gt(self, col: str, dtype: Any) -> np.ndarray:
        return np.asarray(self._a[col][self._span("img_gt_off")], dtype)

    def _prop(self, col: str, dtype: Any) -> np.ndarray:
        return np.asarray(self._a[col][self._span("img_prop_off")], dtype)

    def _rows(self, gt_col: str, prop_col: Optional[str], prop_fill: Any = 0,
              dtype: Any = None) -> np.ndarray:
        gt = self._gt(gt_col, None)
        dtype = dtype or gt.dtype
        p = self._span("img_prop_off")
        if p.stop == p.start:
            return np.array(gt, dtype=dtype)
        tail = (self._prop(prop_col, dtype) if prop_col is not None else
                np.full((p.stop - p.start,) + gt.shape[1:], prop_fill, dtype=dtype))
        return np.concatenate([gt.astype(dtype), tail])

    # ------------------------------------------------------------------ fields
    def _f_image(self) -> str:
        return bytes(np.asarray(self._a["img_path_bytes"][self._span("img_path_off")])
                     ).decode("utf-8")

    def _f_flipped(self) -> bool:
        return bool(self._db.flipped[self._i])

    def _f_boxes(self) -> np.ndarray:
        boxes = self._rows("gt_boxes", "prop_boxes", dtype=np.float32)
        return flip_boxes(boxes, self["width"]) if self["flipped"] else boxes

    def _f_box_to_gt_ind_map(self) -> np.ndarray:
        g = self._span("img_gt_off")
        gt = np.arange(g.stop - g.start, dtype=np.int32)
        return np.concatenate([gt, self._prop("prop_gt_map", np.int32)])

    def _f_max_overlaps(self) -> np.ndarray:
        gt = np.where(self._gt("gt_is_crowd", bool), -1, 1).astype(np.float32)
        return np.concatenate([gt, self._prop("prop_max_overlaps", np.float32)])

    def _f_max_classes(self) -> np.ndarray:
        gt = np.where(self._gt("gt_is_crowd", bool), 0, self._gt("gt_classes", np.int64))
        return np.concatenate([gt, self._prop("prop_max_classes", np.int64)])

    def _f_gt_overlaps(self) -> scipy.sparse.csr_matrix:
        mo, mc = self["max_overlaps"], self["max_classes"]
        dense = np.zeros((mo.size, self._info.num_classes), np.float32)
        pos = mo > 0
        dense[np.flatnonzero(pos), mc[pos]] = mo[pos]
        dense[mo == -1] = -1
        return scipy.sparse.csr_matrix(dense)

    def _f_bbox_targets(self) -> np.ndarray:
        thresh, agnostic, weights = self._db._targets_cfg
        return compute_bbox_targets(self["boxes"], self["max_overlaps"], self["max_classes"],
                                    self["gt_classes"], self["is_crowd"], bbox_thresh=thresh,
                                    cls_agnostic=agnostic, weights=weights)

    def _f_segms(self) -> list:
        g = self._span("img_gt_off")
        return decode_segms(self._db._segms, g.start, g.stop, flipped=self["flipped"],
                            width=self["width"], height=self["height"])

    def _f_gt_keypoints(self) -> np.ndarray:
        kps = self._gt("gt_keypoints", np.int32)[:, :, :self._info.num_keypoints].copy()
        return flip_keypoints(kps, self._info, self["width"]) if self["flipped"] else kps

    def _f_dataset(self) -> DatasetInfo:
        return self._info
