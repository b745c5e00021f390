"""Optional dependencies: import them where a feature needs them, with a clear error; and
the lazily imported names of a module (:func:`lazy_getattr`)."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable, Mapping

__all__ = ["MissingOptionalDependency", "lazy_getattr", "require"]


class MissingOptionalDependency(ImportError):
    """An optional feature was used without the extra that installs its library."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``; if it is missing, name the extra to install.

    Args:
        module: the module to import (e.g. ``"albumentations"``).
        extra: the ``lit_roidata`` extra that installs it (e.g. ``"augment"``).
        feature: what the user was doing, for the message (e.g. ``"augmentation"``).

    Raises:
        MissingOptionalDependency: (an ``ImportError``) the module cannot be imported.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingOptionalDependency(
            f"{feature} needs the optional package {module.split('.')[0]!r}, which is not "
            f'installed; install it with: pip install "lit_roidata[{extra}]"') from exc


def lazy_getattr(module: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports each of ``names`` (name -> defining module)
    on first use, so importing ``module`` stays cheap."""

    def __getattr__(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
