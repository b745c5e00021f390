"""``combined_roidb_for_training`` and ``roidb_for_evaluation``: inputs → cached ``RoIDB``."""

from __future__ import annotations

import dataclasses
import difflib
import gc
import logging
import os
import time
from collections import Counter
from contextlib import closing
from operator import methodcaller
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from lit_roidata._pickle_trust import warn_trusted
from lit_roidata.catalog import Catalog, DatasetCatalog, DatasetSpec
from lit_roidata.config import DetectronConfig, blob_family, get_cfg
from lit_roidata.osutil import keep_freed_memory, no_transparent_hugepages
from lit_roidata.roidb.cache import (ArrayWriter, cache_key, default_cache_dir, file_fingerprint,
                                     get_or_build)
from lit_roidata.roidb.coco import GtTable, load_coco_json
from lit_roidata.roidb.dicts import load_records, records_digest
from lit_roidata.roidb.filters import filter_entries, trainable_images
from lit_roidata.roidb.info import RoIDBInputError
from lit_roidata.roidb.lvis import IMAGE_LIST_COLUMNS, decode_lvis, lvis_image_lists
from lit_roidata.roidb.proposals import (ProposalColumns, build_proposal_table,
                                         empty_proposal_table)
from lit_roidata.roidb.proposal_files import (PickleReadAhead, is_pickle,
                                              untrusted_proposal_pickle)
from lit_roidata.roidb.report import BuildProgress, log_report
from lit_roidata.roidb.voc import voc_source
from lit_roidata.roidb.segms import SegmColumns, concat, concat_offsets, offsets
from lit_roidata.roidb.workers import OrderedWorkers, WorkerDied, WorkerFailed
from lit_roidata.roidb.columnar import RoIDB
from lit_roidata.storage import fetch_to_cache, is_url, list_names, object_fingerprint

__all__ = ["combined_roidb_for_training", "roidb_for_evaluation", "CATEGORY_POLICIES",
           "check_training_config"]

logger = logging.getLogger("lit_roidata.roidb")

#: How categories of several datasets are reconciled (Detectron quirk Q22,
# docs/detectron_quirks.md).
CATEGORY_POLICIES = ("strict", "detectron", "by_name")
MIN_PROPOSAL_SIZE = 2  # Detectron's get_roidb default (Detectron semantics: roidb building)

Names = Union[str, Sequence[str]]


def combined_roidb_for_training(
    dataset_names: Names, proposal_files: Union[None, str, Sequence[Optional[str]]] = (),
    cfg: Optional[DetectronConfig] = None, cache_dir: Optional[str] = None, *,
    catalog: Optional[Catalog] = None, category_policy: str = "strict",
    check_images: bool = True, progress: Optional[bool] = None, rebuild: bool = False,
    verify: Optional[bool] = None, trust_pickle: bool = False,
) -> RoIDB:
    """Detectron's training roidb (Detectron semantics: roidb building), columnar and cached.

    Args:
        dataset_names: catalog name(s), concatenated in order (``TRAIN.DATASETS``).
        proposal_files: one per dataset (``TRAIN.PROPOSAL_FILES``) or empty for none.
        cfg: Detectron config (``TRAIN.*``, ``MODEL.KEYPOINTS_ON``, ``MODEL.BBOX_REG_*``).
        cache_dir: cache root; default ``$LIT_ROIDATA_CACHE`` or ``~/.cache/lit_roidata``.
        category_policy: ``"strict"`` (category lists must agree, else a diff is shown),
            ``"detectron"`` (no reconciling, Detectron quirk Q22) or ``"by_name"``.
        verify: check a cache's array checksums: ``None`` on the first open after each
            boot, ``True`` always, ``False`` never (a damaged cache is rebuilt).
        trust_pickle: allow proposal pickles (unpickling runs code; ``.npz`` needs none).
        catalog, check_images, progress, rebuild: see docs/roidb.md.

    Returns the memory-mapped :class:`RoIDB`. Raises KeyError (unknown dataset name),
    RoIDBInputError (bad input: names the file, image id and fix), ValueError.
    """
    cfg = cfg if cfg is not None else get_cfg()
    t = cfg.TRAIN
    options = {"mode": "train", "gt_min_area": float(t.GT_MIN_AREA),
               "crowd_filter_thresh": float(t.CROWD_FILTER_THRESH),
               "proposal_limit": int(t.PROPOSAL_LIMIT), "min_proposal_size": MIN_PROPOSAL_SIZE,
               "use_flipped": bool(t.USE_FLIPPED), "filter": True, "fg_thresh": float(t.FG_THRESH),
               "bg_thresh_hi": float(t.BG_THRESH_HI), "bg_thresh_lo": float(t.BG_THRESH_LO),
               "keypoints_on": bool(cfg.MODEL.KEYPOINTS_ON)}
    return _open_or_build(dataset_names, proposal_files, cfg, options, cache_dir, catalog,
                          category_policy, check_images, progress, rebuild, verify, trust_pickle)


