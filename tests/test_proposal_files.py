"""Proposal files: streamed pickle reading, the columnar .npz, conversion, and every
malformed field getting a named error (issue #10 item 4, issue #11)."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_roidata.cli import main as cli_main
from lit_roidata.config import get_cfg
from lit_roidata.roidb import RoIDBInputError, combined_roidb_for_training
from lit_roidata.roidb.proposal_files import source_from_object
from lit_roidata.roidb.proposals import (build_proposal_table, convert_proposals,
                                         read_proposal_file)
from roidb_fixtures import make_coco, make_proposals, write_dataset

SETTINGS = settings(deadline=None, max_examples=40,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _dump(path, obj, protocol=4) -> str:
    with open(path, "wb") as fh:
        pickle.dump(obj, fh, protocol=protocol)
    return str(path)


def _build(tmp_path, data, proposals, name="d", trust=True):
    cat = write_dataset(str(tmp_path), name, data)
    return combined_roidb_for_training(name, proposals, get_cfg(), str(tmp_path / "c"),
                                       catalog=cat, progress=False, trust_pickle=trust)


def _good(data, n_per=3, dtype=np.float32):
    ids = [im["id"] for im in data["images"]]
    boxes = [np.array([[1, 1, 20, 20]] * n_per, dtype) + k for k in range(len(ids))]
    return {"boxes": boxes, "ids": ids,
            "scores": [np.linspace(1, 0, n_per, dtype=np.float32) for _ in ids]}


# ----------------------------------------------------------------------------- errors
def test_empty_file(tmp_path):
    p = tmp_path / "p.pkl"
    p.write_bytes(b"")
    with pytest.raises(RoIDBInputError, match=r"p\.pkl: the proposal file is empty"):
        read_proposal_file(str(p), trust_pickle=True)


def test_truncated_pickle(tmp_path):
    data = make_coco(1)
    p = tmp_path / "p.pkl"
    _dump(p, _good(data, 50))
    raw = p.read_bytes()
    p.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(RoIDBInputError, match=r"p\.pkl: cannot unpickle.*truncated"):
        read_proposal_file(str(p), trust_pickle=True)


def test_not_a_pickle(tmp_path):
    p = tmp_path / "p.pkl"
    p.write_bytes(b"boxes,scores,ids\n1,2,3\n")
    with pytest.raises(RoIDBInputError, match=r"p\.pkl: cannot unpickle"):
        read_proposal_file(str(p), trust_pickle=True)


@pytest.mark.parametrize("obj,kind", [([np.zeros((2, 4))], "list"), (np.zeros((3, 5, 4)),
                                                                     "ndarray"), (7, "int")])
def test_wrong_top_level_type(tmp_path, obj, kind):
    p = _dump(tmp_path / "p.pkl", obj)
    with pytest.raises(RoIDBInputError, match=rf"p\.pkl: expected a dict .* got {kind}"):
        read_proposal_file(p, trust_pickle=True)


@pytest.mark.parametrize("drop,missing", [("ids", "ids"), ("scores", "scores"),
                                          ("boxes", "boxes")])
def test_missing_keys(tmp_path, drop, missing):
    d = _good(make_coco(1))
    del d[drop]
    p = _dump(tmp_path / "p.pkl", d)
    with pytest.raises(RoIDBInputError, match=rf"p\.pkl: missing key\(s\) \['{missing}'\]"):
        read_proposal_file(p, trust_pickle=True)


def test_detectron2_key_names_accepted(tmp_path):
    d = _good(make_coco(1))
    d["objectness_logits"] = d.pop("scores")
    src = read_proposal_file(_dump(tmp_path / "p.pkl", d), trust_pickle=True)
    assert src.counts.tolist() == [3] * len(d["ids"])


def test_ids_that_are_file_names_named_and_fixable(tmp_path):
    data = make_coco(2)
    d = _good(data)
    names = {im["id"]: im["file_name"] for im in data["images"]}
    d["ids"] = [names[i] for i in d["ids"]]
    p = _dump(tmp_path / "p.pkl", d)
    with pytest.raises(RoIDBInputError, match=rf"p\.pkl: 'ids' record 0 is "
                                              rf"'{d['ids'][0]}' \(str\); ids must be the "
                                              rf"integer image ids.*file name.*--annotations"):
        _build(tmp_path, data, [p])
    # the fix the message names: map them through the annotation json
    cat = write_dataset(str(tmp_path), "d", data)
    ann = cat.get("d").annotation_file
    out = str(tmp_path / "p.npz")
    assert cli_main(["convert-proposals", p, out, "--annotations", ann]) == 0
    db = _build(tmp_path, data, [out])
    assert db.report["datasets"][0]["proposals"]["proposals_in_file"] == 3 * len(d["ids"])


@pytest.mark.parametrize("bad,shown", [(12.5, r"12\.5 \(float\)"), (None, r"None \(NoneType\)"),
                                       (b"x", r"b'x' \(bytes\)")])
def test_ids_not_integers(tmp_path, bad, shown):
    d = _good(make_coco(3))
    d["ids"][1] = bad
    p = _dump(tmp_path / "p.pkl", d)
    with pytest.raises(RoIDBInputError, match=rf"p\.pkl: 'ids' record 1 is {shown}"):
        read_proposal_file(p, trust_pickle=True)


def test_integral_float_ids_accepted_as_detectron_does(tmp_path):
    d = _good(make_coco(3))
    d["ids"] = [float(i) for i in d["ids"]]
    src = read_proposal_file(_dump(tmp_path / "p.pkl", d), trust_pickle=True)
    assert src.ids.dtype == np.int64 and src.ids.tolist() == [int(i) for i in d["ids"]]


def test_ids_of_another_dataset(tmp_path):
    data = make_coco(4)
    d = _good(data)
    d["ids"] = [i + 100000 for i in d["ids"]]
    p = _dump(tmp_path / "p.pkl", d)
    with pytest.raises(RoIDBInputError, match=r"p\.pkl: none of its \d+ record ids .* "
                                              r"proposal file of another dataset"):
        _build(tmp_path, data, [p])


def test_duplicate_ids(tmp_path):
    data = make_coco(4)
    d = _good(data)
    d["ids"][1] = d["ids"][0]
    p = _dump(tmp_path / "p.pkl", d)
    with pytest.raises(RoIDBInputError, match=rf"p\.pkl: 1 image id\(s\) appear more than once: "
                                              rf"\[{d['ids'][0]}\]"):
        _build(tmp_path, data, [p])


@pytest.mark.parametrize("record,what", [
    (np.zeros((2, 3)), r"shape \(2, 3\)"), (np.zeros(8), r"shape \(8,\)"),
    (np.array([["a", "b", "c", "d"]]), r"dtype <U1"), (None, r"dtype object"),
    ([[1, 2, 3, 4], [1, 2]], r"list that is no numeric array")])
def test_boxes_of_wrong_shape_or_type(tmp_path, record, what):
    d = _good(make_coco(5))
    d["boxes"][2] = record
    p = _dump(tmp_path / "p.pkl", d)
    with pytest.raises(RoIDBInputError, match=rf"p\.pkl: record 2 \(image id {d['ids'][2]}\) "
                                              rf"has boxes of {what}; expected a \(P, 4\)"):
        read_proposal_file(p, trust_pickle=True)


@pytest.mark.parametrize("fmt", ["pkl", "npz"])
@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_non_finite_boxes(tmp_path, fmt, value):
    data = make_coco(6)
    d = _good(data)
    d["boxes"][1] = d["boxes"][1].copy()
    d["boxes"][1][2, 0] = value
    p = _dump(tmp_path / "p.pkl", d)
    if fmt == "npz":
        p2 = str(tmp_path / "p.npz")
        convert_proposals(p, p2, trust_pickle=True)
        p = p2
    with pytest.raises(RoIDBInputError, match=rf"p\.{fmt}: 1 proposal\(s\) have NaN or infinite "
                                              rf"coordinates \(image ids \[{d['ids'][1]}\]"):
        _build(tmp_path, data, [p])


def test_scores_length_mismatch(tmp_path):
    d = _good(make_coco(7))
    d["scores"][3] = np.zeros(2, np.float32)
    p = _dump(tmp_path / "p.pkl", d)
    with pytest.raises(RoIDBInputError, match=rf"p\.pkl: record 3 \(image id {d['ids'][3]}\) "
                                              rf"has 3 boxes but 'scores' of shape \(2,\)"):
        read_proposal_file(p, trust_pickle=True)
    d["scores"] = d["scores"][:-1]
    p = _dump(tmp_path / "p.pkl", d)
    with pytest.raises(RoIDBInputError, match=r"'boxes' \(\d+\), 'scores' \(\d+\) and 'ids' "
                                              r"\(\d+\) must have one record per image"):
        read_proposal_file(p, trust_pickle=True)


def test_small_boxes_are_a_counted_drop(tmp_path):
    data = make_coco(8)
    d = _good(data)
    d["boxes"][0] = np.array([[5, 5, 6, 30], [1, 1, 20, 20], [3, 3, 4, 4.5]], np.float32)
    db = _build(tmp_path, data, [_dump(tmp_path / "p.pkl", d)])
    assert db.report["datasets"][0]["proposals"]["proposals_min_size"] == 2


def test_npz_errors(tmp_path):
    data = make_coco(9)
    ids = np.array([im["id"] for im in data["images"]])
    p = tmp_path / "p.npz"
    p.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(RoIDBInputError, match=r"p\.npz: not a readable \.npz file"):
        read_proposal_file(str(p), trust_pickle=True)
    np.savez(p, ids=ids, boxes=np.zeros((0, 4)))
    with pytest.raises(RoIDBInputError, match=r"p\.npz: \.npz proposal file lacks \['counts'\]"):
        read_proposal_file(str(p), trust_pickle=True)
    np.savez(p, ids=np.array([f"{i}.jpg" for i in ids]), counts=np.zeros(ids.size, int),
             boxes=np.zeros((0, 4)))
    with pytest.raises(RoIDBInputError, match=r"p\.npz: 'ids' record 0 is '\d+\.jpg'"):
        read_proposal_file(str(p), trust_pickle=True)
    np.savez(p, ids=ids, counts=np.ones(ids.size, int), boxes=np.zeros((ids.size, 4)),
             scores=np.zeros(ids.size + 1))
    with pytest.raises(RoIDBInputError, match=r"'scores' has shape \(\d+,\) but there are"):
        read_proposal_file(str(p), trust_pickle=True)
    np.savez(p, ids=ids, counts=np.ones(ids.size, int), boxes=np.zeros((ids.size, 4)))
    raw = p.read_bytes()
    p.write_bytes(raw[:len(raw) - 40])  # truncated: the zip directory is gone
    with pytest.raises(RoIDBInputError, match=r"p\.npz: not a readable \.npz file"):
        read_proposal_file(str(p), trust_pickle=True)


# ----------------------------------------------------------------------------- formats
def test_convert_then_build_is_identical(tmp_path):
    data = make_coco(11, n_images=9)
    pkl = make_proposals(11, data, str(tmp_path / "p.pkl"), per_image=40)
    npz = str(tmp_path / "p.npz")
    assert cli_main(["convert-proposals", pkl, npz]) == 0
    with pytest.raises(SystemExit):  # exists: refused without --force
        cli_main(["convert-proposals", pkl, npz])
    z = np.load(npz)
    assert set(z.files) == {"ids", "counts", "boxes", "scores"}
    assert z["boxes"].shape == (int(z["counts"].sum()), 4) == (z["scores"].size, 4)
    a = _build(tmp_path / "a", data, [pkl])
    b = _build(tmp_path / "b", data, [npz])
    for k in ("prop_boxes", "prop_max_overlaps", "prop_max_classes", "prop_gt_map",
              "img_prop_off", "entry_img"):
        np.testing.assert_array_equal(a._a[k], b._a[k], err_msg=k)


def test_convert_refuses_to_overwrite(tmp_path, capsys):
    d = _good(make_coco(1))
    pkl = _dump(tmp_path / "p.pkl", d)
    out = tmp_path / "p.npz"
    out.write_bytes(b"keep me")
    with pytest.raises(SystemExit):
        cli_main(["convert-proposals", pkl, str(out)])
    assert out.read_bytes() == b"keep me"
    assert cli_main(["convert-proposals", pkl, str(out), "--force"]) == 0
    assert "wrote" in capsys.readouterr().out


# ----------------------------------------------------------------------------- streaming
class _Py2Pickler(pickle._Pickler):
    """Writes bytes as Python 2 ``str`` opcodes (what cPickle of a NumPy array emits)."""

    dispatch = pickle._Pickler.dispatch.copy()

    def _save_py2_str(self, obj):
        n = len(obj)
        if n < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([n]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", n) + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str


def _write(path, obj, how):
    if how == "py2":
        with open(path, "wb") as fh:
            _Py2Pickler(fh, protocol=2).dump(obj)
        raw = open(path, "rb").read()
        # NumPy 1.x module names, as Python 2 era pickles carry them
        raw = raw.replace(b"cnumpy._core.multiarray\n", b"cnumpy.core.multiarray\n")
        open(path, "wb").write(raw)
    else:
        _dump(path, obj, protocol=how)


@st.composite
def proposal_sets(draw):
    n = draw(st.integers(1, 8))
    ids = draw(st.lists(st.integers(1, 12), min_size=n, max_size=n, unique=True))
    dtype = draw(st.sampled_from(["<f4", "<f8", ">f4", "mixed"]))
    boxes, scores = [], []
    for i in range(n):
        p = draw(st.integers(0, 30))
        seed = draw(st.integers(0, 2**16))
        rng = np.random.default_rng(seed)
        b = rng.uniform(-10, 90, (p, 4))
        b[:, 2:] = b[:, :2] + rng.uniform(0, 40, (p, 2))
        if p:
            b = np.vstack([b, b[:1]])  # a duplicate
        dt = ("<f4", "<f8")[i % 2] if dtype == "mixed" else dtype
        b = b.astype(dt)
        if draw(st.booleans()):
            b = np.asfortranarray(b)
        if b.shape[0] == 0 and draw(st.booleans()):
            b = np.zeros(0, dt)  # a 1-D empty record, as some writers produce
        boxes.append(b)
        scores.append(np.sort(rng.random(len(b)))[::-1].astype(np.float32))
    id_form = draw(st.sampled_from(["list", "numpy_scalars", "array", "0d_arrays"]))
    ids_obj = {"list": ids, "numpy_scalars": [np.int64(i) for i in ids],
               "array": np.array(ids), "0d_arrays": [np.array(i) for i in ids]}[id_form]
    return {"boxes": boxes, "scores": scores, "ids": ids_obj, "cfg": "x"}


@SETTINGS
@given(obj=proposal_sets(), how=st.sampled_from(["py2", 2, 4, 5]),
       limit=st.sampled_from([-1, 5]), crowd=st.sampled_from([0.0, 0.7]))
def test_streaming_equals_pickle_load(tmp_path, obj, how, limit, crowd):
    """The streaming loader yields exactly the arrays ``pickle.load`` does, and the same
    proposal table as ``pickle.load`` + the in-memory path; the .npz too."""
    path = str(tmp_path / f"p{how}.pkl")
    _write(path, obj, how)
    with open(path, "rb") as fh:
        plain = pickle.load(fh, encoding="latin1")
    ref = source_from_object(path, plain)
    src = read_proposal_file(path, trust_pickle=True)
    np.testing.assert_array_equal(src.ids, ref.ids)
    np.testing.assert_array_equal(src.counts, ref.counts)
    for i in range(src.ids.size):
        a, b = src.boxes_of(i), ref.boxes_of(i)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(src.scores_of(i), ref.scores_of(i))
    npz = str(tmp_path / f"p{how}.npz")
    convert_proposals(path, npz, trust_pickle=True)
    srcz = read_proposal_file(npz)  # the .npz needs no trust
    # a gt table for the ids: image k has k % 3 gt boxes, one crowd
    ids = np.sort(src.ids)
    widths = np.full(ids.size, 80)
    heights = np.full(ids.size, 70)
    ng = np.arange(ids.size) % 3
    gt_off = np.zeros(ids.size + 1, np.int64)
    np.cumsum(ng, out=gt_off[1:])
    g = int(gt_off[-1])
    rng = np.random.default_rng(int(ids.sum()))
    gb = rng.uniform(0, 30, (g, 4)).astype(np.float32)
    gb[:, 2:] += rng.uniform(5, 40, (g, 2)).astype(np.float32)
    kw = dict(image_ids=ids, widths=widths, heights=heights, gt_off=gt_off, gt_boxes=gb,
              gt_classes=(np.arange(g) % 4 + 1).astype(np.int32),
              gt_is_crowd=np.arange(g) % 4 == 3, proposal_limit=limit,
              crowd_filter_thresh=crowd)
    tables = [build_proposal_table(s, **kw) for s in (ref, src, srcz)]
    mixed = len({np.asarray(b).dtype for b in obj["boxes"] if np.size(b)}) > 1
    for t in tables[1:] if not mixed else tables[1:2]:  # .npz promotes mixed dtypes
        for k in ("off", "boxes", "max_overlaps", "max_classes", "gt_map"):
            np.testing.assert_array_equal(getattr(t, k), getattr(tables[0], k), err_msg=k)
        assert t.counts == tables[0].counts


def test_streaming_keeps_no_arrays_in_memory(tmp_path):
    """Arrays go to the scratch file as they are unpickled: the source holds only their
    places, and contiguous records are read as one flat range."""
    d = _good(make_coco(1, n_images=5), n_per=1000)
    src = read_proposal_file(_dump(tmp_path / "p.pkl", d), trust_pickle=True)
    assert src.flat is not None and src.scores_flat is not None
    assert not any(isinstance(x, np.ndarray) for x in src.keep_alive[1])
    np.testing.assert_array_equal(src.flat[0:2000], np.concatenate(d["boxes"][:2]))
    np.testing.assert_array_equal(src.flat[1000:3000], np.concatenate(d["boxes"][1:3]))


def test_pickle_read_in_one_place():
    """The trust policy has one home: every unpickler is built by ``_unpickler``."""
    import inspect

    from lit_roidata.roidb import proposal_files

    src = inspect.getsource(proposal_files)
    assert src.count("pickle.Unpickler)") == 1 and src.count("_ProposalUnpickler(fh") == 1
    assert src.count("_unpickler(fh, sink, trust_pickle=trust_pickle)") == 1  # _load_pickle
    assert src.count("raise untrusted_proposal_pickle(") == 2  # _unpickler and _load_pickle
    assert "pickle.load(" not in src and "pickle.loads(" not in src
    assert os.path.basename(proposal_files.__file__) == "proposal_files.py"


# ------------------------------------------------------------------------ trust policy
class _Boom:
    """Unpickling this calls ``os.system``-like code: here it only writes a marker."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_needs_trust_and_names_both_fixes(tmp_path, caplog):
    """Without trust_pickle a pickle is refused before anything is unpickled (no code
    runs), the error names the file, convert-proposals and trust_pickle; the .npz and
    the trusted pickle build the same roidb, the trusted one with a one-line warning."""
    from lit_roidata._pickle_trust import UntrustedPickleError

    data = make_coco(4)
    marker = tmp_path / "code_ran"
    d = dict(_good(data), cfg=_Boom(str(marker)))
    p = _dump(tmp_path / "p.pkl", d)
    fixes = (r"p\.pkl: the proposal file is a pickle.*lit-roidata convert-proposals "
             r".*p\.pkl p\.npz.*trust_pickle=True.*--data\.sources\.trust_pickle true")
    with pytest.raises(UntrustedPickleError, match=fixes):
        read_proposal_file(p)
    with pytest.raises(UntrustedPickleError, match=fixes):
        convert_proposals(p, str(tmp_path / "x.npz"))
    with pytest.raises(UntrustedPickleError, match=fixes):
        _build(tmp_path / "a", data, [p], trust=False)
    assert not marker.exists()
    with caplog.at_level("WARNING", logger="lit_roidata"):
        trusted = _build(tmp_path / "a", data, [p], trust=True)
    assert marker.exists()  # trusting means the file's code ran, as documented
    lines = [r.getMessage() for r in caplog.records if "trust_pickle=True" in r.getMessage()]
    assert len(lines) == 1 and "p.pkl" in lines[0] and "\n" not in lines[0]
    # Refused even though a roidb built from it is now cached (same answer every time).
    with pytest.raises(UntrustedPickleError):
        _build(tmp_path / "a", data, [p], trust=False)
    npz = str(tmp_path / "p.npz")
    assert cli_main(["convert-proposals", p, npz]) == 0  # the user named it: allowed
    converted = _build(tmp_path / "b", data, [npz], trust=False)
    np.testing.assert_array_equal(trusted._a["prop_boxes"], converted._a["prop_boxes"])


