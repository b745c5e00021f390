"""Detectron's option tree: defaults, dotted merges, Detectron YAML files, round trip."""

from __future__ import annotations

import os

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