def roidb_for_evaluation(
    dataset_names: Names, cfg: Optional[DetectronConfig] = None,
    cache_dir: Optional[str] = None, proposal_files: Union[None, str, Sequence] = (),
    catalog: Optional[Catalog] = None, *, category_policy: str = "strict",
    check_images: bool = True, progress: Optional[bool] = None, rebuild: bool = False,
    verify: Optional[bool] = None, trust_pickle: bool = False,
) -> RoIDB:
    """Originals only, ascending id per dataset: no flipping, no ``filter_for_training``.

    For validation/test loaders and COCO evaluation. Gt is loaded and cleaned as for
    training; proposals use ``TEST.PROPOSAL_LIMIT`` and no crowd filter, as Detectron's
    test roidb does. Arguments as :func:`combined_roidb_for_training`.
    """
    cfg = cfg if cfg is not None else get_cfg()
    options = {"mode": "eval", "gt_min_area": float(cfg.TRAIN.GT_MIN_AREA),
               "crowd_filter_thresh": 0.0,
               "proposal_limit": int(cfg.TEST.get("PROPOSAL_LIMIT", -1)),
               "min_proposal_size": MIN_PROPOSAL_SIZE, "use_flipped": False, "filter": False}
    return _open_or_build(dataset_names, proposal_files, cfg, options, cache_dir, catalog,
                          category_policy, check_images, progress, rebuild, verify, trust_pickle)


def check_training_config(cfg: DetectronConfig, proposal_files: Any = (),
                          dataset_names: Names = ()) -> None:
    """Reject config values that make training impossible, before any roidb is built
    (docs/roidb.md): one ``ValueError`` lists every problem with the setting to change."""
    t, problems = cfg.TRAIN, []

    def pos_int(v: Any) -> bool:
        return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1

    def need(*checks: tuple) -> None:  # (setting, valid, what to give)
        problems.extend(f"TRAIN.{k}={t[k]!r}: {fix}" for k, ok, fix in checks if not ok)

    scales = t.SCALES if isinstance(t.SCALES, (list, tuple)) else (t.SCALES,)
    need(("IMS_PER_BATCH", pos_int(t.IMS_PER_BATCH),
          "images per GPU (per rank) must be an integer >= 1 (Detectron uses 2)"),
         ("SCALES", bool(scales) and all(pos_int(v) for v in scales),
          "give one or more shorter-side sizes in pixels, e.g. (800,)"),
         ("MAX_SIZE", pos_int(t.MAX_SIZE),
          "the longer-side cap must be an integer >= 1, e.g. 1333"),
         ("BATCH_SIZE_PER_IM", pos_int(t.BATCH_SIZE_PER_IM),
          "RoIs per image must be an integer >= 1 (Detectron uses 512)"),
         ("FG_FRACTION", 0.0 <= float(t.FG_FRACTION) <= 1.0, "must be in [0, 1]"))
    if float(t.BG_THRESH_LO) > float(t.BG_THRESH_HI):
        problems.append(f"TRAIN.BG_THRESH_LO={t.BG_THRESH_LO!r} > TRAIN.BG_THRESH_HI="
                        f"{t.BG_THRESH_HI!r}: no RoI could be background")
    family = blob_family(cfg)
    if family == "rpn":
        need(("RPN_BATCH_SIZE_PER_IM", pos_int(t.RPN_BATCH_SIZE_PER_IM),
              "anchors per image must be an integer >= 1 (Detectron uses 256)"),
             ("RPN_FG_FRACTION", 0.0 <= float(t.RPN_FG_FRACTION) <= 1.0, "must be in [0, 1]"))
    if family == "fast_rcnn":
        names, files = _normalise(dataset_names or ("?",), proposal_files)
        if any(f is None for f in files):
            missing = [n for n, f in zip(names, files) if f is None and dataset_names]
            problems.append(
                f"the model is a Fast R-CNN family model (no RPN, no RetinaNet), which trains "
                f"on precomputed proposals, but no proposal file is given"
                f"{' for ' + ', '.join(map(repr, missing)) if missing else ''}: it would train "
                f"on the gt boxes alone. Add proposal files (data.datasets.train_proposal_files or "
                f"TRAIN.PROPOSAL_FILES, one per dataset) or choose an end-to-end model_type "
                f"(faster_rcnn, mask_rcnn, keypoint_rcnn, retinanet, their _fpn variants)")
    if problems:
        raise ValueError("the training config cannot work:\n  - " + "\n  - ".join(problems))


