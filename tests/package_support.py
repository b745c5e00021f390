"""The classes the package defines, for tests that check an index of them is complete."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Callable

import lit_roidata


def package_classes(keep: Callable[[type], bool]) -> dict[str, str]:
    """Name -> defining module of every class of ``lit_roidata`` (outside
    ``lit_roidata.lightning``, the bindings) for which ``keep`` is true; modules whose
    optional dependency is not installed are passed over."""
    found = {}
    for info in pkgutil.walk_packages(lit_roidata.__path__, "lit_roidata."):
        if info.name.endswith("__main__") or info.name.startswith("lit_roidata.lightning"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency (its extra is not installed)
            continue
        for obj in vars(module).values():
            if isinstance(obj, type) and obj.__module__ == info.name and keep(obj):
                found[obj.__name__] = info.name
    return found
