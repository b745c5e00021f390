"""Pickles run code when loaded: they are read only after an explicit opt-in."""

from __future__ import annotations

import logging
import os

__all__ = ["UntrustedPickleError", "warn_trusted"]

log = logging.getLogger("lit_roidata")


class UntrustedPickleError(ValueError):
    """A pickle was given without ``trust_pickle=True``; the message names the fixes."""

    def __init__(self, path: str | os.PathLike, what: str, fixes: str) -> None:
        super().__init__(f"{os.fspath(path)}: the {what} is a pickle, and unpickling runs any "
                         f"code the file names, so it is not read by default. {fixes}")


def warn_trusted(path: str | os.PathLike, what: str) -> None:
    """The one-line warning logged when a pickle is read because the user trusted it."""
    log.warning("unpickling the %s %s (trust_pickle=True): this runs any code it names; "
                "use only files you trust", what, os.fspath(path))
