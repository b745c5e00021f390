"""Dataset catalog: name → image directory, annotation file (COCO, LVIS, VOC), image prefix;
or name → a function returning Detectron2's standard dataset dicts.

Detectron's built-in COCO (and VOC-as-COCO-json) names, Detectron2's LVIS v1 and VOC names,
resolved under a data root chosen at lookup time (``data_root=`` or
``LIT_ROIDATA_DATA_ROOT``), plus the user's own datasets from Python or a YAML file (see
docs/catalog.md). ``DatasetCatalog`` is the process-wide default; build a
:class:`Catalog` for isolation.
"""

from __future__ import annotations

import difflib
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import yaml

from lit_roidata.storage import is_url

__all__ = ["DatasetSpec", "Catalog", "DatasetCatalog", "builtin_datasets", "DATA_ROOT_ENV",
           "FORMATS"]

#: Annotation formats a dataset can be registered with.
FORMATS = ("coco", "lvis", "voc")

#: Environment variable naming the directory built-in datasets live under.
DATA_ROOT_ENV = "LIT_ROIDATA_DATA_ROOT"
_DEFAULT_DATA_ROOT = "data"

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class DatasetSpec:
    """Where one dataset lives (Detectron's catalog record, Detectron semantics: datasets and
    catalog).

    Attributes:
        name: catalog name.
        image_dir: directory (or folder URL, e.g. ``s3://bucket/images``) of the images.
        annotation_file: COCO- or LVIS-format JSON file (a path or URL); for VOC, the split
            list ``<VOC root>/ImageSets/Main/<split>.txt``.
        image_prefix: prepended to each ``file_name`` (Detectron's ``IM_PREFIX``).
        proposal_file: optional default proposal file for this dataset.
        format: ``"coco"`` or ``"lvis"`` (file names from ``coco_url``, categories by
            sorted id, per-image neg / not-exhaustive category lists; see
            :mod:`lit_roidata.roidb.lvis`), ``"voc"`` (a Pascal VOC tree,
            :mod:`lit_roidata.roidb.voc`) or ``"dicts"`` for a registered function.
        function: returns the records (Detectron2's standard dataset dicts), or ``None``.
        thing_classes: the class names of a function's contiguous category ids 0..K-1.
        keypoint_names: the keypoint names of its ``person`` class, or ``None``.
        version: the cache key of a function's records (``None``: their content).
    """

    name: str
    image_dir: str
    annotation_file: str
    image_prefix: str = ""
    proposal_file: Optional[str] = None
    format: str = "coco"
    function: Optional[Callable[[], Iterable[Mapping]]] = None
    thing_classes: tuple = ()
    keypoint_names: Optional[tuple] = None
    version: Optional[str] = None


def _detectron_builtins() -> dict[str, tuple[str, str, str]]:
    """Detectron's built-in names -> (image dir, annotation file, image prefix) relative to
    the data root, in the order of ``detectron/datasets/dataset_catalog.py``."""
    out: dict[str, tuple[str, str, str]] = {}

    def coco(name: str, im_dir: str, ann: str, prefix: str = "") -> None:
        out[name] = ("coco/" + im_dir, "coco/annotations/" + ann, prefix)

    for kp, kind in (("", "instances"), ("keypoints_", "person_keypoints")):
        for split in ("train", "val", "minival", "valminusminival"):
            im_dir = "coco_train2014" if split == "train" else "coco_val2014"
            coco(f"{kp}coco_2014_{split}", im_dir, f"{kind}_{split}2014.json")
        for split in ("test", "test-dev"):
            coco(f"{kp}coco_2015_{split}", "coco_test2015", f"image_info_{split}2015.json")
        for split in ("train", "val"):
            coco(f"{kp}coco_2017_{split}", f"coco_{split}2017", f"{kind}_{split}2017.json")
        for split in () if kp else ("test", "test-dev"):
            coco(f"coco_2017_{split}", "coco_test2015", f"image_info_{split}2017.json",
                 "COCO_test2015_")
    for year, splits in (("2007", ("train", "val", "test")), ("2012", ("train", "val"))):
        for split in splits:
            out[f"voc_{year}_{split}"] = (f"VOC{year}/JPEGImages",
                                          f"VOC{year}/annotations/voc_{year}_{split}.json", "")
    return out


