"""The package's structure, read with ``ast`` (nothing is imported but torch classes that
``lit_roidata`` subclasses):

(a) no module reads or sets another ``lit_roidata`` module's underscored names;
(b) no import circle among ``lit_roidata`` modules;
(c) layers: the roidb builds on nothing above it, the minibatch builders not on the
    stream, and only the command line imports ``trainer_cli``;
(d) at most one private torch / NumPy API in the whole package (the guarded
    ``UntypedStorage._new_shared`` of ``minibatch.shm_pool.new_shared_storage``).

How (a) decides. A module may use every underscored name it defines itself (functions,
classes, assignments, class attributes, ``self._x = ...``, imports ``as _x``), on any
object. It may not use: ``from lit_roidata.x import _name``; ``m._name`` where ``m`` is
a ``lit_roidata`` module; ``obj._name`` (load, store or delete) or ``getattr(obj,
"_name")`` / ``setattr`` / ``hasattr`` / ``delattr`` with a literal name, where ``obj``
is not ``self`` / ``cls`` and the module does not define ``_name``. Not counted: dunders;
private *modules* of the package (``lit_roidata._optional``: package-internal by design,
their public names are the interface); torch / NumPy objects reached from their imports
(that is (d)); and the third-party members of ``THIRD_PARTY`` below, each with its reason.
A module that defines ``_x`` itself and also reads another object's ``_x`` is not caught
(the rule is per name, statically). Setting ``obj._x`` on an object of another module or
library counts as a use, not a definition. A private torch member reached through an
object of unknown type (``loader._iterator``) is reported by (a), not (d).

(b) and (c) use every import, module level and inside functions, except those under
``if TYPE_CHECKING:`` (they never run). Importing ``a.b.c`` is an edge to ``a.b.c``
only, not to the packages ``a`` and ``a.b`` that Python also initialises.

Each check is also run on synthetic sources, so that it is known to fail on a
violation.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = "lit_roidata"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

#: Third-party private members the package may use, with the reason for each.
THIRD_PARTY = {
    "_exit": "os._exit: public, documented API despite the underscore",
    "_getframe": "sys._getframe: documented CPython API",
    "_replace": "namedtuple._replace: public namedtuple API",
    "_asdict": "namedtuple._asdict: public namedtuple API",
    "_fields": "namedtuple._fields: public namedtuple API",
    "_make": "namedtuple._make: public namedtuple API",
    "_decode_cfg_value": "yacs: parses a YAML value exactly as CfgNode.merge_from_file",
    "_immutable": "yacs: CfgNode's freeze flag, which it has no public reader for",
    "_misc_cmd": "pymemcache: sends a raw command (no public call for it)",
    "_result_dicts": "faster-coco-eval: the per-image results (no public accessor)",
}

#: Torch and NumPy top-level packages for (d).
FRAMEWORKS = ("torch", "numpy")

#: Layers (c): modules under the key import nothing under any of the values.
LAYERS = {
    "lit_roidata.roidb": ("lit_roidata.minibatch", "lit_roidata.sampler",
                          "lit_roidata.dataset", "lit_roidata.loader", "lit_roidata.skip",
                          "lit_roidata.datamodule", "lit_roidata.cli",
                          "lit_roidata.trainer_cli"),
    "lit_roidata.minibatch": ("lit_roidata.sampler", "lit_roidata.dataset",
                              "lit_roidata.loader", "lit_roidata.skip",
                              "lit_roidata.datamodule"),
    # The training stream runs one way: plan -> dataset (builds) -> loader (owns the
    # position); nothing downstream is imported upstream.
    "lit_roidata.plan": ("lit_roidata.sampler", "lit_roidata.dataset", "lit_roidata.loader",
                         "lit_roidata.skip", "lit_roidata.datamodule", "lit_roidata.minibatch",
                         "lit_roidata.roidb"),
    "lit_roidata.dataset": ("lit_roidata.sampler", "lit_roidata.loader", "lit_roidata.skip",
                            "lit_roidata.datamodule"),
    "lit_roidata.skip": ("lit_roidata.dataset", "lit_roidata.loader", "lit_roidata.datamodule"),
    "lit_roidata.sampler": ("lit_roidata.dataset", "lit_roidata.loader", "lit_roidata.skip",
                            "lit_roidata.datamodule"),
    "lit_roidata.loader": ("lit_roidata.datamodule",),
}
#: Only these may import ``lit_roidata.trainer_cli``.
TRAINER_CLI_IMPORTERS = ("lit_roidata", "lit_roidata.cli", "lit_roidata.trainer_cli",
                         "lit_roidata.lightning")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# ---------------------------------------------------------------------- reading modules
@dataclass
class Module:
    name: str
    tree: ast.Module
    is_package: bool = False
    # local name -> dotted module/object it is bound to by an import (for (a) and (d))
    imports: dict[str, str] = field(default_factory=dict)


def load(sources: dict[str, str], packages: set[str] | None = None) -> dict[str, Module]:
    """Parse ``{dotted module name: source}``; ``packages`` names the ``__init__``s."""
    packages = packages or set()
    return {n: _bind(Module(n, ast.parse(s), n in packages)) for n, s in sources.items()}


def package_modules() -> dict[str, Module]:
    sources, packages = {}, set()
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
            packages.add(".".join(parts))
        sources[".".join(parts)] = path.read_text()
    return load(sources, packages)


def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = mod.name.split(".")
    base = base[:len(base) - node.level + (1 if mod.is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    return skip


def _imports(mod: Module) -> list[tuple[ast.AST, str, str | None, str | None]]:
    """``(node, module, imported name or None, local name)`` of each running import."""
    skip = _type_checking_nodes(mod.tree)
    out = []
    for node in ast.walk(mod.tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append((node, a.name, None, a.asname or a.name.split(".")[0]))
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(mod, node)
            for a in node.names:
                out.append((node, src, a.name, None if a.name == "*" else a.asname or a.name))
    return out


def _bind(mod: Module) -> Module:
    for _, src, name, local in _imports(mod):
        if local is None:
            continue
        top = src.split(".")[0]
        # ``import a.b`` binds ``a``; ``import a.b as x`` binds ``a.b``
        mod.imports[local] = (top if local == top else src) if name is None else f"{src}.{name}"
    return mod


def _dotted(mod: Module, node: ast.AST) -> str | None:
    """``torch.utils.data.DataLoader`` for ``DataLoader`` imported from there, etc."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in mod.imports:
        return None
    return ".".join([mod.imports[node.id]] + parts[::-1])


