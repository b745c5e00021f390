"""Import single modules of a Detectron2 *source checkout* for equivalence tests.

Detectron2 is not installed and never copied into the project. Its package
``__init__`` files pull in fvcore, iopath, pycocotools and the config system; the
modules the tests compare against (e.g. ``detectron2/data/samplers/distributed_sampler.py``)
need only torch. :func:`import_d2_module` imports one such module with empty stand-ins
for the parent packages, then removes every ``detectron2`` entry it added to
``sys.modules`` again, so a full import elsewhere is not affected.

The checkout is ``$DETECTRON2_SRC`` (or ``$LIT_ROIDATA_D2_SRC``), else a ``d2src`` folder
beside the repository or beside its parent (what tests/test_lvis_roidb.py also looks for);
tests skip without it.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from typing import Any, Optional

import pytest


def d2_src() -> Optional[str]:
    """The Detectron2 checkout, or None when there is none."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for cand in (os.environ.get("DETECTRON2_SRC"), os.environ.get("LIT_ROIDATA_D2_SRC"),
                 os.path.join(os.path.dirname(repo), "d2src"),
                 os.path.join(os.path.dirname(os.path.dirname(repo)), "d2src")):
        if cand and os.path.isfile(os.path.join(cand, "detectron2", "__init__.py")):
            return cand
    return None


def import_d2_module(name: str) -> Any:
    """``detectron2.<name>`` from the checkout (``pytest.skip`` without one)."""
    src = d2_src()
    if src is None:
        pytest.skip("no Detectron2 source checkout (set DETECTRON2_SRC)")
    before = {k: v for k, v in sys.modules.items() if k == "detectron2" or k.startswith("detectron2.")}
    parts = ["detectron2", *name.split(".")[:-1]]
    try:
        for i in range(len(parts)):
            pkg = ".".join(parts[: i + 1])
            if pkg not in sys.modules:
                stub = types.ModuleType(pkg)
                stub.__path__ = [os.path.join(src, *parts[: i + 1])]
                sys.modules[pkg] = stub
        return importlib.import_module("detectron2." + name)
    finally:
        for k in [k for k in sys.modules if k == "detectron2" or k.startswith("detectron2.")]:
            if k not in before:
                del sys.modules[k]
        sys.modules.update(before)
