"""Detectron's option tree, with Detectron's defaults, as typed Python objects.

The data pipeline reads the same keys Detectron reads (docs/detectron_semantics.md,
"Configuration"), so a Detectron user recognises every name: ``cfg.TRAIN.SCALES``,
``cfg.FPN.COARSEST_STRIDE`` ... Sections are dataclasses, which gives attribute access,
type hints and a docstring per section. On the command line the config is not exposed
option by option: it is reached through the data module's ``detectron_config`` (a
Detectron YAML file) and ``overrides`` (dotted keys), e.g.
``--data.init_args.overrides '{"TRAIN.SCALES": [800]}'`` or, in a YAML config,
``overrides: {TRAIN.SCALES: [800]}``.

Sections that only the model reads in Detectron (``SOLVER``, ``FAST_RCNN``, ``RESNETS``,
``TEST`` ...) are kept as checked key/value tables so that a Detectron YAML file such as
``e2e_mask_rcnn_R-50-FPN_1x.yaml`` loads unchanged. An unknown key in a typed section,
at the top level or directly under one of these tables is an error that names the key
and the nearest valid one; keys *inside* the nested tables of ``TEST`` (``TEST.BBOX_AUG``,
``TEST.MASK_AUG``, ``TEST.KPS_AUG``) are not checked and are stored as given, because
the data pipeline never reads them.

Example::

    >>> from lit_roidata.config import get_cfg
    >>> cfg = get_cfg()
    >>> cfg.TRAIN.SCALES
    (600,)
    >>> cfg.merge_from_dict({"TRAIN.SCALES": (800,), "MODEL.FASTER_RCNN": True})
    >>> cfg.TRAIN.SCALES, cfg.RPN.RPN_ON
    ((800,), True)
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Union

import yaml

__all__ = [
    "DetectronConfig",
    "ConfigError",
    "get_cfg",
    "load_detectron_cfg",
]


class ConfigError(KeyError, ValueError):
    """A config key or value that Detectron's option tree does not accept."""

    def __str__(self) -> str:  # KeyError quotes its message; we want plain text.
        return str(self.args[0]) if self.args else ""


@dataclass
class TrainConfig:
    """``TRAIN``: datasets, image scales, RoI / anchor sampling (Detectron semantics:
    configuration)."""

    WEIGHTS: str = ""
    DATASETS: tuple[str, ...] = ()
    PROPOSAL_FILES: tuple[str, ...] = ()
    SCALES: tuple[int, ...] = (600,)
    MAX_SIZE: int = 1000
    IMS_PER_BATCH: int = 2
    BATCH_SIZE_PER_IM: int = 64
    FG_FRACTION: float = 0.25
    FG_THRESH: float = 0.5
    BG_THRESH_HI: float = 0.5
    BG_THRESH_LO: float = 0.0
    USE_FLIPPED: bool = True
    BBOX_THRESH: float = 0.5
    SNAPSHOT_ITERS: int = 80000
    ASPECT_GROUPING: bool = True
    CROWD_FILTER_THRESH: float = 0.7
    GT_MIN_AREA: float = -1
    #: Not in Detectron (Detectron quirk Q28, docs/detectron_quirks.md): -1 keeps every proposal, as
    # Detectron trains.
    PROPOSAL_LIMIT: int = -1
    RPN_POSITIVE_OVERLAP: float = 0.7
    RPN_NEGATIVE_OVERLAP: float = 0.3
    RPN_FG_FRACTION: float = 0.5
    RPN_BATCH_SIZE_PER_IM: int = 256
    RPN_NMS_THRESH: float = 0.7
    RPN_PRE_NMS_TOP_N: int = 12000
    RPN_POST_NMS_TOP_N: int = 2000
    RPN_STRADDLE_THRESH: float = 0
    RPN_MIN_SIZE: float = 0
    FREEZE_CONV_BODY: bool = False
    FREEZE_AT: int = 2
    AUTO_RESUME: bool = True
    COPY_WEIGHTS: bool = False


