"""Parameter broadcast from rank 0, a bit-exact replica check, and the
:class:`BroadcastParameters` callback that loads weights on rank 0 and runs both.

As Detectron's ``broadcast_parameters``: rank 0 loads the file (:mod:`lit_roidata.weights`),
every parameter and buffer is broadcast from rank 0, then per-tensor checksums are
compared so that a replica differing by one bit fails the run with the tensor's name.
Works with NCCL (tensors on the current CUDA device) and gloo.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any, Callable, Optional, TypeVar

import pytorch_lightning as pl
import torch
import torch.distributed as dist
from torch import nn

from lit_roidata.weights import LoadReport, NameMap, load_weights_file, load_weights_into

__all__ = ["BroadcastParameters", "ReplicaMismatchError", "broadcast_module", "verify_replicas"]

log = logging.getLogger(__name__)

_BUCKET_BYTES = 32 << 20
T = TypeVar("T")


class ReplicaMismatchError(RuntimeError):
    """Model replicas differ between ranks (after the broadcast, or in their structure)."""


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer (persistent or not) once, in model order."""
    first: dict[int, tuple[str, torch.Tensor]] = {}
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        first.setdefault(id(t), (name, t))
    return list(first.values())


def distributed() -> bool:
    """Whether a process group of more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def run_on_rank0(fn: Callable[[], T], rank: int, what: str) -> Optional[T]:
    """``fn()`` on rank 0, its result broadcast to every rank (under DDP).

    If it raises, every rank raises (none hangs): rank 0 the error itself, the others
    ``RuntimeError("rank 0 failed to <what>: <type>: <message>")``.
    """
    value: Optional[T] = None
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
            error = e
    if distributed():
        box = [(value, None if error is None else f"{type(error).__name__}: {error}")]
        dist.broadcast_object_list(box, src=0)
        value, message = box[0]
        if message is not None and error is None:
            raise RuntimeError(f"rank 0 failed to {what}: {message}")
    if error is not None:
        raise error
    return value


def gather_to_rank0(items: list[Any]) -> list[Any]:
    """Under DDP, the concatenation of every rank's ``items`` on rank 0 (``[]`` elsewhere);
    ``items`` itself otherwise."""
    if not distributed():
        return items
    gathered: Optional[list[Any]] = ([None] * dist.get_world_size()
                                     if dist.get_rank() == 0 else None)
    dist.gather_object(items, gathered, dst=0)
    return [d for part in gathered for d in part] if gathered is not None else []


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
    if not distributed():
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
            dev = (torch.device("cuda", torch.cuda.current_device())
                   if dist.get_backend() == "nccl" else bucket[0].device)  # NCCL: current GPU
            flat = torch.cat([t.detach().reshape(-1).to(dev) for t in bucket])
            dist.broadcast(flat, src=src)
            for t, part in zip(bucket, flat.split([t.numel() for t in bucket])):
                t.copy_(part.view_as(t))
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
    if not distributed():
        return 0
    mine = [(n, _checksum(t)) for n, t in _tensors(module)]
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

    Runs in ``setup`` (before the model is wrapped and the optimizer exists) and checks
    the replicas again in ``on_fit_start``; a checkpoint restored by ``ckpt_path``
    overrides the loaded weights (docs/callbacks.md).

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

    def _load(self, module: nn.Module) -> LoadReport:
        blobs = load_weights_file(self.weights, trust_pickle=self.trust_pickle)
        return load_weights_into(module, blobs, name_map=self.name_map, strict=self.strict,
                                 source=str(self.weights))

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.weights is not None and not self._loaded:
            self.report = run_on_rank0(lambda: self._load(pl_module), trainer.global_rank,
                                       "load weights")
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