def _normalise(dataset_names: Names, proposal_files: Any) -> tuple[tuple, tuple]:
    names = (dataset_names,) if isinstance(dataset_names, str) else tuple(dataset_names)
    if not names:
        raise ValueError("no datasets given; set TRAIN.DATASETS (catalog names)")
    if proposal_files is None or isinstance(proposal_files, (str, os.PathLike)):
        proposal_files = [proposal_files] if proposal_files else []  # None or "": none
    files = tuple(None if f in (None, "") else os.fspath(f) for f in proposal_files) \
        or (None,) * len(names)
    if len(files) != len(names):
        raise ValueError(f"{len(names)} dataset(s) {list(names)} but {len(files)} proposal "
                         f"file(s); give one proposal file per dataset, or none")
    return names, files


def _open_or_build(dataset_names, proposal_files, cfg, options, cache_dir, catalog,
                   category_policy, check_images, progress, rebuild, verify, trust_pickle):
    if category_policy not in CATEGORY_POLICIES:
        raise ValueError(f"category_policy={category_policy!r}; choose one of {CATEGORY_POLICIES}")
    names, files = _normalise(dataset_names, proposal_files)
    catalog = catalog if catalog is not None else DatasetCatalog
    specs = [catalog.get(n) for n in names]
    specs = [dataclasses.replace(s, **voc_source(s)) if s.format == "voc" else s for s in specs]
    root = os.path.abspath(cache_dir or default_cache_dir())
    os.makedirs(root, exist_ok=True)
    remote = {s.name: object_fingerprint(s.annotation_file) for s in specs
              if is_url(s.annotation_file)}  # (a HEAD: a warm cache downloads nothing)
    for spec in specs:
        if (spec.function is None and spec.name not in remote
                and not os.path.isfile(spec.annotation_file)):
            raise FileNotFoundError(
                f"dataset {spec.name!r}: annotation file {spec.annotation_file} does not exist; "
                f"fix the catalog entry (or the data root for built-in names)")
    for f in files:  # refused or warned about before any build, cached or not
        if f is not None and os.path.isfile(f) and is_pickle(f):
            if not trust_pickle:
                raise untrusted_proposal_pickle(f)
            warn_trusted(f, "proposal file")
    options = dict(options, category_policy=category_policy, check_images=bool(check_images),
                   bbox_thresh=float(cfg.TRAIN.BBOX_THRESH),
                   cls_agnostic=bool(cfg.MODEL.CLS_AGNOSTIC_BBOX_REG),
                   bbox_reg_weights=[float(w) for w in cfg.MODEL.BBOX_REG_WEIGHTS])
    inputs = [{"name": s.name, "image_prefix": s.image_prefix,
               "image_dir": s.image_dir if is_url(s.image_dir) else os.path.abspath(s.image_dir),
               "annotation": _records_key(s) if s.function is not None
               else remote.get(s.name) or file_fingerprint(s.annotation_file, root),
               "proposals": None if f is None else file_fingerprint(f, root),
               **({} if s.format == "coco" else {"format": s.format})}  # COCO keys as they were
              for s, f in zip(specs, files)]
    key = cache_key({"inputs": inputs, "options": options})

    def build(tmp: str) -> dict:
        local = [dataclasses.replace(s, annotation_file=fetch_to_cache(
            s.annotation_file, root, remote[s.name])) if s.name in remote else s for s in specs]
        return _in_child(_build, tmp, local, files, options, progress, inputs, trust_pickle)

    path, manifest, built = get_or_build(root, key, build, rebuild=rebuild, verify=verify)
    if built:
        log_report(manifest["report"])
        for w in manifest["report"].get("warnings", []):
            logger.warning("%s", w)
    db = RoIDB(path, manifest)
    logger.info("roidb %s: %d entries (%s)", "built" if built else "opened from cache",
                len(db), path)
    return db


