"""Detectron's option tree: defaults, dotted merges, Detectron YAML files, round trip."""

from __future__ import annotations

import os
import pickle

import pytest

from lit_roidata.config import ConfigError, get_cfg, load_detectron_cfg

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "e2e_mask_rcnn_R-50-FPN_1x.yaml")


def test_defaults_are_detectrons():
    cfg = get_cfg()
    assert cfg.TRAIN.SCALES == (600,) and cfg.TRAIN.MAX_SIZE == 1000
    assert cfg.TRAIN.PROPOSAL_LIMIT == -1 and cfg.TRAIN.CROWD_FILTER_THRESH == 0.7
    assert cfg.MODEL.BBOX_REG_WEIGHTS == (10.0, 10.0, 5.0, 5.0)
    assert cfg.PIXEL_MEANS == (102.9801, 115.9465, 122.7717) and cfg.RNG_SEED == 3
    assert not cfg.RPN.RPN_ON and get_cfg() is not cfg


def test_unknown_key_names_nearest():
    cfg = get_cfg()
    with pytest.raises(ConfigError, match=r"unknown config key 'TRAIN.SCALE'; did you mean "
                                          r"'TRAIN.SCALES'\?"):
        cfg.merge_from_dict({"TRAIN.SCALE": (800,)})
    with pytest.raises(ConfigError, match=r"'TRIAN'.*did you mean 'TRAIN'"):
        cfg.merge_from_dict({"TRIAN": {"SCALES": (1,)}})
    with pytest.raises(ConfigError, match=r"TRAIN.MAX_SIZE' expects a value like 1000"):
        cfg.merge_from_dict({"TRAIN.MAX_SIZE": "big"})


def test_merge_dotted_and_nested():
    cfg = get_cfg()
    cfg.merge_from_dict({"TRAIN.SCALES": [800, 900], "MODEL": {"NUM_CLASSES": 81},
                         "PIXEL_MEANS": [[[1, 2, 3]]], "TRAIN.DATASETS": "coco_2017_train"})
    assert cfg.TRAIN.SCALES == (800, 900) and cfg.MODEL.NUM_CLASSES == 81
    assert cfg.PIXEL_MEANS == (1.0, 2.0, 3.0)
    assert cfg.TRAIN.DATASETS == ("coco_2017_train",)
    assert cfg.get("TRAIN.SCALES") == (800, 900)


@pytest.mark.parametrize("flag", ["MODEL.FASTER_RCNN", "MODEL.RPN_ONLY"])
def test_rpn_on_is_inferred(flag):
    cfg = get_cfg()
    cfg.merge_from_dict({flag: True})
    assert cfg.RPN.RPN_ON and cfg.TEST["PRECOMPUTED_PROPOSALS"] is False


def test_load_detectron_yaml():
    cfg = load_detectron_cfg(FIXTURE)
    assert cfg.TRAIN.DATASETS == ("coco_2014_train", "coco_2014_valminusminival")
    assert cfg.TRAIN.SCALES == (800,) and cfg.TRAIN.MAX_SIZE == 1333
    assert cfg.TRAIN.BATCH_SIZE_PER_IM == 512 and cfg.NUM_GPUS == 8
    assert cfg.MODEL.MASK_ON and cfg.MODEL.FASTER_RCNN and cfg.RPN.RPN_ON
    assert cfg.FPN.FPN_ON and cfg.FPN.MULTILEVEL_RPN and cfg.MRCNN.RESOLUTION == 28
    assert cfg.TRAIN.WEIGHTS.startswith("https://")
    assert cfg.TEST["DATASETS"] == ("coco_2014_minival",) and cfg.SOLVER["MAX_ITER"] == 90000
    assert cfg.OUTPUT_DIR == "."


def test_round_trip_via_dump(tmp_path):
    cfg = load_detectron_cfg(FIXTURE)
    p = tmp_path / "dumped.yaml"
    p.write_text(cfg.dump())
    again = load_detectron_cfg(str(p))
    assert again.dump() == cfg.dump()
    assert again.TRAIN == cfg.TRAIN and again.MODEL == cfg.MODEL and again.FPN == cfg.FPN
    assert load_detectron_cfg(cfg) is not cfg


