"""Test-suite layout: a module named ``test_*`` holds tests; helpers are named otherwise
(pytest would collect a ``test_*`` helper as an empty test module, and importing it by
that name from other tests invites double imports)."""

import ast
import pathlib

TESTS = pathlib.Path(__file__).resolve().parent


def _has_tests(path: pathlib.Path) -> bool:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            return True
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            return True
    return False


def test_every_test_module_holds_tests():
    empty = [p.name for p in sorted(TESTS.glob("test_*.py")) if not _has_tests(p)]
    assert not empty, f"helper modules named test_*: {empty}; rename them (e.g. *_support.py)"


def test_the_check_sees_a_helper(tmp_path):
    helper = tmp_path / "test_helper.py"
    helper.write_text("def make():\n    return 1\n")
    assert not _has_tests(helper)
    helper.write_text("def test_x():\n    assert True\n")
    assert _has_tests(helper)