def _defined(mod: Module) -> set[str]:
    """Underscored names the module defines itself."""
    names: set[str] = set()
    for node in ast.walk(mod.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
        elif isinstance(node, ast.alias) and node.asname:
            names.add(node.asname)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if _private(n)}


def _is_framework(dotted: str | None) -> bool:
    return dotted is not None and dotted.split(".")[0] in FRAMEWORKS


_ATTR_CALLS = ("getattr", "setattr", "hasattr", "delattr")


def _member_uses(mod: Module):
    """``(node, object expression, private member)`` of every ``obj._x`` and literal
    ``getattr(obj, "_x")`` (and set/has/delattr) of the module, ``obj`` not self/cls."""
    for node in ast.walk(mod.tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            obj, attr = node.value, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in _ATTR_CALLS and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
            obj, attr = node.args[0], node.args[1].value
        else:
            continue
        if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
            continue
        yield node, obj, attr


# ---------------------------------------------------------------------- (a)
def cross_module_private(modules: dict[str, Module]) -> list[str]:
    """Every use of another ``lit_roidata`` module's underscored name (see module doc)."""
    found = []
    known = set(modules)
    for name, mod in sorted(modules.items()):
        for node, src, imported, _ in _imports(mod):
            if (imported and _private(imported) and src.split(".")[0] == PACKAGE
                    and f"{src}.{imported}" not in known):
                found.append(f"{name}:{node.lineno}: from {src} import {imported}")
        own = _defined(mod)
        for node, obj, attr in _member_uses(mod):
            target = _dotted(mod, obj)
            if target in known:  # a lit_roidata module: never its private names
                found.append(f"{name}:{node.lineno}: {ast.unparse(obj)}.{attr}")
            elif attr in own or attr in THIRD_PARTY or _is_framework(target):
                continue
            elif target is not None and target.split(".")[0] != PACKAGE:
                found.append(f"{name}:{node.lineno}: {ast.unparse(obj)}.{attr} "
                             "(third party: add it to THIRD_PARTY with a reason, or avoid it)")
            else:
                found.append(f"{name}:{node.lineno}: {ast.unparse(obj)[:50]}.{attr}")
    return found


# ---------------------------------------------------------------------- (b), (c)
def import_graph(modules: dict[str, Module]) -> dict[str, set[str]]:
    """``module -> lit_roidata modules it imports`` (module level and in functions)."""
    graph: dict[str, set[str]] = {n: set() for n in modules}
    for name, mod in modules.items():
        for _, src, imported, _ in _imports(mod):
            if src.split(".")[0] != PACKAGE:
                continue
            target = f"{src}.{imported}" if imported and f"{src}.{imported}" in modules else src
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_violations(graph: dict[str, set[str]], layers: dict[str, tuple[str, ...]]
                     ) -> list[str]:
    return sorted(f"{m} imports {t}" for layer, banned in layers.items()
                  for m in graph if _under(m, layer)
                  for t in graph[m] if any(_under(t, b) for b in banned))


def trainer_cli_importers(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} imports lit_roidata.trainer_cli" for m in sorted(graph)
            if "lit_roidata.trainer_cli" in graph[m]
            and not (m in TRAINER_CLI_IMPORTERS or _under(m, "lit_roidata.lightning"))]