def test_yaml_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_detectron_cfg(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("TRAIN:\n  SCALEZ: (800,)\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: unknown config key 'TRAIN.SCALEZ'"):
        load_detectron_cfg(str(bad))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_typo_under_test_aug_sections_is_an_error(tmp_path):
    bad = tmp_path / "aug.yaml"
    bad.write_text("TEST:\n  BBOX_AUG:\n    ENABLD: true\n")
    with pytest.raises(ConfigError, match=r"aug\.yaml: unknown config key "
                                          r"'TEST.BBOX_AUG.ENABLD'; did you mean "
                                          r"'TEST.BBOX_AUG.ENABLED'\?"):
        load_detectron_cfg(str(bad))
    for key in ("TEST.MASK_AUG.HUER", "TEST.KPS_AUG.SCALE", "TEST.SOFT_NMS.SIGMAA"):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_detectron_cfg({key: 1})
    with pytest.raises(ConfigError, match=r"'TEST.BBOX_AUG.MAX_SIZE' expects a value like "
                                          r"4000 \(int\), got 'big'"):
        load_detectron_cfg({"TEST": {"BBOX_AUG": {"MAX_SIZE": "big"}}})
    cfg = load_detectron_cfg({"TEST.BBOX_AUG": {"ENABLED": True, "SCALES": "(400, 500)"}})
    assert cfg.TEST.BBOX_AUG.ENABLED and cfg.TEST.BBOX_AUG.SCALES == (400, 500)


def test_float_where_detectron_means_a_float(tmp_path):
    f = tmp_path / "retina.yaml"
    f.write_text("RETINANET:\n  RETINANET_ON: true\n  ANCHOR_SCALE: 4.5\nFPN:\n  FPN_ON: true\n")
    assert load_detectron_cfg(str(f)).RETINANET.ANCHOR_SCALE == 4.5
    # Detectron's own int spelling still loads (widened to a float), as do ints for
    # float options, which Detectron and plain yacs reject
    cfg = load_detectron_cfg({"RETINANET.ANCHOR_SCALE": 4, "SOLVER.BASE_LR": 1,
                              "TRAIN.RPN_STRADDLE_THRESH": -1})
    assert cfg.RETINANET.ANCHOR_SCALE == 4.0 and isinstance(cfg.RETINANET.ANCHOR_SCALE, float)
    assert cfg.SOLVER.BASE_LR == 1.0 and cfg.TRAIN.RPN_STRADDLE_THRESH == -1.0
    # no narrowing: a float for an int option, or an int for a bool, is an error
    with pytest.raises(ConfigError, match=r"'TRAIN.MAX_SIZE' expects a value like 1000 "
                                          r"\(int\), got 1333.5"):
        load_detectron_cfg({"TRAIN.MAX_SIZE": 1333.5})
    with pytest.raises(ConfigError, match=r"'MODEL.MASK_ON'.*got 1 \(int\)"):
        load_detectron_cfg({"MODEL.MASK_ON": 1})
    with pytest.raises(ConfigError, match=r"'RPN.SIZES'"):
        load_detectron_cfg({"RPN.SIZES": ["a"]})
    with pytest.raises(ConfigError, match=r"'TRAIN.SCALES'.*got None"):
        load_detectron_cfg({"TRAIN.SCALES": None})


def test_built_config_is_frozen():
    cfg = load_detectron_cfg(FIXTURE)
    assert cfg.is_frozen() and cfg.TEST.is_frozen() and cfg.TEST.BBOX_AUG.is_frozen()
    with pytest.raises(AttributeError, match=r"cannot set 'TRAIN.SCALES': the Detectron "
                                             r"config is frozen"):
        cfg.TRAIN.SCALES = (1,)
    with pytest.raises(AttributeError, match=r"cannot set 'TEST.SCALE'"):
        cfg.TEST["SCALE"] = 1
    with pytest.raises(AttributeError, match="frozen"):
        cfg.merge_from_dict({"TRAIN.MAX_SIZE": 1})
    with pytest.raises(AttributeError, match="frozen"):
        del cfg.SOLVER["MAX_ITER"]
    assert cfg.TRAIN.SCALES == (800,) and cfg.SOLVER.MAX_ITER == 90000
    # copies stay frozen; a changed copy is built from it
    again = cfg.clone()
    assert again.is_frozen() and again == cfg
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert pickle.loads(pickle.dumps(cfg)).is_frozen()
    other = load_detectron_cfg(cfg, {"TRAIN.SCALES": (640,)})
    assert other.is_frozen() and other.TRAIN.SCALES == (640,) and cfg.TRAIN.SCALES == (800,)
    assert not load_detectron_cfg(None, freeze=False).is_frozen()
    assert not get_cfg().is_frozen()


def test_attribute_access_in_every_section():
    cfg = load_detectron_cfg(FIXTURE)
    assert cfg.TEST.SCALE == 800 and cfg.TEST.DATASETS == ("coco_2014_minival",)
    assert cfg.SOLVER.BASE_LR == 0.02 and cfg.SOLVER.STEPS == [0, 60000, 80000]
    assert cfg.TEST.BBOX_AUG.MAX_SIZE == 4000 and cfg.FAST_RCNN.ROI_BOX_HEAD.endswith("head")
    assert cfg.TEST["SCALE"] == cfg.get("TEST.SCALE") == 800  # dict access still works
    assert cfg.TEST.get("NOT_A_KEY", 5) == 5
    with pytest.raises(AttributeError, match=r"'TEST.SCAEL'; did you mean 'TEST.SCALE'"):
        cfg.TEST.SCAEL
    with pytest.raises(ConfigError, match=r"'SOLVER.MAX_ITERS'; did you mean"):
        cfg.get("SOLVER.MAX_ITERS")


def test_merge_is_checked_before_anything_changes():
    cfg = get_cfg()
    with pytest.raises(ConfigError, match="TRAIN.SCALEZ"):
        cfg.merge_from_dict({"TRAIN.MAX_SIZE": 1333, "TRAIN.SCALEZ": (800,)})
    assert cfg.TRAIN.MAX_SIZE == 1000


def test_merge_from_list_and_detectron_key_history(caplog):
    cfg = get_cfg()
    cfg.merge_from_list(["TRAIN.SCALES", "(800, 900)", "SOLVER.BASE_LR", "0.01",
                         "MODEL.FASTER_RCNN", "True", "OUTPUT_DIR", "runs/x"])
    assert cfg.TRAIN.SCALES == (800, 900) and cfg.SOLVER.BASE_LR == 0.01
    assert cfg.RPN.RPN_ON and cfg.OUTPUT_DIR == "runs/x"
    with pytest.raises(ConfigError, match="odd length"):
        cfg.merge_from_list(["TRAIN.SCALES"])
    # Detectron's deprecated keys are ignored (with a warning); renamed ones say what to write
    cfg.merge_from_dict({"TRAIN.DROPOUT": True, "USE_GPU_NMS": True})
    with pytest.raises(ConfigError, match=r"TRAIN.DATASET was renamed to TRAIN.DATASETS"):
        cfg.merge_from_dict({"TRAIN.DATASET": "coco_2014_train"})


def test_yacs_type_check_is_still_there():
    # the merge relies on yacs' type check; an upgrade that renames it must fail here
    from yacs.config import _check_and_coerce_cfg_value_type

    assert _check_and_coerce_cfg_value_type([1], (0,), "K", "A.K") == (1,)
    with pytest.raises(ValueError):
        _check_and_coerce_cfg_value_type("x", 0, "K", "A.K")


@pytest.mark.parametrize("name", sorted(os.listdir(os.path.join(REPO, "configs", "detectron"))))
def test_shipped_detectron_configs_load(name):
    cfg = load_detectron_cfg(os.path.join(REPO, "configs", "detectron", name))
    assert cfg.is_frozen() and cfg.MODEL.NUM_CLASSES > 0 and cfg.TRAIN.DATASETS


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(os.path.join(REPO, "configs"))
                                        if n.endswith(".yaml")))