def _records_key(spec: DatasetSpec) -> dict:
    """A registered function's cache key: its ``version``, else its records' content hash
    (the function runs once more for it, in the build worker)."""
    key = {"classes": list(spec.thing_classes), "keypoints": spec.keypoint_names}
    if spec.version is not None:
        return dict(key, version=spec.version)
    return dict(key, records=_in_child(lambda **_: records_digest(spec.function())))


def _check_categories(tables_cats: list, names: list, policy: str) -> None:
    if policy != "strict" or len(tables_cats) < 2:
        return
    ref = [f"{cid}: {n}" for cid, n in tables_cats[0]]
    for cats, name in zip(tables_cats[1:], names[1:]):
        cur = [f"{cid}: {n}" for cid, n in cats]
        if cur != ref:
            diff = "\n".join(difflib.unified_diff(ref, cur, names[0], name, lineterm="", n=1))
            raise RoIDBInputError(
                f"datasets {names[0]!r} and {name!r} have different categories (Detectron would "
                f"silently mix their class ids, Detectron quirk Q22, see docs/detectron_quirks.md)"
                f":\n{diff}\nMake the category lists identical, or pass category_policy='by_name' "
                f"(map by category name) or 'detectron' (keep Detectron's behaviour).")


def _in_child(fn, *args):
    """``fn(*args)`` run in a forked build worker, its errors raised here: parsing creates
    millions of objects (GBs) that vanish with the child, and the caller (a DDP rank that
    goes on to train) stays small. In-process without ``fork`` or with
    ``LIT_ROIDATA_BUILD_IN_PROCESS=1``."""
    if not hasattr(os, "fork") or os.environ.get("LIT_ROIDATA_BUILD_IN_PROCESS") == "1":
        return fn(*args)

    with OrderedWorkers(lambda _, state: fn(*args, forked=True), 1, daemon=False) as child:
        child.submit(None)
        try:
            return child.result()
        except WorkerDied as exc:
            raise RuntimeError(f"the roidb builder process died ({exc}); rerun with "
                               f"LIT_ROIDATA_BUILD_IN_PROCESS=1 to see the error in-process"
                               ) from None
        except WorkerFailed as exc:
            raise exc.__cause__ from None


def _build(tmp, specs, files, options, progress, inputs, trust_pickle=False, forked=False):
    # Parsing a COCO file creates millions of containers that hold no cycles: the cyclic
    # GC would rescan them over and over (several seconds at train2017 scale)
    was = gc.isenabled()
    gc.disable()
    try:
        with no_transparent_hugepages():
            return _build_inner(tmp, specs, files, options, progress, inputs, trust_pickle,
                                forked)
    finally:
        if was:
            gc.enable()


