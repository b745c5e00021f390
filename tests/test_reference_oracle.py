"""The roidb oracle (``tests/oracles/reference.py``) does not reuse the functions it
checks: its IoU, regression targets, proposal reading and RLE flipping are its own."""

import ast
import pathlib

import numpy as np

from lit_roidata.boxes import bbox_overlaps, bbox_transform_targets
from lit_roidata.roidb.segms import flip_rle
from oracles import reference

SOURCE = pathlib.Path(reference.__file__)
#: the package modules the oracle may import: metadata only, no algorithms it checks
ALLOWED = {"lit_roidata.roidb.info"}
CHECKED = {"bbox_overlaps", "bbox_overlaps_pairs", "iou_kernel", "bbox_transform_targets",
           "compute_bbox_targets", "read_proposal_file", "flip_rle"}


def _imports(tree: ast.AST) -> list[tuple[str, str]]:
    out = []
    for node in ast.walk(tree):  # function-level imports included
        if isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out += [("." * node.level + (node.module or ""), a.name) for a in node.names]
    return out


def test_oracle_imports_none_of_the_checked_functions():
    tree = ast.parse(SOURCE.read_text())
    imports = _imports(tree)
    # the package's modules, and the other oracles (which import the package's functions)
    ours = [(m, n) for m, n in imports if m.startswith(("lit_roidata", ".", "oracles"))]
    assert {m for m, _ in ours} <= ALLOWED, ours
    assert not {n for _, n in imports} & CHECKED, imports
    dynamic = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call)
               and isinstance(n.func, ast.Name) and n.func.id in {"__import__", "import_module"}]
    assert not dynamic
    for name in ("bbox_overlaps", "bbox_transform_targets", "flip_rle"):
        assert getattr(reference, name).__module__ == reference.__name__  # defined there
    assert "lit_roidata" not in SOURCE.parts  # a test oracle, not shipped in the package


def test_the_import_check_sees_a_forbidden_import():
    bad = ast.parse("def f():\n    from lit_roidata.boxes import bbox_overlaps\n")
    assert ("lit_roidata.boxes", "bbox_overlaps") in _imports(bad)


def test_oracle_helpers_agree_with_the_package_by_hand():
    """Hand-checked cases on the oracle's own helpers (the equivalence tests cover the rest)."""
    a = np.float32([[0, 0, 9, 9]])
    b = np.float32([[5, 5, 14, 14], [10, 0, 19, 9], [0, 0, 9, 9]])
    np.testing.assert_array_equal(reference.bbox_overlaps(a, b), np.float32([[25 / 175, 0, 1]]))
    np.testing.assert_array_equal(reference.bbox_overlaps(a, b), bbox_overlaps(a, b))
    t = reference.bbox_transform_targets(a, np.float32([[1, 2, 10, 21]]), (10, 10, 5, 5))
    np.testing.assert_allclose(t, [[10 * 1 / 10, 10 * 7 / 10, 0, 5 * np.log(2)]], rtol=1e-6)
    np.testing.assert_array_equal(t, bbox_transform_targets(a, np.float32([[1, 2, 10, 21]]),
                                                            (10, 10, 5, 5)))
    # 2x3 mask, column-major pixels [1,0 | 1,1 | 0,0] -> mirrored [0,0 | 1,1 | 1,0]
    rle = {"size": [2, 3], "counts": [0, 1, 1, 2, 2]}
    assert reference.flip_rle(rle) == {"size": [2, 3], "counts": [2, 3, 1]}
    assert reference.flip_rle(rle) == flip_rle(rle)