@dataclass
class DataLoaderConfig:
    """``DATA_LOADER``: Detectron's loader threads and queues (kept for compatibility)."""

    NUM_THREADS: int = 4
    MINIBATCH_QUEUE_SIZE: int = 64
    BLOBS_QUEUE_CAPACITY: int = 8


@dataclass
class ModelConfig:
    """``MODEL``: which blob family is built, class count, box regression weights."""

    TYPE: str = ""
    CONV_BODY: str = ""
    NUM_CLASSES: int = -1
    CLS_AGNOSTIC_BBOX_REG: bool = False
    BBOX_REG_WEIGHTS: tuple[float, float, float, float] = (10.0, 10.0, 5.0, 5.0)
    FASTER_RCNN: bool = False
    MASK_ON: bool = False
    KEYPOINTS_ON: bool = False
    RPN_ONLY: bool = False
    EXECUTION_TYPE: str = "Caffe2"


@dataclass
class RPNConfig:
    """``RPN``: single-level anchors; ``RPN_ON`` is inferred from ``MODEL`` flags."""

    RPN_ON: bool = False
    SIZES: tuple[float, ...] = (64, 128, 256, 512)
    STRIDE: int = 16
    ASPECT_RATIOS: tuple[float, ...] = (0.5, 1.0, 2.0)


@dataclass
class FPNConfig:
    """``FPN``: stride padding, multilevel RoIs and multilevel RPN anchors."""

    FPN_ON: bool = False
    DIM: int = 256
    ZERO_INIT_LATERAL: bool = False
    COARSEST_STRIDE: int = 32
    MULTILEVEL_ROIS: bool = False
    ROI_CANONICAL_SCALE: int = 224
    ROI_CANONICAL_LEVEL: int = 4
    ROI_MAX_LEVEL: int = 5
    ROI_MIN_LEVEL: int = 2
    MULTILEVEL_RPN: bool = False
    RPN_MAX_LEVEL: int = 6
    RPN_MIN_LEVEL: int = 2
    RPN_ASPECT_RATIOS: tuple[float, ...] = (0.5, 1.0, 2.0)
    RPN_ANCHOR_START_SIZE: int = 32
    RPN_COLLECT_SCALE: int = 1
    EXTRA_CONV_LEVELS: bool = False
    USE_GN: bool = False


@dataclass
class MRCNNConfig:
    """``MRCNN``: mask target resolution and class-specific masks."""

    ROI_MASK_HEAD: str = ""
    RESOLUTION: int = 14
    ROI_XFORM_METHOD: str = "RoIAlign"
    ROI_XFORM_RESOLUTION: int = 7
    ROI_XFORM_SAMPLING_RATIO: int = 0
    DIM_REDUCED: int = 256
    DILATION: int = 2
    UPSAMPLE_RATIO: int = 1
    USE_FC_OUTPUT: bool = False
    CONV_INIT: str = "GaussianFill"
    CLS_SPECIFIC_MASK: bool = True
    WEIGHT_LOSS_MASK: float = 1.0
    THRESH_BINARIZE: float = 0.5


@dataclass
class KRCNNConfig:
    """``KRCNN``: keypoint heatmap size, keypoint count, minibatch validity."""

    ROI_KEYPOINTS_HEAD: str = ""
    HEATMAP_SIZE: int = -1
    UP_SCALE: int = -1
    USE_DECONV: bool = False
    DECONV_DIM: int = 256
    USE_DECONV_OUTPUT: bool = False
    DILATION: int = 1
    DECONV_KERNEL: int = 4
    NUM_KEYPOINTS: int = -1
    NUM_STACKED_CONVS: int = 8
    CONV_HEAD_DIM: int = 256
    CONV_HEAD_KERNEL: int = 3
    CONV_INIT: str = "GaussianFill"
    NMS_OKS: bool = False
    KEYPOINT_CONFIDENCE: str = "bbox"
    ROI_XFORM_METHOD: str = "RoIAlign"
    ROI_XFORM_RESOLUTION: int = 7
    ROI_XFORM_SAMPLING_RATIO: int = 0
    MIN_KEYPOINT_COUNT_FOR_VALID_MINIBATCH: int = 20
    INFERENCE_MIN_SIZE: int = 0
    LOSS_WEIGHT: float = 1.0
    NORMALIZE_BY_VISIBLE_KEYPOINTS: bool = True


