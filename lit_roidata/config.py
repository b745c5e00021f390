"""Detectron's option tree, with Detectron's defaults, on yacs' ``CfgNode``.

Values are decoded with Detectron's ``literal_eval`` rule and type-checked by yacs; errors
name the file, the key and the nearest valid key; Detectron's inferred options are
re-derived after every merge (docs/detectron_semantics.md, "Configuration").
:func:`load_detectron_cfg` returns a **frozen** config.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import difflib
import math
import os
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import yaml
from yacs.config import CfgNode
from yacs.config import _check_and_coerce_cfg_value_type as _yacs_type_check

__all__ = ["DetectronConfig", "ConfigError", "get_cfg", "load_detectron_cfg", "check_sampler_train"]


class _Missing:
    def __repr__(self) -> str:
        return "<no default>"


_MISSING: Any = _Missing()
_KEY_PATH = "__key_path__"


class ConfigError(KeyError, ValueError):
    """A config key or value that Detectron's option tree does not accept."""

    def __str__(self) -> str:  # KeyError quotes its message; we want plain text.
        return str(self.args[0]) if self.args else ""


class DetectronConfig(CfgNode):
    """Detectron's option tree: a yacs ``CfgNode`` with Detectron's defaults.

    Merges check every key and value before changing anything, then run :meth:`infer`.
    """

    def __init__(self, init_dict: Optional[Mapping[str, Any]] = None,
                 key_list: Optional[list[str]] = None, new_allowed: bool = False) -> None:
        super().__init__(init_dict, key_list, new_allowed)
        self.__dict__[_KEY_PATH] = ".".join(key_list or [])

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        raise AttributeError(name if name.startswith("__")
                             else _unknown(self._full(name), name, self))

    def _full(self, name: str) -> str:
        path = self.__dict__.get(_KEY_PATH, "")
        return f"{path}.{name}" if path else str(name)

    def _refuse_if_frozen(self, name: str) -> None:
        if self.__dict__.get(CfgNode.IMMUTABLE, False):
            raise AttributeError(
                f"cannot set '{self._full(name)}': the Detectron config is frozen once it is "
                f"built. Set it in the Detectron YAML file or the data module's `overrides`, "
                f"or build a changed copy: load_detectron_cfg(cfg, {{'{self._full(name)}': ...}})")

    def _immutable(self, is_immutable: bool) -> None:
        # A frozen node mirrors its keys in its __dict__: attribute reads (on every
        # minibatch) then skip __getattr__ (~50x faster); frozen, it cannot go stale.
        super()._immutable(is_immutable)
        for key in dict.keys(self):
            if is_immutable:
                self.__dict__[key] = dict.__getitem__(self, key)
            else:
                self.__dict__.pop(key, None)

    def __deepcopy__(self, memo: dict) -> "DetectronConfig":
        # copy.deepcopy restores a dict subclass's __dict__ (the frozen flag) before its
        # items, which the frozen check would refuse.
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for k, v in self.items():
            dict.__setitem__(new, k, copy.deepcopy(v, memo))
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def merge_from_dict(self, overrides: Mapping[str, Any], *, source: str = "") -> None:
        """Apply overrides given as dotted keys (``"TRAIN.SCALES"``), nested dicts, or both.

        Nothing changes unless every key and value is accepted.

        Raises:
            ConfigError: an unknown key (naming the nearest valid one), a renamed key, or
                a value of the wrong type; prefixed with ``source`` (e.g. the file) if given.
            AttributeError: the config is frozen.
        """
        self._refuse_if_frozen("(merge)")
        prefix = f"{source}: " if source else ""
        try:
            checked = _check_tree(_nest(overrides), self, [])
            super().merge_from_other_cfg(type(self)(checked))
        except (KeyError, ValueError, AssertionError) as exc:  # ours (ConfigError) or yacs'
            raise ConfigError(f"{prefix}{exc.args[0] if exc.args else exc}") from exc
        self.infer()

    def merge_from_other_cfg(self, cfg_other: Mapping[str, Any]) -> None:
        """Merge another (nested) config or dict; as :meth:`merge_from_dict`."""
        self.merge_from_dict(cfg_other)

    def merge_from_file(self, cfg_filename: Union[str, os.PathLike]) -> None:
        """Merge a Detectron YAML config file (same keys as Detectron).

        Raises:
            FileNotFoundError: the file does not exist.
            ConfigError: invalid YAML, or a bad key/value (the message names the file).
        """
        path = os.fspath(cfg_filename)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Detectron config file not found: {path}")
        with open(path, encoding="utf-8") as fh:
            try:
                data = yaml.safe_load(fh) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path}: a Detectron config must be a mapping at the top level")
        self.merge_from_dict(data, source=path)

    def merge_from_list(self, cfg_list: Sequence[Any]) -> None:
        """Merge ``[key, value, key, value, ...]`` pairs, e.g. from a command line
        (``["TRAIN.SCALES", "(800,)", "SOLVER.BASE_LR", "0.01"]``)."""
        if len(cfg_list) % 2:
            raise ConfigError(f"override list has odd length ({len(cfg_list)}): it must be "
                              f"key, value pairs, e.g. ['TRAIN.SCALES', '(800,)']")
        self.merge_from_dict(dict(zip(cfg_list[0::2], cfg_list[1::2])))

    @classmethod
    def _decode_cfg_value(cls, value: Any) -> Any:
        # yacs' merge decodes each value again; _check_tree has already decoded them
        # with the default's type in view, so only nested dicts are converted here.
        return cls(value) if isinstance(value, dict) and not isinstance(value, CfgNode) \
            else value

    def infer(self) -> None:
        """Derive the inferred options, as Detectron's ``assert_and_infer_cfg`` does.

        ``RPN.RPN_ON`` if ``MODEL.FASTER_RCNN`` or ``MODEL.RPN_ONLY``, and
        ``TEST.PRECOMPUTED_PROPOSALS = False`` if RPN or RetinaNet is on."""
        if "MODEL" not in self:  # a section merged on its own: nothing to infer here
            return
        if self.MODEL.FASTER_RCNN or self.MODEL.RPN_ONLY:
            self.RPN.RPN_ON = True
        if self.RPN.RPN_ON or self.RETINANET.RETINANET_ON:
            self.TEST.PRECOMPUTED_PROPOSALS = False

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The value under ``key``, which may be dotted (``cfg.get("TRAIN.SCALES")``).

        Without ``default`` an unknown key raises :class:`ConfigError` naming the
        nearest valid one (unlike ``dict.get``); with it, ``default`` is returned.
        """
        node: Any = self
        parts = str(key).split(".")
        for i, part in enumerate(parts):
            if not isinstance(node, CfgNode) or part not in node:
                if default is not _MISSING:
                    return default
                valid = list(node) if isinstance(node, CfgNode) else []
                raise ConfigError(_unknown(self._full(".".join(parts[: i + 1])), part, valid))
            node = dict.__getitem__(node, part)
        return node

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict with Detectron's layout (tuples kept)."""
        return {k: v.to_dict() if isinstance(v, DetectronConfig) else v for k, v in self.items()}

    def dump(self, **kwargs: Any) -> str:
        """YAML text that :func:`load_detectron_cfg` reads back to an equal config."""
        kwargs.setdefault("sort_keys", False)
        return yaml.safe_dump(_lists(self.to_dict()), **kwargs)

    def clone(self) -> "DetectronConfig":
        """A deep copy (frozen if this config is)."""
        return copy.deepcopy(self)


