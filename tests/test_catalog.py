"""Dataset catalog: Python and YAML registration, built-ins under a data root."""

from __future__ import annotations

import os

import pytest

from lit_roidata.catalog import DATA_ROOT_ENV, Catalog, DatasetCatalog, builtin_datasets


def test_register_get_names():
    cat = Catalog(builtins=False)
    spec = cat.register("mine", "/im", "/ann.json", image_prefix="P_")
    assert cat.get("mine") == spec and spec.image_prefix == "P_"
    assert cat.names() == ["mine"] and "mine" in cat
    with pytest.raises(ValueError, match="already registered"):
        cat.register("mine", "/other", "/ann.json")
    cat.register("mine", "/other", "/ann.json", overwrite=True)
    assert cat.get("mine").image_dir == "/other"


def test_unknown_name_lists_known_names():
    cat = Catalog(builtins=False)
    cat.register("coco_small", "/im", "/a.json")
    with pytest.raises(KeyError, match=r"'coco_smal' is not in the catalog\. Did you mean "
                                       r"'coco_small'\?.*Known datasets: coco_small"):
        cat.get("coco_smal")


def test_builtins_resolve_under_data_root(monkeypatch, tmp_path):
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    cat = Catalog()
    s = cat.get("coco_2017_train")
    assert s.image_dir == os.path.join(str(tmp_path), "coco/coco_train2017")
    assert s.annotation_file == os.path.join(str(tmp_path),
                                             "coco/annotations/instances_train2017.json")
    assert cat.get("coco_2017_test").image_prefix == "COCO_test2015_"
    assert cat.get("keypoints_coco_2014_train").annotation_file.endswith(
        "person_keypoints_train2014.json")
    for name in ("coco_2014_train", "coco_2014_valminusminival", "coco_2014_minival",
                 "coco_2017_val", "keypoints_coco_2017_val"):
        assert name in cat.names()
    cat.set_data_root("/elsewhere")
    assert cat.get("coco_2017_val").image_dir == "/elsewhere/coco/coco_val2017"
    assert builtin_datasets("/r")["coco_2014_minival"].image_dir == "/r/coco/coco_val2014"


def test_user_registration_overrides_builtin():
    cat = Catalog("/root")
    cat.register("coco_2017_val", "/mine", "/mine.json")
    assert cat.get("coco_2017_val").image_dir == "/mine"
    assert cat.names().count("coco_2017_val") == 1


def test_load_yaml(tmp_path):
    (tmp_path / "cat.yaml").write_text(
        "datasets:\n"
        "  a_train:\n"
        "    image_dir: imgs\n"
        "    annotation_file: ann/train.json\n"
        "  b_val:\n"
        "    image_dir: /abs/imgs\n"
        "    annotation_file: /abs/val.json\n"
        "    image_prefix: X_\n"
        "    proposal_file: props.pkl\n")
    cat = Catalog(builtins=False)
    assert cat.load_yaml(tmp_path / "cat.yaml") == ["a_train", "b_val"]
    a = cat.get("a_train")
    assert a.image_dir == str(tmp_path / "imgs")
    assert a.annotation_file == str(tmp_path / "ann/train.json")
    b = cat.get("b_val")
    assert b.image_dir == "/abs/imgs" and b.image_prefix == "X_"
    assert b.proposal_file == str(tmp_path / "props.pkl")


def test_load_yaml_data_root_and_errors(tmp_path):
    (tmp_path / "root.yaml").write_text("data_root: /data\n")
    cat = Catalog()
    cat.load_yaml(tmp_path / "root.yaml")
    assert cat.data_root == "/data"
    (tmp_path / "bad.yaml").write_text("datasets:\n  x:\n    image_dir: a\n    colour: red\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: dataset 'x': unknown keys \['colour'\], "
                                         r"missing keys \['annotation_file'\]"):
        Catalog().load_yaml(tmp_path / "bad.yaml")
    (tmp_path / "worse.yaml").write_text("datasets: [1, 2\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        Catalog().load_yaml(tmp_path / "worse.yaml")


def test_default_catalog_is_a_catalog():
    assert isinstance(DatasetCatalog, Catalog)
    assert "coco_2017_train" in DatasetCatalog.names()
    private = DatasetCatalog.copy()
    private.register("only_here", "/i", "/a.json")
    assert "only_here" not in DatasetCatalog
