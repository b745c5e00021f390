"""The grouped arguments of :class:`~lit_roidata.RoIDataModule`.

Each group is a frozen dataclass; LightningCLI shows its fields as nested options
(``--data.loader.num_workers 4``, or ``loader: {num_workers: 4}`` under the data
module's ``init_args`` in a YAML file). In Python, pass an instance or a plain dict::

    RoIDataModule(detectron_config="e2e_mask_rcnn_R-50-FPN_1x.yaml",
                  sources=SourceOptions(data_root="/data"),
                  loader={"num_workers": 4}, output={"output_format": "torchvision"})

A field whose default is ``None`` and that names a Detectron key (``ims_per_batch``,
``aspect_grouping``, ``seed``) means "take it from the Detectron config"; a value set
here is written into the config once, when the data module builds it, so ``dm.cfg`` is
the one place every part reads it from.

A flat name (``num_workers=4``) is refused with an error naming its nested key
(:data:`MOVED_OPTIONS`). Each group checks its own ranges when it is built.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, TypeVar, Union

from lit_roidata._optional import require

__all__ = ["AugmentOptions", "DatasetOptions", "MOVED_OPTIONS", "LoaderOptions",
           "OutputOptions", "SamplingOptions", "SourceOptions", "as_options",
           "albumentations_transform", "detectron_cfg", "refuse_unknown"]


@dataclass(frozen=True)
class DatasetOptions:
    """Which datasets each split reads (``--data.datasets.*``).

    Lists left unset fall back to the Detectron config's ``TRAIN.DATASETS`` /
    ``TEST.DATASETS`` (so a Detectron YAML file works unchanged).

    Args:
        train: catalog names of the training datasets, concatenated in this order
            (Detectron's ``TRAIN.DATASETS``).
        train_proposal_files: one proposal file per training dataset (Fast R-CNN from
            precomputed proposals), or empty (``TRAIN.PROPOSAL_FILES``).
        val: datasets for ``val_dataloader`` (default ``TEST.DATASETS``).
        val_proposal_files: their proposal files (default ``TEST.PROPOSAL_FILES``);
            ``TEST.PROPOSAL_LIMIT`` proposals per image are kept.
        test: datasets for ``test_dataloader``; default: the validation ones.
        test_proposal_files: their proposal files; default: the validation ones.
    """

    train: Optional[list[str]] = None
    train_proposal_files: Optional[list[str]] = None
    val: Optional[list[str]] = None
    val_proposal_files: Optional[list[str]] = None
    test: Optional[list[str]] = None
    test_proposal_files: Optional[list[str]] = None


@dataclass(frozen=True)
class SourceOptions:
    """Where the data comes from and how it is checked (``--data.sources.*``).

    Args:
        data_root: root under which the built-in catalog names resolve
            (``<data_root>/coco/...``, ``<data_root>/lvis/...``).
        dataset_catalog: YAML file registering your own datasets by name (see
            :meth:`lit_roidata.catalog.Catalog.load_yaml`).
        cache_dir: folder for the roidb caches (default: ``$LIT_ROIDATA_CACHE`` or
            ``~/.cache/lit_roidata``).
        trust_pickle: read proposal files that are pickles (``.pkl``). Unpickling runs
            any code the file names, so they are refused unless this is set (with a
            warning when used); ``lit-roidata convert-proposals in.pkl out.npz``
            converts one once into the ``.npz`` format, which needs no trust.
        check_images: when building the roidb, check that every image file exists
            (the error names the first missing files); ``False`` skips the check.
        category_policy: how the category lists of several training datasets are
            combined: ``"strict"`` (they must agree, else a diff is shown),
            ``"by_name"`` (map every dataset's categories onto one class list by name)
            or ``"detectron"`` (concatenate without reconciling, as Detectron does).
        on_bad_image: ``"raise"`` stops on an unreadable image naming it; ``"skip"``
            replaces only that image (its partners stay), deterministically, from images
            the pass holds back; the bad file is never read again once every rank knows
            it (exchanged at each epoch end, kept in checkpoints), and every skipped
            file is reported with its reason at the end of each epoch.
        bad_image_reserve: with ``on_bad_image="skip"``, the fraction of each pass's
            blocks held back as replacements for bad images (at least 16 images, at most
            a quarter of a pass; 0: none, every replacement a counted repeat).
    """

    data_root: Optional[str] = None
    dataset_catalog: Optional[str] = None
    cache_dir: Optional[str] = None
    trust_pickle: bool = False
    check_images: bool = True
    category_policy: Literal["strict", "by_name", "detectron"] = "strict"
    on_bad_image: Literal["raise", "skip"] = "raise"
    bad_image_reserve: float = 0.01

    def __post_init__(self) -> None:
        if not 0 <= self.bad_image_reserve < 1:
            raise ValueError(f"sources.bad_image_reserve={self.bad_image_reserve}; use a "
                             "fraction of a pass in [0, 1), e.g. 0.01")


@dataclass(frozen=True)
class LoaderOptions:
    """The DataLoaders (``--data.loader.*``).

    Args:
        num_workers: worker processes building minibatches (0: the main process).
        ims_per_batch: images per training minibatch *per rank*; ``None``: the Detectron
            config's ``TRAIN.IMS_PER_BATCH`` (Detectron's per-GPU minibatch).
        eval_ims_per_batch: images per validation/test batch (Detectron tests one).
        pin_memory: pin host memory of batches (faster, asynchronous copies to a GPU);
            ``None`` (default): on when the trainer's device is a CUDA GPU, else off.
        persistent_workers: keep the workers alive between epochs (and between
            validation runs). Not with ``sources.on_bad_image="skip"``: each epoch's
            workers must see the bad images found in the previous one.
        prefetch_factor: batches each worker prepares ahead (``None``: PyTorch's 2).
        shm_pool: reuse per-worker shared-memory slots for the training batches instead
            of a new segment per array (``prefetch_factor + 3`` slots per worker; a slot
            is reused only when every tensor of its previous batch is gone). Memory:
            about the largest batch, per slot, of ``/dev/shm``.
        read_ahead: blocks whose images each worker fetches ahead from object storage
            (``s3://`` image folders; 0: off; docs/custom_datasets.md).
    """

    num_workers: int = 2
    ims_per_batch: Optional[int] = None
    eval_ims_per_batch: int = 1
    pin_memory: Optional[bool] = None
    persistent_workers: bool = False
    prefetch_factor: Optional[int] = None
    shm_pool: bool = True
    read_ahead: int = 2

    def __post_init__(self) -> None:
        checks = (("num_workers", self.num_workers, 0, "0 (main process) or more"),
                  ("eval_ims_per_batch", self.eval_ims_per_batch, 1, "at least 1"),
                  ("ims_per_batch", self.ims_per_batch, 1,
                   "at least 1 (or null: TRAIN.IMS_PER_BATCH of the Detectron config)"),
                  ("prefetch_factor", self.prefetch_factor, 1,
                   "at least 1 (or null: PyTorch's default)"),
                  ("read_ahead", self.read_ahead, 0, "0 (off) or more blocks"))
        for name, value, low, fix in checks:
            if value is not None and value < low:
                raise ValueError(f"loader.{name}={value}; use {fix}")


@dataclass(frozen=True)
class OutputOptions:
    """What a batch looks like (``--data.output.*``).

    Args:
        output_format: ``"detectron"`` (dict of Detectron's blobs) or ``"torchvision"``
            (list of images, list of target dicts).
        pixel_format: ``"uint8"`` keeps images uint8 (BGR, NCHW, zero padding) up to the
            device and normalises there; ``"detectron"`` gives Detectron's float32 blob
            (BGR minus ``PIXEL_MEANS``) from the workers.
        mask_format: ``"compact"`` ships one ``M x M`` mask per mask RoI from the workers
            and expands it to Detectron's class-specific ``masks_int32`` on the device
            (identical blob, ~NUM_CLASSES times less worker memory and copying);
            ``"detectron"`` builds the expanded blob in the workers, as Detectron does.
            With ``output_format="torchvision"``: each instance mask cut to its pixels'
            box and bit-packed, pasted into the full-image masks on the device
            (identical masks); ``"detectron"``: full-image masks from the workers.
        target_format: ``"compact"`` ships only the sampled RPN anchors and RetinaNet's
            non-zero class labels from the workers and expands them to Detectron's dense
            blobs on the device (identical blobs, a few KB instead of ~45 MB per FPN
            batch); ``"detectron"`` builds the dense blobs in the workers;
            ``"compact_raw"`` ships the compact form and leaves it unexpanded
            (docs/rpn_retinanet.md describes the blobs).
        fix_rpn_quirks: correct Detectron's RPN label quirks Q2/Q3
            (docs/detectron_quirks.md); off: Detectron's labels exactly.
    """

    output_format: Literal["detectron", "torchvision"] = "detectron"
    pixel_format: Literal["uint8", "detectron"] = "uint8"
    mask_format: Literal["compact", "detectron"] = "compact"
    target_format: Literal["compact", "detectron", "compact_raw"] = "compact"
    fix_rpn_quirks: bool = False


@dataclass(frozen=True)
class SamplingOptions:
    """The order of the training stream and its resume (``--data.sampling.*``).

    Args:
        seed: seed of the sampler stream and of every per-block draw; ``None``: the
            Detectron config's ``RNG_SEED``. Must be equal on every rank.
        rng_mode: ``"block"`` (one generator per block: reproducible anywhere) or
            ``"detectron"`` (NumPy RandomState in Detectron's call order).
        aspect_grouping: pair images of the same orientation in a minibatch;
            ``None``: the Detectron config's ``TRAIN.ASPECT_GROUPING``.
        infinite: Detectron's endless block stream (train with ``max_steps``) instead of
            epochs of ``len(loader)`` batches.
        epoch_length: infinite mode: batches per Lightning epoch (default: one pass). With
            ``check_val_every_n_epoch: 1`` this is a validation period (Detectron2's
            ``TEST.EVAL_PERIOD``) that stays exact after any abort
            (docs/ddp_and_resume.md).
        strict_resume: a checkpoint whose stream differs from this one (roidb length,
            ``ims_per_batch``, seed, grouping, repeat factors) is refused with an error
            naming the difference; ``False``: a warning, and the stream starts a fresh
            pass.
        repeat_factor_threshold: repeat images with rare categories (Detectron2's
            ``RepeatFactorTrainingSampler``, for LVIS: ``0.001``); ``None``: the Detectron
            config's ``DATALOADER.SAMPLER_TRAIN`` / ``REPEAT_THRESHOLD`` (default: off).
            A value sets both keys.
    """

    seed: Optional[int] = None
    rng_mode: Literal["block", "detectron"] = "block"
    aspect_grouping: Optional[bool] = None
    infinite: bool = False
    epoch_length: Optional[int] = None
    strict_resume: bool = True
    repeat_factor_threshold: Optional[float] = None

    def __post_init__(self) -> None:
        if self.epoch_length is not None and (not self.infinite or self.epoch_length < 1):
            raise ValueError(f"sampling.epoch_length={self.epoch_length}: give a number of "
                             "batches >= 1 with sampling.infinite=true (in epoch mode an "
                             "epoch is a pass)")
        if self.repeat_factor_threshold is not None:
            from lit_roidata.roidb.repeat_factors import check_repeat_threshold

            check_repeat_threshold(self.repeat_factor_threshold)


@dataclass(frozen=True)
class AugmentOptions:
    """An albumentations pipeline applied to each training image before Detectron's
    scaling (``--data.augment``; needs the ``[augment]`` extra). Boxes, masks,
    keypoints and proposal labels follow the image
    (:class:`~lit_roidata.minibatch.augment.Augmentation`).

    Args:
        transforms: albumentations transforms, each an instance or, in YAML, a dict
            ``{class_path: RandomBrightnessContrast, init_args: {p: 0.5}}`` (a bare
            class name is looked up in ``albumentations``).
        min_visibility: albumentations' box ``min_visibility``: boxes that keep less of
            their area are dropped.
    """

    transforms: list[Any] = field(default_factory=list)
    min_visibility: float = 0.0

    def pipeline(self, cfg: Any) -> Any:
        """The :class:`~lit_roidata.minibatch.augment.Augmentation` for the Detectron
        config ``cfg`` (YAML specs become albumentations transforms)."""
        from lit_roidata.minibatch.augment import Augmentation

        return Augmentation([albumentations_transform(t) for t in self.transforms], cfg,
                            min_visibility=float(self.min_visibility))


#: Group name -> its dataclass.
GROUPS: dict[str, type] = {"datasets": DatasetOptions, "sources": SourceOptions,
                           "loader": LoaderOptions, "output": OutputOptions,
                           "sampling": SamplingOptions, "augment": AugmentOptions}

#: Flat name -> (group, field) of the nested option it is (errors name the nested key):
#: every field by its own name, the dataset lists also as ``<split>_datasets``.
MOVED_OPTIONS: dict[str, tuple[str, str]] = {
    **{f"{split}_datasets": ("datasets", split) for split in ("train", "val", "test")},
    **{f.name: (group, f.name) for group, cls in GROUPS.items()
       for f in dataclasses.fields(cls) if f.name not in ("train", "val", "test")},
}

T = TypeVar("T")


def refuse_unknown(owner: str, names: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` for the first of ``names`` (keywords that are not arguments of
    the data module ``owner``): a flat option name names its nested key."""
    for name in names:
        if name in ("demo_root", "demo_size"):
            raise TypeError(f"{owner}: {name} is an argument of lit_roidata.DemoRoIDataModule "
                            "(the generated demo data)")
        if name in MOVED_OPTIONS:
            group, key = MOVED_OPTIONS[name]
            raise TypeError(f"{owner}: {name}=... is now {group}.{key}: pass {group}="
                            f"{{{key!r}: ...}} (--data.{group}.{key} on the command line)")
        raise TypeError(f"{owner}: unexpected keyword argument {name!r}; the arguments are "
                        "detectron_config, overrides, model_type and the option groups "
                        f"{list(GROUPS)} (options are grouped, e.g. loader.num_workers)")


def as_options(cls: type[T], value: Union[None, T, Mapping[str, Any]], group: str) -> T:
    """``value`` as a ``cls`` instance: ``None`` gives the defaults, a dict its fields.

    Raises:
        TypeError: a key that is not a field of ``cls`` (naming the valid ones), or a
            value of another type.
    """
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)  # e.g. the same fields from jsonargparse
    if isinstance(value, Mapping):
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        if unknown := sorted(set(value) - names):
            raise TypeError(f"{group}: unknown option(s) {unknown}; valid: {sorted(names)}")
        return cls(**dict(value))
    raise TypeError(f"{group}: expected a {cls.__name__} or a dict, got {type(value).__name__}")


def to_plain(value: Any) -> Any:
    """Dataclasses and containers as plain dicts/lists/scalars (checkpoint-safe
    hyperparameters: a checkpoint read with ``weights_only=True`` holds no classes)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    # (repr: e.g. an albumentations transform instance)
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)


def albumentations_transform(spec: Any) -> Any:
    """An albumentations transform from an instance or a ``{class_path, init_args}``
    dict (a bare class name is looked up in ``albumentations``; ``augment.transforms``)."""
    if not isinstance(spec, Mapping):
        return spec
    A = require("albumentations", "augment", "augmentation (augment.transforms)")
    if "class_path" not in spec:
        raise ValueError(f"augment.transforms: {dict(spec)!r} needs a class_path, e.g. "
                         "{class_path: RandomBrightnessContrast, init_args: {p: 0.5}}")
    path = str(spec["class_path"])
    if unknown := sorted(set(spec) - {"class_path", "init_args"}):
        raise ValueError(f"augment.transforms: {path}: unknown keys {unknown}; use "
                         "class_path and init_args")
    module, _, name = path.rpartition(".")
    if (cls := getattr(importlib.import_module(module) if module else A, name, None)) is None:
        raise ValueError(f"augment.transforms: no albumentations transform {path!r}")
    args = dict(spec.get("init_args") or {})
    if "transforms" in args:  # OneOf, SomeOf, Sequential: nested specs
        args["transforms"] = [albumentations_transform(t) for t in args["transforms"]]
    return cls(**args)


def detectron_cfg(detectron_config: Optional[str], model_type: Optional[str],
                  overrides: Optional[Mapping[str, Any]], loader: LoaderOptions,
                  sampling: SamplingOptions) -> Any:
    """The data module's frozen Detectron config: Detectron's defaults, the YAML file
    ``detectron_config``, the flags of ``model_type``, ``overrides``, then the options
    that name a Detectron key (``loader.ims_per_batch`` -> ``TRAIN.IMS_PER_BATCH``,
    ``sampling.aspect_grouping`` -> ``TRAIN.ASPECT_GROUPING``) when not None; merged in
    this order, inferred as Detectron does, then frozen.

    Raises:
        ValueError: an option and ``overrides`` setting the same key to different values.
    """
    from lit_roidata.config import load_detectron_cfg
    from lit_roidata.minibatch.model_type import flags_for_model_type

    flags = None if model_type is None else flags_for_model_type(model_type)
    given = _flat_keys(overrides or {})
    keyed = {"TRAIN.IMS_PER_BATCH": ("loader.ims_per_batch", loader.ims_per_batch),
             "TRAIN.ASPECT_GROUPING": ("sampling.aspect_grouping", sampling.aspect_grouping)}
    if (t := getattr(sampling, "repeat_factor_threshold", None)) is not None:
        keyed["DATALOADER.SAMPLER_TRAIN"] = ("sampling.repeat_factor_threshold",
                                             "RepeatFactorTrainingSampler")
        keyed["DATALOADER.REPEAT_THRESHOLD"] = ("sampling.repeat_factor_threshold", float(t))
    for key, (option, value) in keyed.items():
        if value is not None and key in given and given[key] != value:
            raise ValueError(f"{option}={value!r} and overrides {key}={given[key]!r} "
                             f"disagree; set one of them (null {option} takes {key} from "
                             "the Detectron config)")
    merged = {key: value for key, (_, value) in keyed.items() if value is not None}
    return load_detectron_cfg(detectron_config, flags, dict(overrides or {}), merged or None)


def _flat_keys(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"TRAIN": {"SCALES": ...}, "TEST.SCALE": ...}`` -> dotted keys and values."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        out.update(_flat_keys(v, key + ".") if isinstance(v, Mapping) else {key: v})
    return out