def _build_inner(tmp, specs, files, options, progress, inputs, trust_pickle, forked) -> dict:
    t0 = time.perf_counter()
    tables: list[GtTable] = []
    cats: list = []
    union: Optional[list] = [] if options["category_policy"] == "by_name" else None
    # proposal pickles are unpickled while the annotations decode
    with closing(PickleReadAhead(files, trust_pickle)) as ahead, BuildProgress(progress) as prog:
        for spec, pfile in zip(specs, files):
            with prog.task(f"{spec.name}: annotations", 3) as step:

                def categories_seen(categories: list) -> Optional[list]:
                    step()  # decoded; the categories are checked before the table is made
                    c = [(int(x["id"]), str(x["name"])) for x in categories
                         if isinstance(x, dict) and "id" in x and "name" in x]
                    cats.append(c)
                    _check_categories(cats, [s.name for s in specs[:len(cats)]],
                                      options["category_policy"])
                    if union is not None:
                        union.extend(n for _, n in c if n not in union)
                    return union

                # LVIS: decoded whole (federated lists), then cleaned; else window by window
                gt = {"gt_min_area": options["gt_min_area"], "categories_hook": categories_seen,
                      "keypoints_required": bool(options.get("keypoints_on"))}
                raw = decode_lvis(spec.annotation_file) if spec.format == "lvis" else None
                if spec.function is not None:
                    table = load_records(spec.function(), name=spec.name, **gt,
                                         thing_classes=spec.thing_classes,
                                         keypoint_names=spec.keypoint_names)
                else:
                    table = load_coco_json(spec.annotation_file, name=spec.name, raw=raw, **gt)
                if raw is not None:
                    table.image_lists = lvis_image_lists(raw, table.info)
                del raw
                step()
                if options["check_images"]:
                    _check_images(spec, table.file_names)
                step()
            tables.append(table)
        # proposals after every dataset's gt: the column dtypes depend on all of them
        if (columns := _proposal_columns(tmp, tables, files, union)) is not None and forked:
            keep_freed_memory()  # chunk after chunk reuses pages (the builder exits after)
        try:
            props = [_dataset_proposals(prog, spec, pfile, table, options, columns, ahead)
                     for spec, pfile, table in zip(specs, files, tables)]
            written = columns.finish() if columns is not None else {}
        except BaseException:
            if columns is not None:
                columns.close()
            raise
    if union is not None:
        for t in tables:
            t.info = dataclasses.replace(t.info, classes=("__background__", *union))
    done = columns.records if columns is not None else {}
    writer = ArrayWriter(tmp)  # each array is written while the next is computed

    def emit(name: str, array: np.ndarray) -> None:
        if name not in done:  # proposal columns: already written in place
            writer.add(name, array)

    try:
        arrays, report = _combine(specs, tables, props, options, written, emit=emit)
        rest = writer.finish()
    finally:
        writer.close()  # (again: a no-op after finish)
    manifest_arrays = {k: done[k] if k in done else rest[k] for k in arrays}
    report["build_seconds"] = round(time.perf_counter() - t0, 3)
    return {"arrays": manifest_arrays, "datasets": [t.info.to_json() for t in tables],
            "targets": {"bbox_thresh": options["bbox_thresh"],
                        "cls_agnostic": options["cls_agnostic"],
                        "weights": options["bbox_reg_weights"]},
            "options": options, "inputs": inputs, "report": report}


def _proposal_columns(tmp: str, tables: list, files: Sequence, union: Optional[list]):
    """The cache's proposal columns, their dtypes narrow enough for all datasets; ``None``
    without proposal files (the empty columns then stay int32)."""
    if all(f is None for f in files):
        return None
    num_classes = max([t.info.num_classes for t in tables] +
                      ([len(union) + 1] if union is not None else []))
    max_gt = max((int(np.diff(t.gt_off).max()) if t.ids.size else 0) for t in tables)
    return ProposalColumns(tmp, num_classes=num_classes, max_gt=max_gt)