# ---------------------------------------------------------------------- (d)
def _base_sources(mod: Module, cls: ast.ClassDef) -> str:
    """The source of the torch / NumPy classes ``cls`` derives from (their MROs)."""
    text = []
    for base in cls.bases:
        dotted = _dotted(mod, base)
        if not _is_framework(dotted):
            continue
        modname, _, attr = dotted.rpartition(".")
        try:
            obj = getattr(importlib.import_module(modname), attr)
            text += [inspect.getsource(k) for k in obj.__mro__
                     if k.__module__.split(".")[0] in FRAMEWORKS]
        except (ImportError, AttributeError, TypeError, OSError):
            text.append(f"<{dotted}: source not found>")
    return "\n".join(text)


def framework_private_uses(modules: dict[str, Module]) -> list[str]:
    """Every use of a private torch / NumPy module or member: imports of private names
    or modules, ``torch.x._y`` / ``np.x._y`` chains and literal ``getattr``s on them, and
    ``self._x`` in a subclass of a torch / NumPy class whose source uses ``_x``."""
    found = []
    for name, mod in sorted(modules.items()):
        for node, src, imported, _ in _imports(mod):
            full = f"{src}.{imported}" if imported else src
            if _is_framework(full) and any(_private(p) for p in full.split(".")):
                found.append(f"{name}:{node.lineno}: import {full}")
        for node, obj, attr in _member_uses(mod):
            target = _dotted(mod, obj)
            if _is_framework(target) and not any(_private(p) for p in target.split(".")):
                found.append(f"{name}:{node.lineno}: {target}.{attr}")
        own = {n.name for c in ast.walk(mod.tree) if isinstance(c, ast.ClassDef)
               for n in c.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for cls in (c for c in ast.walk(mod.tree) if isinstance(c, ast.ClassDef)):
            source = _base_sources(mod, cls)
            if not source:
                continue
            seen = set()
            for node in ast.walk(cls):
                if (isinstance(node, ast.Attribute) and _private(node.attr)
                        and isinstance(node.value, ast.Name) and node.value.id == "self"
                        and node.attr not in own and node.attr not in seen
                        and re.search(rf"\b{re.escape(node.attr)}\b", source)):
                    seen.add(node.attr)
                    found.append(f"{name}:{node.lineno}: self.{node.attr} "
                                 f"(private member of a base of {cls.name})")
    return found


# ---------------------------------------------------------------------- the package
def _report(what: str, found: list) -> str:
    text = f"{what}: {len(found)}\n" + "\n".join(f"  {f}" for f in found)
    print(text)
    return text


@pytest.fixture(scope="module")
def modules() -> dict[str, Module]:
    return package_modules()


@pytest.fixture(scope="module")
def graph(modules) -> dict[str, set[str]]:
    return import_graph(modules)


def _scope(found: list[str], prefix: str) -> tuple[list[str], list[str]]:
    mine = [f for f in found if f.startswith(prefix)]
    return mine, [f for f in found if not f.startswith(prefix)]


def test_minibatch_reads_no_other_module_private_names(modules) -> None:
    found = cross_module_private(modules)
    mine = _scope(found, "lit_roidata.minibatch")[0] + _scope(found, "lit_roidata.rng:")[0]
    assert not mine, _report("cross-module private uses in minibatch", mine)


def test_no_module_reads_another_module_private_names(modules) -> None:
    found = cross_module_private(modules)
    assert not found, _report("cross-module private uses", found)


def test_no_import_circle(graph) -> None:
    cycles = import_cycles(graph)
    assert not cycles, _report("import circles", cycles)


def test_minibatch_is_in_no_import_circle(graph) -> None:
    cycles = [c for c in import_cycles(graph) if any(_under(m, "lit_roidata.minibatch")
                                                      for m in c)]
    assert not cycles, _report("import circles through minibatch", cycles)


def test_minibatch_layer(graph) -> None:
    found = layer_violations(graph, {"lit_roidata.minibatch": LAYERS["lit_roidata.minibatch"]})
    assert not found, _report("minibatch reaching up", found)


def test_layers(graph) -> None:
    found = layer_violations(graph, LAYERS) + trainer_cli_importers(graph)
    assert not found, _report("layer violations", found)


def test_at_most_one_private_torch_or_numpy_use(modules) -> None:
    found = framework_private_uses(modules)
    assert len(found) <= 1, _report("private torch/NumPy uses", found)


def test_the_one_private_torch_use_is_the_guarded_new_shared(modules) -> None:
    found = [f for f in framework_private_uses(modules) if "_new_shared" in f]
    assert len(found) == 1 and found[0].startswith("lit_roidata.minibatch.shm_pool:"), found
    mine, _ = _scope(framework_private_uses(modules), "lit_roidata.minibatch")
    assert mine == found, _report("private torch/NumPy uses in minibatch", mine)


# ---------------------------------------------------------------------- the checks fail
_SYNTHETIC = {
    "lit_roidata.a": (
        "import os\nimport torch\nimport numpy as np\n"
        "from torch.utils.data import DataLoader\n"
        "from lit_roidata.b import _helper\n"
        "from lit_roidata import b\n"
        "import lit_roidata.b as bee\n"
        "class Own:\n"
        "    _mine = 1\n"
        "    def f(self, other):\n"
        "        self._state = other._mine\n"          # own name: fine
        "        return other._theirs\n"               # (a)
        "def g(x):\n"
        "    os._exit(0)\n"                            # allow-listed
        "    getattr(x, '_hidden', None)\n"            # (a)
        "    x._set = 1\n"                             # (a), a store
        "    b._tab, bee._tab2\n"                      # (a) twice
        "    torch.UntypedStorage._new_shared(1)\n"    # (d)
        "    np.lib.format._read_array_header\n"       # (d)
        "    getattr(torch, '_C', None)\n"             # (d)
        "    from numpy._core import multiarray\n"     # (d)
        "    from lit_roidata.c import thing\n"        # circle a -> c -> a
        "class Loader(DataLoader):\n"
        "    def stop(self):\n"
        "        self._iterator = None\n"              # (d): DataLoader's own member
        "        self._mine_too = 1\n"
    ),
    "lit_roidata.b": "_helper = 1\n_tab = 2\n",
    "lit_roidata.c": "import lit_roidata.a\n",
    "lit_roidata.roidb.x": "from lit_roidata.minibatch import core\n",
    "lit_roidata.minibatch.core": "from lit_roidata.loader import y\n",
    "lit_roidata.loader": "from lit_roidata.trainer_cli import main\ny = 1\n",
    "lit_roidata.trainer_cli": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                               "    from lit_roidata.loader import y\n",
    "lit_roidata.sub": "from .b import _tab\nfrom . import b\nb._helper\n",
}


def test_the_checks_find_what_they_look_for() -> None:
    mods = load(_SYNTHETIC)
    found = cross_module_private(mods)
    text = "\n".join(found)
    for what in ("import _helper", "other._theirs", "x._hidden", "x._set", "b._tab",
                 "bee._tab2", "from lit_roidata.b import _tab", "sub:3: b._helper"):
        assert what in text, (what, found)
    assert "_mine" not in text and "_exit" not in text and "_state" not in text
    assert "_new_shared" not in text and "_iterator" not in text  # (d)'s business
    graph = import_graph(mods)
    assert import_cycles(graph) == [["lit_roidata.a", "lit_roidata.c"]]
    assert "lit_roidata.loader" not in graph["lit_roidata.trainer_cli"]  # TYPE_CHECKING
    assert layer_violations(graph, LAYERS) == [
        "lit_roidata.minibatch.core imports lit_roidata.loader",
        "lit_roidata.roidb.x imports lit_roidata.minibatch.core"]
    assert layer_violations(graph, {"lit_roidata.roidb": ("lit_roidata.minibatch",)}) == [
        "lit_roidata.roidb.x imports lit_roidata.minibatch.core"]
    assert trainer_cli_importers(graph) == [
        "lit_roidata.loader imports lit_roidata.trainer_cli"]
    private = "\n".join(framework_private_uses(mods))
    for what in ("torch.UntypedStorage._new_shared", "numpy.lib.format._read_array_header",
                 "torch._C", "import numpy._core", "self._iterator"):
        assert what in private, (what, private)
    assert "_mine_too" not in private and "os._exit" not in private
    assert len(framework_private_uses(mods)) == 5
