"""Cheap worker-to-main transport of a blob dict (docs/minibatch.md, "Worker side").

Every byte crosses the process boundary with at most one copy: arrays allocated with
:func:`shared_empty` (image, Detectron-format masks, RPN blobs) are sent as a handle, and
:func:`packed` wraps the dict so that, when pickled, every other CPU tensor (up to
``limit`` bytes) is copied once into one buffer that is itself in shared memory (a
Fast R-CNN FPN batch holds ~30 small blobs: one segment each would cost more than the
image); the main process gets a plain dict of views into it, in the original key order.
Under :class:`~lit_roidata.minibatch.shm_pool.ShmPool`, "shared memory" is a reusable slot
of the worker, and tensors travel as descriptors into it. :func:`transfer_report` counts
the bytes of each kind.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from lit_roidata.minibatch import shm_pool
from lit_roidata.osutil import malloc_trim

__all__ = ["packed", "PackedBlobs", "shared_empty", "transfer_report", "trim_heap"]

_ALIGN = 8
SMALL_LIMIT = 1 << 26  # everything not already in shared memory


class PackedBlobs(dict):
    """A dict that pickles its small tensors into one buffer (see module doc).

    With a shared-memory pool slot (``shm_arena``, set by the worker's dataset), the
    buffer is carved from the slot and every slot tensor travels as a descriptor
    (:func:`~lit_roidata.minibatch.shm_pool.pooled_reduce`).
    """

    limit: int = SMALL_LIMIT
    shm_arena: Any = None

    def __reduce__(self) -> tuple:
        if (arena := self.shm_arena) is None:
            return _unpack, _pack(self, self.limit)
        return shm_pool.pooled_reduce(_unpack, _pack(self, self.limit, arena), arena)


def packed(blobs: dict[str, Any], limit: int = SMALL_LIMIT) -> PackedBlobs:
    """Wrap ``blobs`` (nested dicts allowed one level, e.g. ``_meta``) for transport."""
    out = PackedBlobs(blobs)
    out.limit = limit
    return out


#: Former name of :func:`lit_roidata.osutil.malloc_trim` (the loader's workers call it).
trim_heap = malloc_trim


def shared_empty(shape: tuple[int, ...], dtype: Any, *, pool: bool = True) -> torch.Tensor:
    """A zero-filled CPU tensor in shared memory.

    In a DataLoader worker building a block with a
    :class:`~lit_roidata.minibatch.shm_pool.ShmPool` slot (and ``pool=True``), the tensor
    is carved from that slot, a segment reused from batch to batch (zeroed where an
    earlier batch wrote). Otherwise it is a new segment: ``torch.empty(...).share_memory_()``
    allocates privately, then allocates the shared segment and copies into it; this
    allocates the segment only. A new segment is a file extended with ``ftruncate``, so
    it reads as zeros until written (POSIX), at no cost: pages are materialised when
    first written. ``dtype`` is a torch or NumPy dtype.
    """
    if not isinstance(dtype, torch.dtype):
        dtype = torch.from_numpy(np.zeros(0, dtype=dtype)).dtype
    shape = tuple(int(x) for x in shape)
    t = shm_pool.pool_tensor(shape, dtype) if pool else None
    if t is None:
        storage = shm_pool.new_shared_storage(max(math.prod(shape) * dtype.itemsize, 1))
        t = torch.empty(0, dtype=dtype).set_(storage, 0, shape)
    return t


def transfer_report(blobs: dict[str, Any], limit: int = SMALL_LIMIT) -> dict[str, int]:
    """What sending ``blobs`` (a worker's output) to the main process costs, in bytes.

    Returns:
        ``shared_bytes``: tensors already in shared memory (sent as a handle, no copy);
        ``packed_bytes``: small tensors copied once into the packed shared buffer;
        ``moved_bytes``: other private tensors, which the pickler copies into a new
        shared segment; ``copied_bytes``: ``packed_bytes + moved_bytes``, the bytes
        copied per batch on the way out of the worker; ``tensors``: how many.
    """
    out = {"shared_bytes": 0, "packed_bytes": 0, "moved_bytes": 0, "tensors": 0}

    def walk(mapping: Any) -> None:
        for v in (mapping.values() if isinstance(mapping, dict) else mapping):
            if isinstance(v, (dict, list, tuple)):
                walk(v)
            elif isinstance(v, torch.Tensor) and v.device.type == "cpu":
                n = v.numel() * v.element_size()
                out["tensors"] += 1
                out["shared_bytes" if v.is_shared() else "packed_bytes" if n <= limit
                    else "moved_bytes"] += n

    walk(blobs)
    out["copied_bytes"] = out["packed_bytes"] + out["moved_bytes"]
    return out


def _pack(d: dict[str, Any], limit: int, arena: Any = None) -> tuple:
    chunks: list[tuple[int, torch.Tensor]] = []
    offset = 0

    def walk(mapping: dict[str, Any]) -> list[tuple]:
        nonlocal offset
        items = []
        for k, v in mapping.items():
            if isinstance(v, dict) and not isinstance(v, PackedBlobs):
                items.append((k, "dict", walk(v)))
            elif (isinstance(v, torch.Tensor) and v.device.type == "cpu" and not v.is_shared()
                  and v.numel() * v.element_size() <= limit):
                raw = v.contiguous().reshape(-1).view(torch.uint8)
                offset += (-offset) % _ALIGN
                items.append((k, "view", (offset, raw.numel(), v.dtype, tuple(v.shape))))
                chunks.append((offset, raw))
                offset += raw.numel()
            else:
                items.append((k, "value", v))
        return items

    layout = walk(d)
    # Created in shared memory: the pickler then sends a handle instead of copying it.
    # (This may run in the queue's feeder thread, while the worker builds the next
    # block: the pool slot is the one of this batch, passed explicitly.)
    buf = shm_pool.arena_tensor(arena, (offset,), torch.uint8, zero=False) if offset else None
    if buf is None:
        buf = (shared_empty((offset,), torch.uint8, pool=False) if offset
               else torch.zeros(0, dtype=torch.uint8))
    for off, raw in chunks:
        buf[off:off + raw.numel()].copy_(raw)
    return (layout, buf)


def _unpack(layout: list[tuple], buf: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, kind, payload in layout:
        if kind == "dict":
            out[k] = _unpack(payload, buf)
        elif kind == "view":
            off, n, dtype, shape = payload
            out[k] = buf[off:off + n].view(dtype).view(shape)
        else:
            out[k] = payload
    return out