def _dataset_proposals(prog, spec, pfile, table, options, columns, ahead):
    """One dataset's proposal rows, appended to ``columns`` (else an empty table)."""
    if pfile is None:
        return empty_proposal_table(table.ids.size)
    with prog.task(f"{spec.name}: proposals {os.path.basename(pfile)}", table.ids.size) as step:
        src = ahead.source(pfile)
        return build_proposal_table(
            src, image_ids=table.ids, widths=table.widths, heights=table.heights,
            gt_off=table.gt_off, gt_boxes=table.boxes, gt_classes=table.classes,
            gt_is_crowd=table.is_crowd, progress=step, out=columns, **{k: options[k] for k in (
                "min_proposal_size", "proposal_limit", "crowd_filter_thresh")})


def _check_images(spec: DatasetSpec, file_names: list) -> None:
    remote = is_url(spec.image_dir)
    if spec.image_dir and not remote and not os.path.isdir(spec.image_dir):
        raise RoIDBInputError(
            f"dataset {spec.name!r}: image directory {spec.image_dir} does not exist; fix the "
            f"catalog entry (or pass check_images=False to skip this check)")
    listing = list_names(spec.image_dir) if remote else set(
        os.listdir(spec.image_dir)) if spec.image_dir else set()
    missing = [name for name in (spec.image_prefix + fn for fn in file_names)
               if name not in listing  # else a path below image_dir (or a record's): look
               and (remote or not os.path.exists(os.path.join(spec.image_dir, name)))]  # it up
    if missing:
        raise RoIDBInputError(
            f"dataset {spec.name!r} ({spec.annotation_file}): {len(missing)} of "
            f"{len(file_names)} images are missing from {spec.image_dir or 'their paths'}, e.g. "
            f"{', '.join(missing[:5])}. Check image_dir/image_prefix in the catalog, download "
            f"the images, or pass check_images=False.")


def _image_paths(spec: DatasetSpec, file_names: list) -> list[bytes]:
    """``os.path.join(image_dir, image_prefix + file_name)`` of every image, UTF-8."""
    base = os.path.join(spec.image_dir, "")
    names = [spec.image_prefix + fn for fn in file_names]
    joined = "\0" + "\0".join(names)
    if (not base or os.name == "nt" or "\0" + os.sep in joined
            or (os.altsep and "\0" + os.altsep in joined)):  # join's special cases
        return [os.path.join(spec.image_dir, n).encode("utf-8") for n in names]
    head = base.encode("utf-8")
    return [head + n for n in map(methodcaller("encode", "utf-8"), names)]


#: the proposal columns of a roidb without proposal files (int32, as before narrow dtypes)
_NO_PROPOSALS = {"prop_boxes": ((0, 4), np.float32), "prop_max_overlaps": (0, np.float32),
                 "prop_max_classes": (0, np.int32), "prop_gt_map": (0, np.int32)}