@dataclass
class RetinaNetConfig:
    """``RETINANET``: anchors per octave and aspect, label thresholds."""

    RETINANET_ON: bool = False
    NUM_CONVS: int = 4
    ASPECT_RATIOS: tuple[float, ...] = (0.5, 1.0, 2.0)
    SCALES_PER_OCTAVE: int = 3
    ANCHOR_SCALE: float = 4
    POSITIVE_OVERLAP: float = 0.5
    NEGATIVE_OVERLAP: float = 0.4
    LOSS_ALPHA: float = 0.25
    LOSS_GAMMA: float = 2.0
    LOSS_BBOX_WEIGHT: float = 1.0
    BBOX_REG_WEIGHTS: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)
    BBOX_REG_BETA: float = 0.11
    PRIOR_PROB: float = 0.01
    SHARE_CLS_BBOX_TOWER: bool = False
    CLASS_SPECIFIC_BBOX: bool = False
    SOFTMAX: bool = False
    INFERENCE_TH: float = 0.05
    PRE_NMS_TOP_N: int = 1000


# Sections the data pipeline never reads. They are kept (checked, untyped) so that
# Detectron's YAML files load unchanged and round-trip.
_PASSTHROUGH_DEFAULTS: dict[str, dict[str, Any]] = {
    "TEST": {
        "WEIGHTS": "", "DATASETS": [], "SCALE": 600, "MAX_SIZE": 1000, "NMS": 0.3,
        "BBOX_REG": True, "PROPOSAL_FILES": [], "PROPOSAL_LIMIT": 2000,
        "RPN_NMS_THRESH": 0.7, "RPN_PRE_NMS_TOP_N": 12000, "RPN_POST_NMS_TOP_N": 2000,
        "RPN_MIN_SIZE": 0, "DETECTIONS_PER_IM": 100, "SCORE_THRESH": 0.05,
        "COMPETITION_MODE": True, "FORCE_JSON_DATASET_EVAL": False,
        "PRECOMPUTED_PROPOSALS": True, "BBOX_AUG": {}, "MASK_AUG": {}, "KPS_AUG": {},
        "SOFT_NMS": {}, "BBOX_VOTE": {},
    },
    "SOLVER": {
        "BASE_LR": 0.001, "LR_POLICY": "step", "GAMMA": 0.1, "STEP_SIZE": 30000,
        "STEPS": [], "LRS": [], "MAX_ITER": 40000, "MOMENTUM": 0.9,
        "WEIGHT_DECAY": 0.0005, "WEIGHT_DECAY_GN": 0.0, "BIAS_DOUBLE_LR": True,
        "BIAS_WEIGHT_DECAY": False, "WARM_UP_ITERS": 500, "WARM_UP_FACTOR": 1.0 / 3.0,
        "WARM_UP_METHOD": "linear", "SCALE_MOMENTUM": True,
        "SCALE_MOMENTUM_THRESHOLD": 1.1, "LOG_LR_CHANGE_THRESHOLD": 1.1,
    },
    "FAST_RCNN": {
        "ROI_BOX_HEAD": "", "MLP_HEAD_DIM": 1024, "CONV_HEAD_DIM": 256,
        "NUM_STACKED_CONVS": 4, "ROI_XFORM_METHOD": "RoIPoolF",
        "ROI_XFORM_SAMPLING_RATIO": 0, "ROI_XFORM_RESOLUTION": 14,
    },
    "RFCN": {"PS_GRID_SIZE": 3},
    "RESNETS": {
        "NUM_GROUPS": 1, "WIDTH_PER_GROUP": 64, "STRIDE_1X1": True,
        "TRANS_FUNC": "bottleneck_transformation", "STEM_FUNC": "basic_bn_stem",
        "SHORTCUT_FUNC": "basic_bn_shortcut", "RES5_DILATION": 1,
    },
    "GROUP_NORM": {"DIM_PER_GP": -1, "NUM_GROUPS": 32, "EPSILON": 1e-5},
    "CLUSTER": {"ON_CLUSTER": False},
}

