"""The chunked (bounded-memory) COCO decode and gt build equal the whole-file ones.

``decode_chunked`` cuts the ``images`` / ``annotations`` arrays into windows of a few
bytes to many; for every window size, JSON layout (minified, pretty-printed, tabs and
CRLF, spaces around separators, any key order) and adversarial strings (file names that
contain ``},{``, quotes, backslashes, unicode), its columns must equal the generic
decoder's on the whole parsed file, and the streamed gt table (``load_coco_json``)
must equal the reference table built from those columns. A malformed record or a syntax
error in a late window still names the file and the record or position; the cache a
build writes is byte-identical to the one the whole-file table gives.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.roidb.coco import load_coco_json
from lit_roidata.roidb.decode import decode_chunked, decode_generic
from lit_roidata.roidb.info import RoIDBInputError
from roidb_fixtures import make_coco
from test_roidb_decode import assert_same, coco

sys.path.insert(0, os.path.dirname(__file__))
from oracles import coco as coco_oracle  # noqa: E402  (the whole-file table, as before)

NAMES = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
TRICKY = ['a},{"id": 1}', 'q"uote', "back\\slash\\", "\\\"},{", "日本語.jpg", "tab\there", "}, {"]


def dump(data: dict, layout: str, key_order: list) -> bytes:
    data = {k: data[k] for k in key_order if k in data}
    if layout == "min":
        return orjson.dumps(data)
    if layout == "indent1":
        return json.dumps(data, indent=1, ensure_ascii=False).encode()
    if layout == "indent4-crlf":
        return json.dumps(data, indent=4).replace("\n", "\r\n").encode()
    if layout == "tabs":
        return json.dumps(data, indent="\t", separators=(" , ", " : ")).encode()
    return json.dumps(data, separators=(" ,\n", ":  ")).encode()


LAYOUTS = st.sampled_from(["min", "indent1", "indent4-crlf", "tabs", "spaced"])
ORDERS = st.permutations(["info", "images", "annotations", "categories", "licenses"])


@st.composite
def files(draw):
    data = draw(coco())
    data["info"] = {"description": draw(NAMES), "nested": [{"a": [1, {"b": "},{"}]}]}
    data["licenses"] = [{"id": 1, "name": draw(NAMES)}]
    for im in data["images"]:
        im["file_name"] = draw(st.one_of(NAMES, st.sampled_from(TRICKY))) + im["file_name"]
        if draw(st.integers(0, 3)) == 0:
            im["coco_url"] = draw(st.sampled_from(TRICKY))
    for a in data["annotations"]:
        if draw(st.integers(0, 4)) == 0:
            a["attributes"] = [{"k": draw(st.sampled_from(TRICKY))}, {"k": 1}]
        if draw(st.integers(0, 9)) == 0:
            a["iscrowd"] = draw(st.booleans())
    return data, dump(data, draw(LAYOUTS), draw(ORDERS))


def table_fields(t) -> dict:
    out = {k: getattr(t, k) for k in ("ids", "widths", "heights", "gt_off", "boxes",
                                      "classes", "seg_areas", "is_crowd", "has_vis_kp",
                                      "file_names")}
    out.update({f"segms.{f}": getattr(t.segms, f) for f in t.segms.FIELDS})
    out["keypoints"] = t.keypoints
    out["counts"] = dict(t.counts)
    return out


def assert_tables_equal(a, b) -> None:
    fa, fb = table_fields(a), table_fields(b)
    assert fa.keys() == fb.keys()
    for k, va in fa.items():
        vb = fb[k]
        if isinstance(va, np.ndarray):
            assert va.dtype == vb.dtype and va.shape == vb.shape, k
            np.testing.assert_array_equal(va, vb, err_msg=k)
        else:
            assert va == vb, k


@settings(deadline=None, max_examples=80)
@given(f=files(), window=st.one_of(st.integers(1, 64), st.integers(65, 4000)),
       required=st.booleans())
def test_chunked_equals_whole_file(tmp_path_factory, f, window, required):
    data, raw = f
    p = tmp_path_factory.mktemp("chunk") / "ann.json"
    p.write_bytes(raw)
    whole = decode_generic(orjson.loads(raw), str(p))
    chunked = decode_chunked(str(p), window_bytes=window)
    assert_same(chunked, whole)
    try:
        ref = coco_oracle.table_from_raw(whole, name="x", keypoints_required=required)
    except RoIDBInputError:
        with pytest.raises(RoIDBInputError):
            load_coco_json(str(p), name="x", window_bytes=window, keypoints_required=required)
        return
    got = load_coco_json(str(p), name="x", window_bytes=window, keypoints_required=required)
    assert_tables_equal(got, ref)


def _big(tmp_path, n_images=60, **kw):
    data = make_coco(7, n_images=n_images, max_anns=6, keypoints=True, **kw)
    return data, tmp_path / "big.json"


@pytest.mark.parametrize("field,value", [("bbox", None), ("category_id", "dog"),
                                         ("area", "big"), ("segmentation", 7)])
def test_malformed_record_in_a_late_window_is_named(tmp_path, field, value):
    data, p = _big(tmp_path)
    a = data["annotations"][-3]
    a[field] = value
    p.write_bytes(orjson.dumps(data))
    with pytest.raises(RoIDBInputError) as ei:
        load_coco_json(str(p), name="x", window_bytes=300)
    msg = str(ei.value)
    assert str(p) in msg and f"annotation id {a['id']}" in msg and \
        f"image id {a['image_id']}" in msg


def test_record_without_id_is_counted_from_the_file_start(tmp_path):
    data, p = _big(tmp_path)
    k = len(data["annotations"]) - 2
    a = data["annotations"][k]
    del a["id"]
    a["bbox"] = [1, 2, 3]
    p.write_bytes(orjson.dumps(data))
    with pytest.raises(RoIDBInputError, match=rf"annotation #{k} \(no 'id'\)"):
        decode_chunked(str(p), window_bytes=200)


def test_syntax_error_late_names_line_and_column(tmp_path):
    data, p = _big(tmp_path)
    text = json.dumps(data, indent=1)
    cut = text.rindex('"image_id"')
    bad = text[:cut] + '"image_id" 5,' + text[cut:]  # a missing ':' late in the file
    p.write_text(bad)
    try:
        orjson.loads(bad)
    except orjson.JSONDecodeError as exc:
        line = exc.lineno
    with pytest.raises(RoIDBInputError, match=rf"big\.json: malformed JSON at line {line}, "):
        decode_chunked(str(p), window_bytes=500)


@pytest.mark.parametrize("keep", [0.5, 0.999])
def test_truncated_file_is_named(tmp_path, keep):
    data, p = _big(tmp_path)
    raw = orjson.dumps(data)
    p.write_bytes(raw[:int(len(raw) * keep)])
    with pytest.raises(RoIDBInputError, match=r"big\.json: malformed JSON at line 1"):
        load_coco_json(str(p), name="x", window_bytes=400)


@pytest.mark.parametrize("text,match", [
    ("[1, 2]", "expected a JSON object at the top level"),
    ('{"annotations": []}', "no 'images' list"),
    ('{"images": [], "categories": 5}', "'categories' must be a list"),
    ('{"images": [], "annotations": {"a": 1}}', "'annotations' must be a list"),
    ('{"images": [], "images": []}', "appears twice"),
    ('{"images": []} x', "trailing characters"),
])
def test_top_level_errors(tmp_path, text, match):
    p = tmp_path / "t.json"
    p.write_text(text)
    with pytest.raises(RoIDBInputError, match=match):
        decode_chunked(str(p))


def test_annotations_before_images_and_empty_arrays(tmp_path):
    data = make_coco(3, n_images=5)
    p = tmp_path / "o.json"
    p.write_bytes(orjson.dumps({"categories": data["categories"],
                                "annotations": data["annotations"], "images": data["images"]}))
    ref = coco_oracle.table_from_raw(decode_generic(data, str(p)), name="x")
    assert_tables_equal(load_coco_json(str(p), name="x", window_bytes=50), ref)
    p.write_text('{"images": [ ], "annotations": [\n], "categories": []}')
    t = load_coco_json(str(p), name="x")
    assert t.ids.size == 0 and t.boxes.shape == (0, 4)


def _cache_files(root) -> dict:
    """``{key dir/file: bytes}`` of every cache under ``root`` (manifest without timing)."""
    out = {}
    for d in sorted(os.listdir(root)):
        if not d.startswith("roidb-") or d.endswith(".lock"):
            continue
        for f in sorted(os.listdir(os.path.join(root, d))):
            if f in ("verified", "last_used"):
                continue
            with open(os.path.join(root, d, f), "rb") as fh:
                data = fh.read()
            if f == "manifest.json":
                m = json.loads(data)
                m["report"].pop("build_seconds")
                data = json.dumps(m, sort_keys=True).encode()
            out[f"{d}/{f}"] = data
    return out


def _whole_file_load(path, *, name, gt_min_area=-1, keypoints_required=False,
                     categories_hook=None, **_):
    """The previous build's gt path: the whole file decoded, then the reference table."""
    with open(path, "rb") as fh:
        raw = decode_generic(orjson.loads(fh.read()), path)
    order = categories_hook(raw.categories) if categories_hook else None
    return coco_oracle.table_from_raw(raw, name=name, gt_min_area=gt_min_area,
                                      class_order=order, keypoints_required=keypoints_required)