def _combine(specs, tables, props, options, written=None,
             emit: Callable[[str, np.ndarray], Any] = lambda k, v: None) -> tuple[dict, dict]:
    """The cache's arrays and the build report; ``emit(name, array)`` is called for each
    array once it is final (the caller writes it meanwhile)."""
    n_imgs = [t.ids.size for t in tables]
    a: dict[str, np.ndarray] = {}

    def put(cols: dict) -> None:  # final arrays: kept, and handed to the writer now
        a.update(cols)
        for k, v in cols.items():
            emit(k, v)

    put({"gt_boxes": concat([t.boxes for t in tables]).reshape(-1, 4),
         "gt_classes": concat([t.classes for t in tables]).astype(np.int32),
         "gt_seg_areas": concat([t.seg_areas for t in tables]).astype(np.float32),
         "gt_is_crowd": concat([t.is_crowd for t in tables]).astype(bool)})
    put(SegmColumns.concat([t.segms for t in tables]).arrays())
    paths = [p for s, t in zip(specs, tables) for p in _image_paths(s, t.file_names)]
    k_max = max((t.info.num_keypoints for t in tables), default=0)
    kps = []
    for t in tables:
        k = t.keypoints  # kept when already (G, 3, k_max) int32: no copy
        if k is None or k.shape[2] != k_max:
            k = np.zeros((t.classes.size, 3, k_max), np.int32)
            if t.keypoints is not None:
                k[:, :, :t.keypoints.shape[2]] = t.keypoints
        kps.append(k)
    rest: dict[str, np.ndarray] = {
        "img_id": concat([t.ids for t in tables]),
        "img_width": concat([t.widths for t in tables]).astype(np.int32),
        "img_height": concat([t.heights for t in tables]).astype(np.int32),
        "img_dataset": concat([np.full(n, k, np.int16) for k, n in enumerate(n_imgs)]),
        "img_path_bytes": np.frombuffer(b"".join(paths), np.uint8),
        "img_path_off": offsets(np.fromiter(map(len, paths), np.int64, len(paths))),
        "img_has_vis_kp": concat([t.has_vis_kp for t in tables]), "gt_keypoints": concat(kps),
        "img_gt_off": concat_offsets([t.gt_off for t in tables]),
        "img_prop_off": concat_offsets([p.off for p in props]),
        **(written or {k: np.zeros(*v) for k, v in _NO_PROPOSALS.items()})}
    if any(t.image_lists is not None for t in tables):  # LVIS: only then, COCO unchanged
        rest.update(_image_list_columns(tables))
    put(rest)
    starts = np.cumsum([0] + n_imgs)
    blocks = [(np.arange(starts[k], starts[k + 1], dtype=np.int64), flip)  # per dataset:
              for k in range(len(tables))  # its originals, then (use_flipped) their flips
              for flip in ((False, True) if options["use_flipped"] else (False,))]
    e_img = concat([orig for orig, _ in blocks])
    e_flip = concat([np.full(orig.size, flip, bool) for orig, flip in blocks])
    before = int(e_img.size)
    dropped: Counter = Counter()
    warnings_: list = []
    if options["filter"]:
        ok_img = trainable_images(
            gt_off=a["img_gt_off"], gt_is_crowd=a["gt_is_crowd"], prop_off=a["img_prop_off"],
            prop_max_overlaps=a["prop_max_overlaps"], fg_thresh=options["fg_thresh"],
            bg_thresh_hi=options["bg_thresh_hi"], bg_thresh_lo=options["bg_thresh_lo"])
        keep, dropped = filter_entries(e_img, ok_img, a["img_has_vis_kp"],
                                       keypoints_on=options["keypoints_on"])
        warnings_ = _check_nothing_left(specs, tables, a, e_img, keep, ok_img, options)
        e_img, e_flip = e_img[keep], e_flip[keep]
    put({"entry_img": e_img, "entry_flipped": e_flip})
    a = {k: a[k] for k in sorted(a, key=lambda k: _RANK.get(k, (1, 0)))}  # manifest order
    report = {"datasets": _dataset_reports(tables, props, a), "entries": {
        "before_filter": before, "after_filter": int(e_img.size), "dropped": dict(dropped),
        "filtered": bool(options["filter"])}, "warnings": warnings_}
    return a, report


#: Arrays in the manifest's order: image, gt and proposal columns, then (rank (1, 0))
#: segmentation and LVIS list columns, entries last.
_RANK = {name: (0 if i < 18 else 2, i) for i, name in enumerate((
    "img_id", "img_width", "img_height", "img_dataset", "img_path_bytes", "img_path_off",
    "img_has_vis_kp", "img_gt_off", "img_prop_off", "gt_boxes", "gt_classes", "gt_seg_areas",
    "gt_is_crowd", "gt_keypoints", "prop_boxes", "prop_max_overlaps", "prop_max_classes",
    "prop_gt_map", "entry_img", "entry_flipped"))}


def _image_list_columns(tables) -> dict[str, np.ndarray]:
    """The neg / not-exhaustive columns over all datasets (empty lists for COCO ones)."""
    out = {}
    for key, (off_col, cls_col) in IMAGE_LIST_COLUMNS.items():
        lists = [(np.zeros(t.ids.size + 1, np.int64), np.zeros(0, np.int32))
                 if t.image_lists is None else t.image_lists[key] for t in tables]
        out[off_col] = concat_offsets([o for o, _ in lists])
        out[cls_col] = np.concatenate([v for _, v in lists]).astype(np.int32)
    return out