_TOP_LEVEL_PASSTHROUGH: dict[str, Any] = {
    "USE_NCCL": False, "BBOX_XFORM_CLIP": math.log(1000.0 / 16.0), "EPS": 1e-14,
    "ROOT_DIR": os.getcwd(), "OUTPUT_DIR": "/tmp", "MATLAB": "matlab", "VIS": False,
    "VIS_TH": 0.9, "EXPECTED_RESULTS": [], "EXPECTED_RESULTS_RTOL": 0.1,
    "EXPECTED_RESULTS_ATOL": 0.005, "EXPECTED_RESULTS_EMAIL": "", "DATA_DIR": "",
    "DEDUP_BOXES": 1.0 / 16.0, "DOWNLOAD_CACHE": "/tmp/detectron-download-cache",
}


def _section(cls: type) -> Any:
    return field(default_factory=cls)


def _passthrough(name: str) -> Any:
    return field(default_factory=lambda: copy.deepcopy(_PASSTHROUGH_DEFAULTS[name]))


@dataclass
class DetectronConfig:
    """Detectron's whole option tree, data-pipeline sections typed (Detectron semantics:
    configuration).

    Use :func:`get_cfg` for a fresh copy with Detectron's defaults, then
    :meth:`merge_from_dict` / :meth:`merge_from_file` for overrides with dotted
    Detectron keys. ``RPN.RPN_ON`` is inferred from ``MODEL.FASTER_RCNN`` /
    ``MODEL.RPN_ONLY`` after every merge, as Detectron's ``assert_and_infer_cfg`` does.
    """

    TRAIN: TrainConfig = _section(TrainConfig)
    DATA_LOADER: DataLoaderConfig = _section(DataLoaderConfig)
    MODEL: ModelConfig = _section(ModelConfig)
    RPN: RPNConfig = _section(RPNConfig)
    FPN: FPNConfig = _section(FPNConfig)
    MRCNN: MRCNNConfig = _section(MRCNNConfig)
    KRCNN: KRCNNConfig = _section(KRCNNConfig)
    RETINANET: RetinaNetConfig = _section(RetinaNetConfig)
    NUM_GPUS: int = 1
    #: BGR means, Detectron's shape (1, 1, 3) flattened to three numbers.
    PIXEL_MEANS: tuple[float, float, float] = (102.9801, 115.9465, 122.7717)
    RNG_SEED: int = 3
    TEST: dict[str, Any] = _passthrough("TEST")
    SOLVER: dict[str, Any] = _passthrough("SOLVER")
    FAST_RCNN: dict[str, Any] = _passthrough("FAST_RCNN")
    RFCN: dict[str, Any] = _passthrough("RFCN")
    RESNETS: dict[str, Any] = _passthrough("RESNETS")
    GROUP_NORM: dict[str, Any] = _passthrough("GROUP_NORM")
    CLUSTER: dict[str, Any] = _passthrough("CLUSTER")
    #: Detectron's other top-level keys (OUTPUT_DIR, EPS, ...), unused here.
    OTHER: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(_TOP_LEVEL_PASSTHROUGH))

    # ---------------------------------------------------------------- merging
    def merge_from_dict(self, overrides: Mapping[str, Any]) -> None:
        """Apply overrides given as dotted keys (``"TRAIN.SCALES"``) or nested dicts.

        Raises:
            ConfigError: for an unknown key (naming the nearest valid one) or a value
                that cannot be converted to the option's type.
        """
        for key, value in _flatten(overrides):
            self._set(key, value)
        self.infer()

    def merge_from_file(self, path: str | os.PathLike) -> None:
        """Merge a Detectron YAML config file (same keys as Detectron)."""
        with open(path, encoding="utf-8") as fh:
            try:
                data = yaml.safe_load(fh) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: a Detectron config must be a mapping at the top level")
        try:
            self.merge_from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from exc

    def infer(self) -> None:
        """Derive inferred options, as Detectron's ``assert_and_infer_cfg``."""
        if self.MODEL.FASTER_RCNN or self.MODEL.RPN_ONLY:
            self.RPN.RPN_ON = True
        if self.RPN.RPN_ON or self.RETINANET.RETINANET_ON:
            self.TEST["PRECOMPUTED_PROPOSALS"] = False

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict with Detectron's layout (``OTHER`` flattened to the top)."""
        out = dataclasses.asdict(self)
        out.update(out.pop("OTHER"))
        return out

    def dump(self) -> str:
        """YAML text that :func:`load_detectron_cfg` reads back to an equal config."""
        return yaml.safe_dump(_lists(self.to_dict()), sort_keys=False)

    def clone(self) -> "DetectronConfig":
        """A deep copy."""
        return copy.deepcopy(self)

    def get(self, dotted: str) -> Any:
        """The value under a dotted key, e.g. ``cfg.get("TRAIN.SCALES")``."""
        obj, leaf = self._resolve(dotted)
        return obj[leaf] if isinstance(obj, dict) else getattr(obj, leaf)

    # ---------------------------------------------------------------- internals
    def _resolve(self, dotted: str) -> tuple[Any, str]:
        parts = dotted.split(".")
        if len(parts) == 1:
            if parts[0] in self.OTHER and not hasattr(self, parts[0]):
                return self.OTHER, parts[0]
            _check_key(parts[0], _top_level_keys(self), "")
            return self, parts[0]
        head, rest = parts[0], parts[1:]
        _check_key(head, _top_level_keys(self), "")
        obj: Any = getattr(self, head)
        for i, part in enumerate(rest[:-1]):
            prefix = ".".join(parts[: i + 2])
            if isinstance(obj, dict) and isinstance(obj.get(part), dict):
                obj = obj[part]
                continue
            raise ConfigError(f"config key '{prefix}' is not a section")
        leaf = rest[-1]
        valid = list(obj) if isinstance(obj, dict) else [f.name for f in dataclasses.fields(obj)]
        if not (isinstance(obj, dict) and head == "TEST" and len(rest) > 1):
            _check_key(leaf, valid, ".".join(parts[:-1]) + ".")
        return obj, leaf

    def _set(self, dotted: str, value: Any) -> None:
        obj, leaf = self._resolve(dotted)
        if isinstance(obj, dict):
            obj[leaf] = _decode(value)
            return
        current = getattr(obj, leaf)
        if not isinstance(current, str):
            value = _decode(value)
        setattr(obj, leaf, _coerce(dotted, value, current))