def test_datamodule_trust_pickle_reaches_the_build(tmp_path):
    """``RoIDataModule(sources={"trust_pickle": ...})`` (``--data.sources.trust_pickle``)
    decides."""
    from lit_roidata import RoIDataModule
    from lit_roidata._pickle_trust import UntrustedPickleError

    data = make_coco(5)
    cat_file = tmp_path / "catalog.yaml"
    write_dataset(str(tmp_path), "d", data)
    p = make_proposals(1, data, str(tmp_path / "p.pkl"))
    cat_file.write_text(f"datasets:\n  d:\n    image_dir: {tmp_path / 'd' / 'images'}\n"
                        f"    annotation_file: {tmp_path / 'd' / 'ann.json'}\n")
    kw = dict(datasets={"train": ["d"], "train_proposal_files": [p]},
              model_type="fast_rcnn", loader={"num_workers": 0})
    src = {"dataset_catalog": str(cat_file), "cache_dir": str(tmp_path / "c")}
    with pytest.raises(UntrustedPickleError, match="convert-proposals"):
        RoIDataModule(**kw, sources=src).prepare_data()
    dm = RoIDataModule(**kw, sources=dict(src, trust_pickle=True))
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_roidb) > 0


def test_cli_flag_data_trust_pickle(capsys):
    """``--data.sources.trust_pickle true`` falls out of the data module's signature."""
    import yaml

    config = os.path.join(os.path.dirname(__file__), "..", "configs", "demo.yaml")
    for argv, want in ((["--data.sources.trust_pickle", "true"], True), ([], False)):
        with pytest.raises(SystemExit) as exc:
            cli_main(["fit", "--config", config, *argv, "--print_config"])
        assert exc.value.code in (0, None)
        printed = yaml.safe_load(capsys.readouterr().out)
        assert printed["data"]["init_args"]["sources"]["trust_pickle"] is want
