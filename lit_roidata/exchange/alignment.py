"""Alignment checks: is the peer's message about the same minibatch as mine?

Exchanged RPN maps only mean something when both processes are at the same step, on the
same images, flips and scales: each message carries that metadata and the consumer
compares it with its own, naming the first field that differs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from lit_roidata.exchange.errors import AlignmentError

__all__ = ["check_alignment", "to_plain"]


def to_plain(value: Any) -> Any:
    """NumPy/torch values, tuples and mappings → plain JSON-like Python values."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    return [to_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _first_difference(got: Any, exp: Any, path: str, rel_tol: float) -> str | None:
    if isinstance(exp, dict) and isinstance(got, dict):
        diffs = (f"{path}.{k}" if k not in got else
                 _first_difference(got[k], exp[k], f"{path}.{k}", rel_tol) for k in exp)
        return next(filter(None, diffs), None)
    if isinstance(exp, list) and isinstance(got, list):
        if len(got) != len(exp):
            return path
        diffs = (_first_difference(g, e, f"{path}[{i}]", rel_tol)
                 for i, (g, e) in enumerate(zip(got, exp)))
        return next(filter(None, diffs), None)
    if isinstance(exp, bool) or isinstance(got, bool):
        return None if got is exp else path
    if isinstance(exp, float) or isinstance(got, float):
        close = isinstance(got, (int, float)) and isinstance(exp, (int, float)) and \
            math.isclose(got, exp, rel_tol=rel_tol, abs_tol=0.0)
        return None if close else path
    return None if got == exp else path


def check_alignment(meta: Mapping[str, Any], expected: Mapping[str, Any], *,
                    where: str = "", rel_tol: float = 1e-6,
                    tensors: Mapping[str, Any] | None = None) -> None:
    """Check that every field of ``expected`` (this process's own values) matches
    ``meta`` (the message's); raise AlignmentError naming the first miss.

    Sequences compare element-wise, floats within ``rel_tol``, bools and ints exactly; the
    key ``"shapes"`` (name → shape) is compared with the shapes of ``tensors``.
    """
    got_all = to_plain(dict(meta))
    if "shapes" in expected and tensors is not None and "shapes" not in got_all:
        got_all["shapes"] = {k: list(np.shape(v)) for k, v in tensors.items()}
    prefix = f"{where}: " if where else ""
    for key, exp_raw in expected.items():
        exp = to_plain(exp_raw)
        if key not in got_all:
            raise AlignmentError(
                f"{prefix}the message has no alignment field {key!r} (it has "
                f"{sorted(got_all)}); the producer must put {key!r} in put(..., meta=...)")
        if (diff := _first_difference(got_all[key], exp, key, rel_tol)) is not None:
            raise AlignmentError(
                f"{prefix}misaligned stream: field {diff!r} differs: the message has "
                f"{key}={got_all[key]!r}, this process expects {key}={exp!r}. Both "
                "processes must use the same seed, sampler (identity or same permutation), "
                "scales and ordered delivery so that step k is the same images, flips and "
                "scales on both sides (docs/exchange.md)")
