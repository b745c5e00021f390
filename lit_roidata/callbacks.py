"""Weights loading on rank 0, parameter broadcast, and a bit-exact replica check.

Detectron loads a weights file into GPU 0 only and then copies every parameter blob from
GPU 0 to the other GPUs (``broadcast_parameters``, Detectron semantics: multi-gpu and weights); that
copy also
equalises the independent random initialisations. :class:`BroadcastParameters` does
the same for a Lightning run: rank 0 loads the file (a Lightning/PyTorch checkpoint or
state dict, or a Detectron ``.pkl`` of named blobs), every parameter and buffer is
broadcast from rank 0, and then each rank's per-tensor checksums are gathered and
compared, so a replica that differs by a single bit fails the run with the tensor's
name. DDP broadcasts parameters when it wraps the module too (Detectron semantics: multi-gpu and
weights); the explicit
step makes the load rank-0-only, covers non-DDP strategies and checks the result.

Works with any ``torch.distributed`` backend: tensors are moved to the current CUDA
device for NCCL and communicated where they live otherwise (gloo).
"""

from __future__ import annotations

import logging
import os
import pickle
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Union

import numpy as np
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import nn

from lit_roidata._pickle_trust import UntrustedPickleError, warn_trusted

__all__ = [
    "BroadcastParameters",
    "LoadReport",
    "ReplicaMismatchError",
    "WeightsShapeError",
    "broadcast_module",
    "load_weights_file",
    "load_weights_into",
    "verify_replicas",
]

log = logging.getLogger(__name__)

#: Maps a model tensor name (``state_dict`` key) to the name in the weights file, or
#: ``None`` to leave that tensor alone. A mapping ``{model name: file name}`` works too.
NameMap = Union[Callable[[str], Optional[str]], Mapping[str, str]]

_BUCKET_BYTES = 32 << 20


class WeightsShapeError(ValueError):
    """A tensor in the weights file has a different shape from the model's tensor."""


class ReplicaMismatchError(RuntimeError):
    """Model replicas differ between ranks (after the broadcast, or in their structure)."""


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


def load_weights_file(path: str | os.PathLike, *, trust_pickle: bool = False
                      ) -> dict[str, Any]:
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
    if path.endswith((".pkl", ".pickle")):
        if not trust_pickle:
            raise UntrustedPickleError(path, "weights file", _TRUST_FIX)
        warn_trusted(path, "weights file")
        with open(path, "rb") as f:
            obj = pickle.load(f, encoding="latin1")
        blobs = obj.get("blobs", obj) if isinstance(obj, dict) else None
    else:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:  # e.g. a checkpoint with arbitrary hparams
            if not trust_pickle:
                raise UntrustedPickleError(
                    path, "weights file",
                    f"torch.load(weights_only=True) refused it ({str(exc).splitlines()[0]}). "
                    + _TRUST_FIX) from None
            warn_trusted(path, "weights file")
            obj = torch.load(path, map_location="cpu", weights_only=False)
        blobs = obj.get("state_dict", obj) if isinstance(obj, dict) else None
    if not isinstance(blobs, dict):
        raise ValueError(f"weights file {path} holds a {type(obj).__name__}, not a dict of "
                         f"named tensors (expected Detectron's {{'blobs': ...}}, a Lightning "
                         f"checkpoint or a state_dict)")
    return {str(k): v for k, v in blobs.items()
            if isinstance(v, (np.ndarray, torch.Tensor, np.generic))}