def _check_nothing_left(specs, tables, a, e_img, keep, ok_img, options) -> list:
    """No trainable entry left: a named error at build, by dataset and reason."""
    ds = a["img_dataset"][e_img]
    msgs = []
    for k, (spec, t) in enumerate(zip(specs, tables)):
        mine = ds == k
        if keep[mine].any():
            continue
        n_img = int(t.ids.size)
        gt_drops = {r: int(t.counts.get(r, 0)) for r in _GT_KEYS if t.counts.get(r, 0)}
        no_cand = int((mine & ~ok_img[e_img]).sum())
        no_vis = int(mine.sum()) - no_cand
        lines = [f"{n_img} images, {int(t.classes.size)} gt boxes kept "
                 f"({int(t.is_crowd.sum())} of them crowd)"] + [text for n, text in (
            (gt_drops, "gt boxes dropped at load: " + ", ".join(f"{r}: {v}" for r, v in
                                                                gt_drops.items())),
            (no_cand, f"filter_for_training removed {no_cand} entries with no foreground or "
                      f"background candidate (no non-crowd gt box and no proposal in the "
                      f"background range)"),
            (no_vis, f"filter_for_training removed {no_vis} entries without a visible "
                     f"keypoint (MODEL.KEYPOINTS_ON)")) if n]
        fix = ("add non-crowd annotations (or give a proposal file so background RoIs exist), "
               "check TRAIN.GT_MIN_AREA and the 'ignore' flags, or remove the dataset from "
               "TRAIN.DATASETS / data.train_datasets")
        if n_img == 0:
            fix = "the annotation file lists no images; fix the file or remove the dataset"
        elif no_vis and not no_cand:
            fix = ("label keypoints (visibility > 0) on its 'person' annotations, turn "
                   "MODEL.KEYPOINTS_ON off, or remove the dataset")
        msgs.append(f"training dataset {spec.name!r} ({spec.annotation_file}) has no "
                    f"trainable image left: " + "; ".join(lines) + f". To train on it, {fix}.")
    if msgs and not keep.any():
        raise RoIDBInputError("the training roidb is empty: " + "\n".join(msgs))
    return msgs


_GT_KEYS = ("gt_min_area", "ignore", "non_finite_bbox", "non_positive_area", "degenerate_box",
            "annotation_unknown_image")


def _dataset_reports(tables, props, a) -> list[dict]:
    weight = np.bincount(a["entry_img"], minlength=a["img_id"].size)  # entries per image (0-2)
    w_max = int(weight.max()) if weight.size else 0
    w_rows = np.repeat(weight.astype(np.uint8 if w_max < 256 else np.int64),
                       np.diff(a["img_gt_off"]))
    w_rows[a["gt_is_crowd"]] = 0
    out, g0 = [], 0
    for t, p in zip(tables, props):
        g1 = g0 + t.classes.size
        # per class, the sum of its non-crowd boxes' entry counts: one integer bincount
        # of (class, weight) pairs (the weights are a handful of small integers)
        wide = np.int32 if t.info.num_classes * (w_max + 1) < 2 ** 31 else np.int64
        pair = t.classes.astype(wide) * (w_max + 1) + w_rows[g0:g1]
        hist = (np.bincount(pair, minlength=t.info.num_classes * (w_max + 1))
                .reshape(-1, w_max + 1) @ np.arange(w_max + 1))
        out.append({
            "name": t.info.name, "images": int(t.ids.size), "gt_boxes": int(t.classes.size),
            "gt_crowd": int(t.is_crowd.sum()),
            "dropped": {k: int(t.counts.get(k, 0)) for k in _GT_KEYS},
            "segms": {k: int(t.counts.get(k, 0)) for k in
                      ("polygon_lt_6_coords", "empty_segmentation", "missing_segmentation")},
            "proposals": dict(p.counts), "class_histogram": {
                t.info.classes[c]: int(hist[c]) for c in range(1, t.info.num_classes)}})
        g0 = g1
    return out