_BUILTIN = _detectron_builtins()


#: Detectron2's LVIS v1 names and layout (``detectron2/data/datasets/builtin.py``): the
#: images are COCO's, under ``coco/``; each file name is ``train2017/<file>`` or
#: ``val2017/<file>``, taken from the image's ``coco_url``.
_BUILTIN_LVIS = {f"lvis_v1_{split}": ("coco", f"lvis/lvis_v1_{file}.json", "")
                 for split, file in (("train", "train"), ("val", "val"),
                                     ("test_dev", "image_info_test_dev"),
                                     ("test_challenge", "image_info_test_challenge"))}
_BUILTIN.update(_BUILTIN_LVIS)

#: Detectron2's Pascal VOC names (``register_all_pascal_voc``): VOC tree, split. Where
#: Detectron's COCO-json name is the same, the json wins if it exists.
_BUILTIN_VOC = {f"voc_{y}_{s}": (f"VOC{y}", s) for y, splits in
                (("2007", ("trainval", "train", "val", "test")),
                 ("2012", ("trainval", "train", "val"))) for s in splits}
_BUILTIN_NAMES = (*_BUILTIN, *(n for n in _BUILTIN_VOC if n not in _BUILTIN))


def _builtin_spec(name: str, root: str) -> DatasetSpec:
    if name in _BUILTIN_VOC and (name not in _BUILTIN
                                 or not os.path.isfile(os.path.join(root, _BUILTIN[name][1]))):
        voc, split = _BUILTIN_VOC[name]
        return DatasetSpec(name, os.path.join(root, voc, "JPEGImages"), os.path.join(
            root, voc, "ImageSets", "Main", split + ".txt"), format="voc")
    im, ann, prefix = _BUILTIN[name]
    return DatasetSpec(name, os.path.join(root, im), os.path.join(root, ann), prefix,
                       format="lvis" if name in _BUILTIN_LVIS else "coco")


def builtin_datasets(data_root: PathLike) -> dict[str, DatasetSpec]:
    """The built-in dataset names (Detectron's, and Detectron2's LVIS v1 and VOC) resolved
    under ``data_root``."""
    root = os.fspath(data_root)
    return {name: _builtin_spec(name, root) for name in _BUILTIN_NAMES}


def _check_format(fmt: Any, where: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"{where}: format={fmt!r}; choose one of {list(FORMATS)} (an LVIS "
                         f"json is 'lvis', a Pascal VOC tree 'voc')")
    return str(fmt)