def test_lightning_cli_configs_build_their_detectron_config(name):
    """The data section of every LightningCLI config builds a config (as the data
    module does: Detectron file, then model_type flags, then overrides)."""
    import yaml

    from lit_roidata.minibatch.model_type import flags_for_model_type

    with open(os.path.join(REPO, "configs", name), encoding="utf-8") as fh:
        doc = yaml.safe_load(fh)
    args = (doc.get("data") or {}).get("init_args") or {}
    source = args.get("detectron_config")
    if source is not None:
        source = os.path.join(REPO, source)
    flags = flags_for_model_type(args["model_type"]) if args.get("model_type") else None
    cfg = load_detectron_cfg(source, flags, args.get("overrides") or {})
    assert cfg.is_frozen()


def test_frozen_reads_follow_defrost_and_refreeze():
    """Frozen nodes mirror their keys for fast attribute reads; the mirror must follow a
    defrost / change / freeze cycle and refuse dict-level changes while frozen."""
    cfg = load_detectron_cfg(None)
    with pytest.raises(AttributeError, match="frozen"):
        cfg.TRAIN.update({"SCALES": (1,)})
    for change in (lambda: cfg.TRAIN.pop("SCALES"), cfg.clear,
                   lambda: cfg.setdefault("NEW", 1), cfg.popitem):
        with pytest.raises(AttributeError, match="frozen"):
            change()
    copy_ = cfg.clone()
    copy_.defrost()
    copy_.TRAIN.SCALES = (5,)
    copy_.TEST.merge_from_dict({"SCALE": 7})
    assert copy_.TRAIN.SCALES == (5,) and copy_.TEST.SCALE == 7
    copy_.freeze()
    assert copy_.TRAIN.SCALES == (5,) and copy_.TEST.SCALE == 7 and copy_.TEST is copy_["TEST"]
    assert cfg.TRAIN.SCALES == (600,) and cfg.TEST.SCALE == 600
