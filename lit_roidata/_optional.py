"""Optional dependencies: import them where a feature needs them, with a clear error."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingOptionalDependency", "require"]


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
        top = module.split(".")[0]
        raise MissingOptionalDependency(
            f"{feature} needs the optional package {top!r}, which is not installed; "
            f'install it with: pip install "lit_roidata[{extra}]"') from exc