class Catalog:
    """A registry of datasets by name, with Detectron's built-ins under a data root.

    User registrations win over built-ins of the same name. Built-ins are resolved at
    :meth:`get` time, so setting the data root (or the ``LIT_ROIDATA_DATA_ROOT``
    variable) after import still takes effect.

    Args:
        data_root: directory of the built-in datasets; ``None`` reads
            ``LIT_ROIDATA_DATA_ROOT`` at lookup time (default ``./data``).
        builtins: include Detectron's built-in COCO/VOC names.
    """

    def __init__(self, data_root: Optional[PathLike] = None, *, builtins: bool = True) -> None:
        self._data_root = None if data_root is None else os.fspath(data_root)
        self._builtins = builtins
        self._user: dict[str, DatasetSpec] = {}
        self._lock = threading.Lock()

    @property
    def data_root(self) -> str:
        """The directory built-in datasets are resolved under."""
        return (self._data_root if self._data_root is not None
                else os.environ.get(DATA_ROOT_ENV, _DEFAULT_DATA_ROOT))

    def set_data_root(self, data_root: Optional[PathLike]) -> None:
        """Set (or with ``None`` reset to the environment default) the data root."""
        self._data_root = None if data_root is None else os.fspath(data_root)

    def register(self, name: str, image_dir: Union[PathLike, Callable[[], Iterable[Mapping]]],
                 annotation_file: Optional[PathLike] = None, image_prefix: str = "", *,
                 proposal_file: Optional[PathLike] = None, overwrite: bool = False,
                 format: str = "coco", thing_classes: Optional[Sequence[str]] = None,
                 keypoint_names: Optional[Sequence[str]] = None,
                 version: Optional[str] = None) -> DatasetSpec:
        """Register a dataset under ``name``: files, or a function (Detectron2's
        ``DatasetCatalog.register(name, func)``, see docs/custom_datasets.md).

        Args:
            name: catalog name used in ``TRAIN.DATASETS``.
            image_dir: directory (or folder URL: ``s3://``, ``gs://``, ``az://``,
                ``http(s)://``) holding the images; or a function returning Detectron2's
                standard dataset dicts (a list or a generator).
            annotation_file: COCO- or LVIS-format JSON (a path or URL); for VOC the split
                list ``<VOC root>/ImageSets/Main/<split>.txt`` (files only).
            image_prefix: prepended to every ``file_name`` (files only).
            proposal_file: optional default proposal file.
            overwrite: allow replacing an existing user registration.
            format: ``"coco"`` (default), ``"lvis"`` or ``"voc"``. For LVIS v1 files,
                ``image_dir`` is the COCO folder holding ``train2017/`` and ``val2017/``;
                for VOC, ``<VOC root>/JPEGImages``.
            thing_classes: a function's class names, by its contiguous ``category_id``
                0..K-1 (Detectron2's ``MetadataCatalog`` ``thing_classes``); required there.
            keypoint_names: a function's keypoint names of the class ``"person"``.
            version: a function's cache key; ``None`` hashes the records on every open.

        Returns:
            The registered :class:`DatasetSpec`.

        Raises:
            ValueError: empty name, unknown format, missing ``annotation_file`` or
                ``thing_classes``, or ``name`` already registered and not ``overwrite``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"dataset name must be a non-empty string, got {name!r}")
        proposal = None if proposal_file is None else os.fspath(proposal_file)
        if callable(image_dir):
            classes = (thing_classes,) if isinstance(thing_classes, str) else thing_classes
            if not classes or not all(isinstance(c, str) for c in classes):
                raise ValueError(
                    f"dataset {name!r}: a registered function needs thing_classes=[class "
                    f"names], one per contiguous category_id 0..K-1 (Detectron2's "
                    f"MetadataCatalog.get({name!r}).thing_classes), got {thing_classes!r}")
            spec = DatasetSpec(  # file names are the records' own (full) paths
                name, "", f"<function {getattr(image_dir, '__qualname__', image_dir)!s}>", "",
                proposal, "dicts", image_dir, tuple(classes),
                None if keypoint_names is None else tuple(map(str, keypoint_names)),
                None if version is None else str(version))
        elif annotation_file is None:
            raise ValueError(f"dataset {name!r}: give an annotation_file with the image_dir, "
                             f"or register a function returning Detectron2's dataset dicts")
        else:
            spec = DatasetSpec(name, os.fspath(image_dir), os.fspath(annotation_file),
                               str(image_prefix or ""), proposal,
                               _check_format(format, f"dataset {name!r}"))
        with self._lock:
            old = self._user.get(name)
            if old is not None and old != spec and not overwrite:
                raise ValueError(f"dataset {name!r} is already registered as {old}; pass "
                                 "overwrite=True to replace it or choose another name")
            self._user[name] = spec
        return spec

    def unregister(self, name: str) -> None:
        """Remove a user registration (built-ins cannot be removed)."""
        with self._lock:
            self._user.pop(name, None)

    def get(self, name: str) -> DatasetSpec:
        """The :class:`DatasetSpec` registered as ``name``.

        Raises:
            KeyError: unknown name; the message lists the known names and the nearest one.
        """
        if name in self._user:
            return self._user[name]
        if self._builtins and name in _BUILTIN_NAMES:
            return _builtin_spec(name, self.data_root)
        known = self.names()
        near = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise KeyError(f"dataset {name!r} is not in the catalog.{hint} Register it with "
                       "DatasetCatalog.register(name, image_dir, annotation_file) or a catalog "
                       f"YAML. Known datasets: {', '.join(known)}")

    def names(self) -> list[str]:
        """All known names: user registrations first (in order), then built-ins."""
        return list(self._user) + ([n for n in _BUILTIN_NAMES if n not in self._user]
                                    if self._builtins else [])

    def __contains__(self, name: object) -> bool:
        return name in self._user or (self._builtins and name in _BUILTIN_NAMES)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def copy(self) -> "Catalog":
        """An independent catalog with the same registrations and data root."""
        out = Catalog(self._data_root, builtins=self._builtins)
        out._user = dict(self._user)  # specs are immutable
        return out

    def load_yaml(self, path: PathLike, *, overwrite: bool = False) -> list[str]:
        """Register the datasets listed in a YAML file; returns their names.

        Format (relative paths resolve against ``data_root`` if given, else the YAML
        file's directory)::

            data_root: /data            # optional
            datasets:
              my_train:
                image_dir: my/images
                annotation_file: my/annotations/train.json
                image_prefix: ""        # optional
                proposal_file: null     # optional
                format: coco            # optional: coco (default), lvis or voc

        A top-level ``data_root`` without ``datasets`` just sets this catalog's root
        for built-ins (``builtin_data_root: true`` does it alongside datasets too).

        Raises:
            ValueError: malformed file or entry (names the file and the entry).
        """
        path = os.fspath(path)
        with open(path, encoding="utf-8") as fh:
            try:
                data = yaml.safe_load(fh) or {}
            except yaml.YAMLError as exc:
                raise ValueError(f"{path}: not valid YAML: {exc}") from exc
        return self.load_dict(data, base_dir=os.path.dirname(os.path.abspath(path)),
                              source=path, overwrite=overwrite)

    def load_dict(self, data: Mapping[str, Any], *, base_dir: str = ".", source: str = "<dict>",
                  overwrite: bool = False) -> list[str]:
        """Register datasets from a mapping shaped like :meth:`load_yaml`'s file."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{source}: expected a mapping at the top level")
        if unknown := set(data) - {"data_root", "datasets", "builtin_data_root"}:
            raise ValueError(f"{source}: unknown top-level keys {sorted(unknown)}; expected "
                             f"'datasets' and optionally 'data_root'")
        if (root := data.get("data_root")) is not None:
            root = os.path.join(base_dir, os.path.expanduser(str(root)))
            if "datasets" not in data or data.get("builtin_data_root"):
                self.set_data_root(root)
        base = root if root is not None else base_dir
        if not isinstance((entries := data.get("datasets") or {}), Mapping):
            raise ValueError(f"{source}: 'datasets' must map names to entries")
        fields = {"image_dir", "annotation_file", "image_prefix", "proposal_file", "format"}
        names = []
        for name, entry in entries.items():
            if not isinstance(entry, Mapping):
                raise ValueError(f"{source}: dataset {name!r} must be a mapping with keys "
                                 f"{sorted(fields)}")
            bad, missing = set(entry) - fields, {"image_dir", "annotation_file"} - set(entry)
            if bad or missing:
                raise ValueError(f"{source}: dataset {name!r}: unknown keys {sorted(bad)}, "
                                 f"missing keys {sorted(missing)}")

            def res(p: Optional[str]) -> Optional[str]:
                return None if p is None else str(p) if is_url(p) else os.path.join(
                    base, os.path.expanduser(str(p)))

            self.register(str(name), res(entry["image_dir"]), res(entry["annotation_file"]),
                          str(entry.get("image_prefix") or ""),
                          proposal_file=res(entry.get("proposal_file")), overwrite=overwrite,
                          format=_check_format(entry.get("format", "coco"),
                                               f"{source}: dataset {name!r}"))
            names.append(str(name))
        return names

    def __repr__(self) -> str:
        return (f"Catalog(data_root={self.data_root!r}, user={list(self._user)}, "
                f"builtins={self._builtins})")


#: The process-wide default catalog (user registrations + Detectron's built-ins).
DatasetCatalog = Catalog()
