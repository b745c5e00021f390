"""docs/architecture.md's package tree names every module of the package (and no stale one)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tree() -> str:
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    start = text.index("```\nlit_roidata/")
    return text[start:text.index("```", start + 4)]


def _named(tree: str) -> set[str]:
    """Paths named by the tree: indentation gives the package, ``a.py, b.py`` lists several."""
    names: set[str] = set()
    stack: list[tuple[int, str]] = []
    for line in tree.splitlines()[2:]:  # after the fence and the "lit_roidata/" root
        m = re.match(r"^( *)([^\s,]+(?:, [^\s,]+)*)", line)
        if not m or not line.strip() or line.startswith(" " * 10):
            continue  # continuation lines of a description
        indent, entry = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        prefix = "".join(p for _, p in stack)
        for part in entry.split(", "):
            names.add(prefix + part)
        if entry.endswith("/"):
            stack.append((indent, entry))
    return names


def test_tree_names_every_module_and_nothing_else() -> None:
    named = _named(_tree())
    pkg = REPO / "lit_roidata"
    modules = {str(p.relative_to(pkg)) for p in pkg.rglob("*.py")}
    packages = {str(p.parent.relative_to(pkg)) + "/" for p in pkg.rglob("__init__.py")
                if p.parent != pkg}
    # a package line stands for its __init__.py and for modules it summarises in one line
    covered = {m for m in modules if m in named or (m.endswith("__init__.py") and
               (m[:-len("__init__.py")] in named or m == "__init__.py"))}
    summarised = {m for m in modules - covered
                  if m.rsplit("/", 1)[0] + "/" in named and
                  not any(n.startswith(m.rsplit("/", 1)[0] + "/") and n != m.rsplit("/", 1)[0] + "/"
                          and n.endswith(".py") for n in named)}
    missing = sorted(modules - covered - summarised)
    assert not missing, f"docs/architecture.md's tree does not name: {missing}"
    stale = sorted(n for n in named if n.endswith(".py") and n not in modules)
    stale += sorted(n for n in named if n.endswith("/") and n not in packages)
    assert not stale, f"docs/architecture.md's tree names what does not exist: {stale}"