def _refused_while_frozen(name: str) -> Any:
    """``dict``'s (or yacs') mutator ``name``, refused (``AttributeError``) while frozen."""
    base = getattr(CfgNode, name)

    def method(self, *args: Any, **kwargs: Any) -> Any:
        if not (name == "setdefault" and args[0] in self):  # reading an existing key
            self._refuse_if_frozen(args[0] if name in _KEYED else f"({name})")
        return base(self, *args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"As ``dict.{name}``; refused (``AttributeError``) while frozen."
    return method


_KEYED = ("__setattr__", "__setitem__", "__delitem__", "pop", "setdefault")
for _name in (*_KEYED, "update", "popitem", "clear"):
    setattr(DetectronConfig, _name, _refused_while_frozen(_name))


# Checking before yacs merges: decode, widen, type-check, name the key.
def _nest(tree: Mapping[str, Any]) -> dict[str, Any]:
    """``{"A.B": 1, "A": {"C": 2}}`` -> ``{"A": {"B": 1, "C": 2}}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        parts = str(key).split(".")
        node = out
        for part in parts[:-1]:
            if not isinstance(node := node.setdefault(part, {}), dict):
                raise ConfigError(f"config key '{key}' is given both as a value and as a "
                                  f"section")
        leaf = parts[-1]
        if isinstance(value, Mapping):
            value = _nest(value)
            if isinstance(node.get(leaf), dict):
                node[leaf].update(value)
                continue
        node[leaf] = value
    return out


def _unknown(full_key: str, key: str, valid: Iterable[str]) -> str:
    prefix = full_key[: len(full_key) - len(key)]
    near = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{near[0]}'?" if near else ""
    return f"unknown config key '{full_key}'{hint}"


def _check_tree(tree: Mapping[str, Any], node: DetectronConfig, path: list[str]) -> dict[str, Any]:
    """Every key of ``tree`` checked against ``node``; values decoded and coerced."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        full = ".".join(path + [key])
        if key not in node:
            if _DEFAULTS.key_is_deprecated(full):  # logs a warning, as Detectron does
                continue
            if _DEFAULTS.key_is_renamed(full):  # a KeyError, made a ConfigError by the caller
                _DEFAULTS.raise_key_rename_error(full)
            raise ConfigError(_unknown(full, key, node))
        current = dict.__getitem__(node, key)
        if isinstance(current, CfgNode):
            if not isinstance(value, Mapping):
                raise ConfigError(f"config key '{full}' is a section ({', '.join(current)}); "
                                  f"got {value!r}")
            out[key] = _check_tree(value, current, path + [key])
        else:
            out[key] = _coerce(full, value, current)
    return out


def _coerce(full: str, value: Any, current: Any) -> Any:
    """Detectron's decoding and yacs' type check, with this module's widenings."""
    if isinstance(value, Mapping):
        raise ConfigError(f"config key '{full}' is a value, not a section; got {dict(value)!r}")
    if not isinstance(current, str) and isinstance(value, str):
        with contextlib.suppress(ValueError, SyntaxError):  # Detectron's literal_eval rule
            value = ast.literal_eval(value)
    if _is_number(value) and isinstance(value, int) and isinstance(current, float):
        value = float(value)
    elif isinstance(current, tuple) and isinstance(value, str) \
            and full.endswith(("DATASETS", "PROPOSAL_FILES")):
        value = (value,)
    elif full == "PIXEL_MEANS" and isinstance(value, (list, tuple)):
        value = tuple(float(v) for v in _flat(value))
        if len(value) != 3:
            raise ConfigError(f"config key 'PIXEL_MEANS' expects three BGR means, e.g. "
                              f"[[[102.98, 115.95, 122.77]]]; got {len(value)} numbers")
    bad = value is None or (isinstance(value, bool) != isinstance(current, bool))
    if not bad:
        try:
            value = _yacs_type_check(value, current, full.rsplit(".", 1)[-1], full)
        except ValueError:
            bad = True
    if not bad and isinstance(value, (list, tuple)) and current \
            and all(_is_number(v) for v in current):
        bad = not all(_is_number(v) for v in value)
        if not bad and any(isinstance(v, float) for v in current):
            value = type(value)(float(v) for v in value)
    if bad:
        raise ConfigError(
            f"config key '{full}' expects a value like {current!r} "
            f"({type(current).__name__}), got {value!r} ({type(value).__name__})")
    return value


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _flat(value: Any) -> list[Any]:
    return [x for v in value for x in (_flat(v) if isinstance(v, (list, tuple)) else [v])]


def _lists(obj: Any) -> Any:
    if isinstance(obj, (list, tuple)):
        return [_lists(v) for v in obj]
    return {k: _lists(v) for k, v in obj.items()} if isinstance(obj, dict) else obj


# Defaults: Detectron's, key for key (Detectron semantics: configuration). Keys marked
# "lit_roidata" are not in Detectron.
def _node(**values: Any) -> DetectronConfig:
    return DetectronConfig(values)


_C = DetectronConfig()
# RPN_STRADDLE_THRESH, RPN_MIN_SIZE (pixels) and GT_MIN_AREA (square pixels) are floats
# here; Detectron's are the ints 0, 0 and -1. PROPOSAL_LIMIT (lit_roidata): proposals kept
# per image when training from proposal files; -1 keeps every proposal, as Detectron trains.
_C.TRAIN = _node(
    WEIGHTS="", DATASETS=(), SCALES=(600,), MAX_SIZE=1000, IMS_PER_BATCH=2, BATCH_SIZE_PER_IM=64,
    FG_FRACTION=0.25, FG_THRESH=0.5, BG_THRESH_HI=0.5, BG_THRESH_LO=0.0, USE_FLIPPED=True,
    BBOX_THRESH=0.5, SNAPSHOT_ITERS=20000, PROPOSAL_FILES=(), ASPECT_GROUPING=True,
    RPN_POSITIVE_OVERLAP=0.7, RPN_NEGATIVE_OVERLAP=0.3, RPN_FG_FRACTION=0.5,
    RPN_BATCH_SIZE_PER_IM=256, RPN_NMS_THRESH=0.7, RPN_PRE_NMS_TOP_N=12000, RPN_POST_NMS_TOP_N=2000,
    RPN_STRADDLE_THRESH=0.0, RPN_MIN_SIZE=0.0, CROWD_FILTER_THRESH=0.7, GT_MIN_AREA=-1.0,
    FREEZE_CONV_BODY=False, FREEZE_AT=2, AUTO_RESUME=True, COPY_WEIGHTS=False, PROPOSAL_LIMIT=-1)

_C.DATA_LOADER = _node(NUM_THREADS=4, MINIBATCH_QUEUE_SIZE=64, BLOBS_QUEUE_CAPACITY=8)

# lit_roidata (Detectron2's names and defaults): the training sampler. "TrainingSampler"
# is Detectron's stream; "RepeatFactorTrainingSampler" repeats images with rare
# categories (LVIS), r(I) = max over c in I of max(1, sqrt(REPEAT_THRESHOLD / f(c)))
# (REPEAT_SQRT False drops the sqrt). Detectron2's other DATALOADER keys are not read.
_C.DATALOADER = _node(SAMPLER_TRAIN="TrainingSampler", REPEAT_THRESHOLD=0.0, REPEAT_SQRT=True)

# PRECOMPUTED_PROPOSALS: inferred (see DetectronConfig.infer)
_C.TEST = _node(
    WEIGHTS="", DATASETS=(), SCALE=600, MAX_SIZE=1000, NMS=0.3, BBOX_REG=True, PROPOSAL_FILES=(),
    PROPOSAL_LIMIT=2000, RPN_NMS_THRESH=0.7, RPN_PRE_NMS_TOP_N=12000, RPN_POST_NMS_TOP_N=2000,
    RPN_MIN_SIZE=0, DETECTIONS_PER_IM=100, SCORE_THRESH=0.05, COMPETITION_MODE=True,
    FORCE_JSON_DATASET_EVAL=False, PRECOMPUTED_PROPOSALS=True)

_C.TEST.BBOX_AUG = _node(
    ENABLED=False, SCORE_HEUR="UNION", COORD_HEUR="UNION", H_FLIP=False, SCALES=(),
    MAX_SIZE=4000, SCALE_H_FLIP=False, SCALE_SIZE_DEP=False, AREA_TH_LO=50**2,
    AREA_TH_HI=180**2, ASPECT_RATIOS=(), ASPECT_RATIO_H_FLIP=False)

_AUG = dict(H_FLIP=False, SCALES=(), MAX_SIZE=4000, SCALE_H_FLIP=False, SCALE_SIZE_DEP=False,
            AREA_TH=180**2, ASPECT_RATIOS=(), ASPECT_RATIO_H_FLIP=False)
_C.TEST.MASK_AUG = _node(ENABLED=False, HEUR="SOFT_AVG", **_AUG)
_C.TEST.KPS_AUG = _node(ENABLED=False, HEUR="HM_AVG", **_AUG)

_C.TEST.SOFT_NMS = _node(ENABLED=False, METHOD="linear", SIGMA=0.5)

_C.TEST.BBOX_VOTE = _node(ENABLED=False, VOTE_TH=0.8, SCORING_METHOD="ID", SCORING_METHOD_BETA=1.0)

_C.MODEL = _node(
    TYPE="", CONV_BODY="", NUM_CLASSES=-1, CLS_AGNOSTIC_BBOX_REG=False,
    BBOX_REG_WEIGHTS=(10.0, 10.0, 5.0, 5.0), FASTER_RCNN=False, MASK_ON=False,
    KEYPOINTS_ON=False, RPN_ONLY=False, EXECUTION_TYPE="dag")

# ANCHOR_SCALE: Detectron's int 4; a float here, so 4.5 is accepted
# LOSS_BBOX_WEIGHT, BBOX_REG_WEIGHTS: lit_roidata (later Detectron forks).
_C.RETINANET = _node(
    RETINANET_ON=False, ASPECT_RATIOS=(0.5, 1.0, 2.0), SCALES_PER_OCTAVE=3, ANCHOR_SCALE=4.0,
    NUM_CONVS=4, BBOX_REG_WEIGHT=1.0, BBOX_REG_BETA=0.11, PRE_NMS_TOP_N=1000, POSITIVE_OVERLAP=0.5,
    NEGATIVE_OVERLAP=0.4, LOSS_ALPHA=0.25, LOSS_GAMMA=2.0, PRIOR_PROB=0.01,
    SHARE_CLS_BBOX_TOWER=False, CLASS_SPECIFIC_BBOX=False, SOFTMAX=False, INFERENCE_TH=0.05,
    LOSS_BBOX_WEIGHT=1.0, BBOX_REG_WEIGHTS=(1.0, 1.0, 1.0, 1.0))

_C.SOLVER = _node(
    BASE_LR=0.001, LR_POLICY="step", GAMMA=0.1, STEP_SIZE=30000, STEPS=[], LRS=[], MAX_ITER=40000,
    MOMENTUM=0.9, WEIGHT_DECAY=0.0005, WEIGHT_DECAY_GN=0.0, BIAS_DOUBLE_LR=True,
    BIAS_WEIGHT_DECAY=False, WARM_UP_ITERS=500, WARM_UP_FACTOR=1.0 / 3.0, WARM_UP_METHOD="linear",
    SCALE_MOMENTUM=True, SCALE_MOMENTUM_THRESHOLD=1.1, LOG_LR_CHANGE_THRESHOLD=1.1)

_C.FAST_RCNN = _node(
    ROI_BOX_HEAD="", MLP_HEAD_DIM=1024, CONV_HEAD_DIM=256, NUM_STACKED_CONVS=4,
    ROI_XFORM_METHOD="RoIPoolF", ROI_XFORM_SAMPLING_RATIO=0, ROI_XFORM_RESOLUTION=14)

_C.RPN = _node(  # RPN_ON: inferred (see DetectronConfig.infer)
    RPN_ON=False, SIZES=(64, 128, 256, 512), STRIDE=16, ASPECT_RATIOS=(0.5, 1.0, 2.0))

_C.FPN = _node(
    FPN_ON=False, DIM=256, ZERO_INIT_LATERAL=False, COARSEST_STRIDE=32, MULTILEVEL_ROIS=False,
    ROI_CANONICAL_SCALE=224, ROI_CANONICAL_LEVEL=4, ROI_MAX_LEVEL=5, ROI_MIN_LEVEL=2,
    MULTILEVEL_RPN=False, RPN_MAX_LEVEL=6, RPN_MIN_LEVEL=2, RPN_ASPECT_RATIOS=(0.5, 1.0, 2.0),
    RPN_ANCHOR_START_SIZE=32, RPN_COLLECT_SCALE=1, EXTRA_CONV_LEVELS=False, USE_GN=False)

_C.MRCNN = _node(
    ROI_MASK_HEAD="", RESOLUTION=14, ROI_XFORM_METHOD="RoIAlign", ROI_XFORM_RESOLUTION=7,
    ROI_XFORM_SAMPLING_RATIO=0, DIM_REDUCED=256, DILATION=2, UPSAMPLE_RATIO=1, USE_FC_OUTPUT=False,
    CONV_INIT="GaussianFill", CLS_SPECIFIC_MASK=True, WEIGHT_LOSS_MASK=1.0, THRESH_BINARIZE=0.5)

_C.KRCNN = _node(
    ROI_KEYPOINTS_HEAD="", HEATMAP_SIZE=-1, UP_SCALE=-1, USE_DECONV=False, DECONV_DIM=256,
    USE_DECONV_OUTPUT=False, DILATION=1, DECONV_KERNEL=4, NUM_KEYPOINTS=-1, NUM_STACKED_CONVS=8,
    CONV_HEAD_DIM=256, CONV_HEAD_KERNEL=3, CONV_INIT="GaussianFill", NMS_OKS=False,
    KEYPOINT_CONFIDENCE="bbox", ROI_XFORM_METHOD="RoIAlign", ROI_XFORM_RESOLUTION=7,
    ROI_XFORM_SAMPLING_RATIO=0, MIN_KEYPOINT_COUNT_FOR_VALID_MINIBATCH=20, INFERENCE_MIN_SIZE=0,
    LOSS_WEIGHT=1.0, NORMALIZE_BY_VISIBLE_KEYPOINTS=True)

_C.RFCN = _node(PS_GRID_SIZE=3)

_C.RESNETS = _node(
    NUM_GROUPS=1, WIDTH_PER_GROUP=64, STRIDE_1X1=True, TRANS_FUNC="bottleneck_transformation",
    STEM_FUNC="basic_bn_stem", SHORTCUT_FUNC="basic_bn_shortcut", RES5_DILATION=1)

_C.GROUP_NORM = _node(DIM_PER_GP=-1, NUM_GROUPS=32, EPSILON=1e-5)

_C.CLUSTER = _node(ON_CLUSTER=False)

# PIXEL_MEANS: BGR; Detectron's (1, 1, 3) array is stored flat as three floats.
_C.update(
    NUM_GPUS=1, USE_NCCL=False, DEDUP_BOXES=1.0 / 16.0, BBOX_XFORM_CLIP=math.log(1000.0 / 16.0),
    PIXEL_MEANS=(102.9801, 115.9465, 122.7717), RNG_SEED=3, EPS=1e-14, ROOT_DIR=os.getcwd(),
    OUTPUT_DIR="/tmp", MATLAB="matlab", MEMONGER=True, MEMONGER_SHARE_ACTIVATIONS=False, VIS=False,
    VIS_TH=0.9, EXPECTED_RESULTS=[], EXPECTED_RESULTS_RTOL=0.1, EXPECTED_RESULTS_ATOL=0.005,
    EXPECTED_RESULTS_EMAIL="", DATA_DIR="", DOWNLOAD_CACHE="/tmp/detectron-download-cache")

_C = DetectronConfig(_C)
# Detectron's deprecated keys (ignored with a warning) and renamed keys (an error that
# says what to write instead).
for _key in ("FINAL_MSG", "MODEL.DILATION", "ROOT_GPU_ID", "RPN.ON",
             "TRAIN.BBOX_NORMALIZE_TARGETS_PRECOMPUTED", "TRAIN.DROPOUT", "USE_GPU_NMS",
             "TEST.NUM_TEST_IMAGES"):
    _C.register_deprecated_key(_key)
_TO_TUPLE = "Also convert to a tuple, e.g. '{0}' -> ('{0}',)".format
for _old, _new, _note in (
        ("MODEL.PS_GRID_SIZE", "RFCN.PS_GRID_SIZE", None),
        ("MODEL.ROI_HEAD", "FAST_RCNN.ROI_BOX_HEAD", None),
        ("MRCNN.MASK_HEAD_NAME", "MRCNN.ROI_MASK_HEAD", None),
        ("TRAIN.DATASET", "TRAIN.DATASETS", _TO_TUPLE("coco_2014_train")),
        ("TRAIN.PROPOSAL_FILE", "TRAIN.PROPOSAL_FILES", _TO_TUPLE("path/to/file")),
        ("TEST.SCALES", "TEST.SCALE", "Also convert from a tuple, e.g. (600,), to an int"),
        ("TEST.DATASET", "TEST.DATASETS", _TO_TUPLE("coco_2014_minival")),
        ("TEST.PROPOSAL_FILE", "TEST.PROPOSAL_FILES", _TO_TUPLE("props.pkl"))):
    _C.register_renamed_key(_old, _new, _note)

_DEFAULTS = _C
_DEFAULTS.freeze()


#: ``DATALOADER.SAMPLER_TRAIN`` values lit_roidata implements.
SAMPLERS_TRAIN = ("TrainingSampler", "RepeatFactorTrainingSampler")


def check_sampler_train(cfg: Any) -> bool:
    """Validate ``DATALOADER.SAMPLER_TRAIN`` / ``REPEAT_THRESHOLD``; ``True`` when the
    config asks for repeat factors (``RepeatFactorTrainingSampler``).

    Raises:
        ConfigError: an unknown sampler name, or a repeat threshold that is not > 0.
    """
    if (name := cfg.DATALOADER.SAMPLER_TRAIN) not in SAMPLERS_TRAIN:
        near = difflib.get_close_matches(str(name), SAMPLERS_TRAIN, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"DATALOADER.SAMPLER_TRAIN={name!r} is not a training sampler "
                          f"lit_roidata implements{hint}; use one of {list(SAMPLERS_TRAIN)} "
                          "(or sampling.repeat_factor_threshold in the data module)")
    if name != "RepeatFactorTrainingSampler":
        return False
    t = cfg.DATALOADER.REPEAT_THRESHOLD
    if not _is_number(t) or not math.isfinite(t) or t <= 0:
        raise ConfigError(f"DATALOADER.REPEAT_THRESHOLD={t!r} with SAMPLER_TRAIN="
                          "RepeatFactorTrainingSampler: the threshold must be a finite number "
                          "> 0 (LVIS uses 0.001); set it, or use SAMPLER_TRAIN: "
                          "TrainingSampler to train without repeat factors")
    return True


def get_cfg() -> DetectronConfig:
    """A fresh, mutable config holding Detectron's defaults."""
    cfg = _DEFAULTS.clone()
    cfg.defrost()
    return cfg


def load_detectron_cfg(
    path_or_dict: Union[str, os.PathLike, Mapping[str, Any], DetectronConfig, None],
    *overrides: Optional[Mapping[str, Any]],
    freeze: bool = True,
) -> DetectronConfig:
    """Build a config: defaults, then a Detectron YAML file (or a dict of the same shape,
    or a copy of a config), then each mapping of ``overrides`` (``None`` skipped) in
    order; infer; freeze unless ``freeze=False``.

    Raises:
        ConfigError: unknown key (with the nearest valid one) or a bad value.
        FileNotFoundError: the YAML path does not exist.
    """
    if isinstance(path_or_dict, DetectronConfig):
        cfg = path_or_dict.clone()
        cfg.defrost()
    else:
        cfg = get_cfg()
        if isinstance(path_or_dict, Mapping):
            cfg.merge_from_dict(path_or_dict)
        elif path_or_dict is not None:
            cfg.merge_from_file(path_or_dict)
    for extra in filter(None, overrides):
        cfg.merge_from_dict(extra)
    cfg.infer()
    check_sampler_train(cfg)
    if freeze:
        cfg.freeze()
    return cfg


def blob_family(cfg: Any) -> str:
    """``"rpn"``, ``"retinanet"`` or ``"fast_rcnn"``: the loader's blob family, in
    Detectron's precedence (RPN, including ``MODEL.FASTER_RCNN`` / ``RPN_ONLY``, else
    RetinaNet, else Fast R-CNN with precomputed proposals).

    Raises:
        ValueError: RetinaNet without ``FPN.FPN_ON`` (Detectron asserts the same).
    """
    if cfg.RPN.RPN_ON or cfg.MODEL.FASTER_RCNN or cfg.MODEL.RPN_ONLY:
        return "rpn"
    if cfg.RETINANET.RETINANET_ON:
        if not cfg.FPN.FPN_ON:
            raise ValueError("RETINANET.RETINANET_ON needs FPN.FPN_ON: True (Detectron's "
                             "RetinaNet is always built on FPN)")
        return "retinanet"
    return "fast_rcnn"
