"""Weights files: read a Detectron ``.pkl``, a Lightning checkpoint or a PyTorch state
dict, and copy its named tensors into a module (used by
:class:`~lit_roidata.broadcast.BroadcastParameters` on rank 0).
"""

from __future__ import annotations

import logging
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np
import torch
from torch import nn

from lit_roidata._pickle_trust import UntrustedPickleError, warn_trusted

__all__ = ["LoadReport", "NameMap", "WeightsShapeError", "load_weights_file", "load_weights_into"]

log = logging.getLogger(__name__)

#: Maps a model tensor name (``state_dict`` key) to the name in the weights file, or
#: ``None`` to leave that tensor alone. A mapping ``{model name: file name}`` works too.
NameMap = Union[Callable[[str], Optional[str]], Mapping[str, str]]


class WeightsShapeError(ValueError):
    """A tensor in the weights file has a different shape from the model's tensor."""


@dataclass
class LoadReport:
    """What :func:`load_weights_into` did: loaded ``{model name: file name}``, model
    tensors with no blob in the file (kept at their init) and file blobs nobody used."""

    loaded: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)


_TRUST_FIX = ("If you trust the file, pass trust_pickle=True to BroadcastParameters (in a "
              "config: init_args: {trust_pickle: true}); or, once, load it in a trusted "
              "session and save its tensors with torch.save(state_dict, 'weights.pth').")


def load_weights_file(path: str | os.PathLike, *, trust_pickle: bool = False) -> dict[str, Any]:
    """Read a weights file into ``{name: array or tensor}``.

    Accepts a Detectron pickle (``{'blobs': {...}, 'cfg': ...}`` or a legacy bare dict
    of arrays, read with ``encoding='latin1'`` as Detectron does on Python 3), a
    Lightning checkpoint (its ``state_dict``) or a plain PyTorch state dict.
    ``.pth``/``.ckpt`` files are read with ``torch.load(weights_only=True)``. A pickle
    (``.pkl``, or a checkpoint that ``weights_only`` refuses) runs code when loaded,
    so it is read only with ``trust_pickle=True`` (with a one-line warning).

    Raises:
        FileNotFoundError: no such file.
        UntrustedPickleError: a pickle without ``trust_pickle=True``.
        ValueError: the file holds no name → tensor mapping.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file {path} does not exist (BroadcastParameters "
                                f"weights=...); give a .pkl, .ckpt or .pth path")

    def trusted(refusal: str = "") -> None:
        if not trust_pickle:
            raise UntrustedPickleError(path, "weights file", refusal + _TRUST_FIX) from None
        warn_trusted(path, "weights file")

    if path.endswith((".pkl", ".pickle")):
        trusted()
        with open(path, "rb") as f:
            obj = pickle.load(f, encoding="latin1")
        blobs = obj.get("blobs", obj) if isinstance(obj, dict) else None
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:  # e.g. a checkpoint with arbitrary hparams
            trusted(f"torch.load(weights_only=True) refused it ({str(exc).splitlines()[0]}). ")
            obj = torch.load(path, map_location="cpu", weights_only=False)
        blobs = obj.get("state_dict", obj) if isinstance(obj, dict) else None
    if not isinstance(blobs, dict):
        raise ValueError(f"weights file {path} holds a {type(obj).__name__}, not a dict of "
                         f"named tensors (expected Detectron's {{'blobs': ...}}, a Lightning "
                         f"checkpoint or a state_dict)")
    return {str(k): v for k, v in blobs.items()
            if isinstance(v, (np.ndarray, torch.Tensor, np.generic))}


def load_weights_into(module: nn.Module, blobs: Mapping[str, Any], *,
                      name_map: Optional[NameMap] = None, strict: bool = False,
                      source: str = "<weights>") -> LoadReport:
    """Copy named blobs into ``module``'s parameters and buffers (Detectron semantics: multi-gpu and
    weights).

    For each tensor of ``module.state_dict()`` in model order: its file name is
    ``name_map(name)`` (identity by default; ``None`` skips it); Detectron's special case
    applies: a name ``_[xyz]_foo`` absent from the file is loaded from ``foo``. Tensors
    without a blob keep their initialisation and are logged.

    Args:
        module: the model to fill in place.
        blobs: ``{name: array or tensor}``, e.g. from :func:`load_weights_file`.
        name_map: model name → file name (callable or mapping).
        strict: raise if any model tensor has no blob.
        source: file name for messages.

    Raises:
        WeightsShapeError: a blob's shape differs from the model tensor's (names both).
        KeyError: ``strict`` and some tensors are missing.
    """
    report = LoadReport()
    with torch.no_grad():
        for name, dst in module.state_dict(keep_vars=True).items():
            src_name = (name if name_map is None else name_map.get(name, name)
                        if isinstance(name_map, Mapping) else name_map(name))
            if src_name is None:
                continue
            if src_name not in blobs and "]_" in src_name:
                src_name = src_name[src_name.find("]_") + 2:]
            if src_name not in blobs:
                report.missing.append(name)
                continue
            value = torch.as_tensor(np.asarray(blobs[src_name]) if not torch.is_tensor(
                blobs[src_name]) else blobs[src_name])
            if tuple(value.shape) != tuple(dst.shape):
                raise WeightsShapeError(
                    f"{source}: blob {src_name!r} has shape {tuple(value.shape)} but model "
                    f"tensor {name!r} has shape {tuple(dst.shape)}; fix the name mapping or "
                    f"the model configuration (e.g. num_classes)")
            dst.copy_(value.to(dtype=dst.dtype))
            report.loaded[name] = src_name
    used = set(report.loaded.values())
    report.unused = [k for k in blobs if k not in used]
    if report.missing:
        msg = (f"{source}: {len(report.missing)} model tensor(s) not found, kept at their "
               f"initialisation: {report.missing[:10]}{' ...' if len(report.missing) > 10 else ''}")
        if strict:
            raise KeyError(msg)
        log.warning(msg)
    log.info("%s: loaded %d tensor(s); %d file blob(s) unused", source, len(report.loaded),
             len(report.unused))
    return report