@pytest.mark.parametrize("policy", ["strict", "by_name"])
def test_cache_bytes_and_keys_identical_to_whole_file_build(tmp_path, monkeypatch, policy):
    """Demo data (polygons, crowd RLEs, keypoints, two training sets) and a fixture with
    keypoints: same content keys, same bytes in every cache file."""
    from lit_roidata.config import get_cfg
    from lit_roidata.demo import ensure_demo_data, register_demo_datasets
    from lit_roidata.roidb import build as build_mod
    from lit_roidata.roidb import combined_roidb_for_training, roidb_for_evaluation

    monkeypatch.setenv("LIT_ROIDATA_BUILD_IN_PROCESS", "1")
    monkeypatch.setattr(build_mod.load_coco_json, "__kwdefaults__",
                        dict(build_mod.load_coco_json.__kwdefaults__, window_bytes=700))  # many windows
    demo = tmp_path / "demo"
    ensure_demo_data(demo, num_images={"demo_train_a": 12, "demo_train_b": 8, "demo_val": 5})
    from lit_roidata.catalog import Catalog

    cat = Catalog(builtins=False)
    register_demo_datasets(demo, cat)
    data = make_coco(11, n_images=30, keypoints=True)
    kp = tmp_path / "kp.json"
    kp.write_bytes(json.dumps(data, indent=2).encode())
    cat.register("kp", str(tmp_path), str(kp))
    cfg = get_cfg()

    def build_all(root):
        combined_roidb_for_training(["demo_train_a", "demo_train_b"], (), cfg, str(root),
                                    catalog=cat, category_policy=policy, check_images=False,
                                    progress=False)
        roidb_for_evaluation("demo_val", cfg, str(root), catalog=cat, check_images=False,
                             progress=False)
        combined_roidb_for_training("kp", (), cfg, str(root), catalog=cat, check_images=False,
                                    progress=False)

    build_all(tmp_path / "new")
    monkeypatch.setattr(build_mod, "load_coco_json", _whole_file_load)
    build_all(tmp_path / "old")
    new, old = _cache_files(tmp_path / "new"), _cache_files(tmp_path / "old")
    assert len(new) > 30 and new.keys() == old.keys()
    for k in new:
        assert new[k] == old[k], k