def _decode(value: Any) -> Any:
    """Detectron's ``_decode_cfg_value``: strings such as ``"(800,)"`` are literal-evaluated.

    Detectron's YAML files write tuples as strings (``SCALES: (800,)``,
    ``DATASETS: ('coco_2014_train',)``); a string that is not a Python literal stays a string.
    """
    if not isinstance(value, str):
        return value
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _top_level_keys(cfg: DetectronConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(cfg) if f.name != "OTHER"] + list(cfg.OTHER)


def _check_key(key: str, valid: list[str], prefix: str) -> None:
    if key in valid:
        return
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{near[0]}'?" if near else ""
    raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Dotted (key, value) pairs; a nested dict under a typed section is descended into."""
    items: list[tuple[str, Any]] = []
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and "." not in str(key) and _is_section(dotted):
            items.extend(_flatten(value, dotted + "."))
        else:
            items.append((dotted, value))
    return items


_SECTIONS = {f.name for f in dataclasses.fields(DetectronConfig)} - {
    "NUM_GPUS", "PIXEL_MEANS", "RNG_SEED", "OTHER"}
#: TEST.BBOX_AUG, TEST.MASK_AUG, ...: the nested sections of TEST.
_TEST_SUBSECTIONS = {k for k, v in _PASSTHROUGH_DEFAULTS["TEST"].items() if isinstance(v, dict)}


def _is_section(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] in _SECTIONS and (len(parts) == 1 or parts[0] == "TEST" and len(parts) == 2
                                      and parts[1] in _TEST_SUBSECTIONS)


def _coerce(key: str, value: Any, current: Any) -> Any:
    """Convert ``value`` to the type of the default ``current`` (Detectron's rules)."""
    try:
        if isinstance(current, bool):
            if isinstance(value, bool):
                return value
            if isinstance(value, (int,)) and value in (0, 1):
                return bool(value)
            if isinstance(value, str) and value.lower() in {"true", "false"}:
                return value.lower() == "true"
            raise TypeError
        if isinstance(current, tuple):
            if isinstance(value, (str, bytes)) and key.endswith(("DATASETS", "PROPOSAL_FILES")):
                value = (value,)
            seq = _flat_numbers(value) if key == "PIXEL_MEANS" else list(value)
            elem = type(current[0]) if current else None
            if elem in (int, float):
                seq = [_number(v, elem) for v in seq]
            elif elem is str:
                seq = [str(v) for v in seq]
            return tuple(seq)
        if isinstance(current, int) and not isinstance(current, bool):
            return _number(value, int)
        if isinstance(current, float):
            return _number(value, float)
        if isinstance(current, str):
            if not isinstance(value, str):
                raise TypeError
            return value
    except (TypeError, ValueError):
        pass
    else:
        return value
    raise ConfigError(
        f"config key '{key}' expects a value like {current!r} "
        f"({type(current).__name__}), got {value!r}")


def _number(value: Any, kind: type) -> Any:
    if isinstance(value, bool):
        raise TypeError
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(value)
    return float(value)


def _flat_numbers(value: Any) -> list[float]:
    """PIXEL_MEANS is ``[[[b, g, r]]]`` in Detectron files."""
    out: list[float] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            stack.extend(reversed(v))
        else:
            out.append(float(v))
    if len(out) != 3:
        raise ValueError
    return out


def _lists(obj: Any) -> Any:
    if isinstance(obj, (list, tuple)):
        return [_lists(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _lists(v) for k, v in obj.items()}
    return obj


def get_cfg() -> DetectronConfig:
    """A fresh config holding Detectron's defaults (Detectron semantics: configuration)."""
    return DetectronConfig()


def load_detectron_cfg(
    path_or_dict: Union[str, os.PathLike, Mapping[str, Any], DetectronConfig, None],
) -> DetectronConfig:
    """Read a Detectron YAML config (or a dict of the same shape) over the defaults.

    Example::

        cfg = load_detectron_cfg("configs/detectron/e2e_mask_rcnn_R-50-FPN_1x.yaml")
        cfg = load_detectron_cfg({"TRAIN": {"SCALES": [800]}, "MODEL.MASK_ON": True})

    Raises:
        ConfigError: unknown key (with the nearest valid one) or a bad value.
        FileNotFoundError: the YAML path does not exist.
    """
    if isinstance(path_or_dict, DetectronConfig):
        return path_or_dict.clone()
    cfg = get_cfg()
    if path_or_dict is None:
        return cfg
    if isinstance(path_or_dict, Mapping):
        cfg.merge_from_dict(path_or_dict)
    else:
        if not os.path.exists(path_or_dict):
            raise FileNotFoundError(f"Detectron config file not found: {path_or_dict}")
        cfg.merge_from_file(path_or_dict)
    return cfg