def _source_name(name: str, name_map: Optional[NameMap]) -> Optional[str]:
    if name_map is None:
        return name
    if isinstance(name_map, Mapping):
        return name_map.get(name, name)
    return name_map(name)


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
    state = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, dst in state.items():
            src_name = _source_name(name, name_map)
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


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (persistent or not) once, in model order."""
    seen: set[int] = set()
    out = []
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _comm_device(t: torch.Tensor) -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return t.device


def _check_structure(tensors: list[tuple[str, torch.Tensor]]) -> None:
    mine = [(n, tuple(t.shape), str(t.dtype)) for n, t in tensors]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs != everyone[0]:
            diff = next(((a, b) for a, b in zip(everyone[0], theirs) if a != b),
                        (f"{len(everyone[0])} tensors", f"{len(theirs)} tensors"))
            raise ReplicaMismatchError(
                f"model structure differs between rank 0 and rank {rank}: rank 0 has {diff[0]}, "
                f"rank {rank} has {diff[1]}; every rank must build the same model")


def broadcast_module(module: nn.Module, src: int = 0) -> int:
    """Broadcast every parameter and buffer of ``module`` from rank ``src`` in place.

    Tensors are packed into buckets of one dtype (up to 32 MiB) to keep the number of
    collectives small. A no-op without an initialised process group of size > 1.

    Returns:
        The number of tensors broadcast.

    Raises:
        ReplicaMismatchError: ranks hold differently shaped models (checked first, so a
            broken set-up fails with a message instead of hanging or corrupting memory).
    """
    if not _distributed():
        return 0
    tensors = _tensors(module)
    _check_structure(tensors)
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for _, t in tensors:
        if (not buckets or buckets[-1][0].dtype != t.dtype or buckets[-1][0].device != t.device
                or size + t.numel() * t.element_size() > _BUCKET_BYTES):
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += t.numel() * t.element_size()
    with torch.no_grad():
        for bucket in buckets:
            dev = _comm_device(bucket[0])
            flat = torch.cat([t.detach().reshape(-1).to(dev) for t in bucket])
            dist.broadcast(flat, src=src)
            offset = 0
            for t in bucket:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n
    return len(tensors)


def _checksum(t: torch.Tensor) -> int:
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(memoryview(data)) ^ (zlib.adler32(memoryview(data)) << 32)


def verify_replicas(module: nn.Module) -> int:
    """Check that every parameter and buffer is bit-identical on all ranks.

    Each rank computes a checksum (CRC-32 and Adler-32 of the raw bytes) per tensor;
    the lists are gathered on every rank and compared with rank 0's, so every rank
    raises the same error (no rank hangs waiting for the others).

    Returns:
        The number of tensors checked (0 when not distributed).

    Raises:
        ReplicaMismatchError: names the first differing tensor (model order) and the
            ranks that differ from rank 0.
    """
    if not _distributed():
        return 0
    tensors = _tensors(module)
    mine = [(n, _checksum(t)) for n, t in tensors]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    ref = everyone[0]
    for i, (name, value) in enumerate(ref):
        bad = [r for r, theirs in enumerate(everyone)
               if i >= len(theirs) or theirs[i] != (name, value)]
        if bad:
            theirs = [everyone[r][i][1] if i < len(everyone[r]) else None for r in bad]
            raise ReplicaMismatchError(
                f"replicas differ: tensor {name!r} on rank(s) {bad} is not bit-identical to "
                f"rank 0 (checksums {theirs} vs {value}); the parameter broadcast failed or a "
                f"rank changed its weights")
    if any(len(theirs) != len(ref) for theirs in everyone):
        raise ReplicaMismatchError("replicas differ in their number of tensors: "
                                   f"{[len(t) for t in everyone]}")
    return len(ref)


class BroadcastParameters(pl.Callback):
    """Load weights on rank 0, broadcast all parameters and buffers, verify the replicas.

    Runs in ``setup`` (before the strategy wraps the model and before the optimizer
    exists): rank 0 loads ``weights`` once (see :func:`load_weights_into`: name mapping,
    Detectron's ``_[xyz]_foo`` → ``foo`` fallback, missing tensors logged, shape
    mismatch fatal), then every rank receives rank 0's tensors and the checksums are
    compared. ``on_fit_start`` checks the replicas again once the model is on its device
    (and, when resuming, after the checkpoint was restored). A checkpoint restored by
    ``ckpt_path`` overrides the loaded weights, as resuming should.

    Args:
        weights: a Detectron ``.pkl``, a Lightning ``.ckpt`` or a PyTorch state dict
            (``TRAIN.WEIGHTS``); ``None`` only equalises the random initialisation.
        name_map: model tensor name → file blob name (callable or mapping; a callable
            may return ``None`` to skip a tensor).
        strict: fail if a model tensor has no blob in the file.
        verify: gather per-tensor checksums and fail on any difference.
        trust_pickle: read ``weights`` when it is a pickle (a Detectron ``.pkl``, or a
            checkpoint that ``torch.load(weights_only=True)`` refuses). Unpickling runs
            any code the file names, so without it such a file is refused with an error
            that says how to proceed; with it a one-line warning is logged.

    Example::

        trainer = pl.Trainer(strategy="ddp", devices=2, callbacks=[
            BroadcastParameters("R-50.pkl", name_map=my_detectron_names,
                                trust_pickle=True)])
    """

    def __init__(self, weights: Optional[str] = None, name_map: Optional[NameMap] = None,
                 strict: bool = False, verify: bool = True, trust_pickle: bool = False) -> None:
        self.weights = weights
        self.trust_pickle = trust_pickle
        self.name_map = name_map
        self.strict = strict
        self.verify = verify
        self.report: Optional[LoadReport] = None
        self._loaded = False

    def _load_on_rank0(self, trainer: pl.Trainer, module: nn.Module) -> None:
        error: Optional[BaseException] = None
        if trainer.global_rank == 0:
            try:
                blobs = load_weights_file(self.weights, trust_pickle=self.trust_pickle)
                self.report = load_weights_into(module, blobs, name_map=self.name_map,
                                                strict=self.strict, source=str(self.weights))
            except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
                error = e
        if _distributed():  # tell the other ranks, so they fail too instead of hanging
            box = [None if error is None else (type(error).__name__, str(error))]
            dist.broadcast_object_list(box, src=0)
            if box[0] is not None and error is None:
                raise RuntimeError(f"rank 0 failed to load weights: {box[0][0]}: {box[0][1]}")
        if error is not None:
            raise error

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.weights is not None and not self._loaded:
            self._load_on_rank0(trainer, pl_module)
            self._loaded = True
        n = broadcast_module(pl_module, src=0)
        if self.verify:
            verify_replicas(pl_module)
        if n and trainer.global_rank == 0:
            log.info("broadcast %d parameter/buffer tensors from rank 0 to %d ranks%s", n,
                     trainer.world_size, " and verified them" if self.verify else "")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.verify:
            verify_replicas(pl_module)
