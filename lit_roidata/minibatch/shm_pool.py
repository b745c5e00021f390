"""Reusable shared-memory arenas for DataLoader workers (:class:`ShmPool`).

Per worker, ``slots`` shared-memory segments of ``slot_bytes`` each are made once by the
main process (only written pages cost memory) with a shared ``uint8`` flag per slot (0
free, 1 in use). A worker takes one of its own free slots per block (:func:`begin_block`)
and bump-allocates the block's shared arrays from it (:func:`pool_tensor`; a region
written before is zeroed again); the batch is pickled with its slot tensors as
descriptors (:func:`pooled_reduce`); the main process turns them into views of its own
mapping, all held by one lease per batch, and frees the slot once every view is gone
(:meth:`ShmPool.reclaim`). No free slot, or a full one: arrays get new segments, so
correctness never depends on the number of slots. docs/minibatch.md ("Reusable
shared-memory slots") has the whole protocol.

:func:`new_shared_storage` is the package's one use of a private torch API
(``UntypedStorage._new_shared``), with a public fallback.
"""

from __future__ import annotations

import io
import os
import pickle
import secrets
import threading
import weakref
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["ShmPool", "begin_block", "end_block", "rewind", "pool_tensor", "arena_tensor",
           "pooled_reduce", "new_shared_storage", "DEFAULT_SLOT_BYTES", "PUBLIC_SHM_ENV"]

DEFAULT_SLOT_BYTES = 128 << 20  # virtual size: only written pages cost memory
_ALIGN = 64

#: Live pools of this process by token (the main process resolves descriptors here).
_POOLS: "weakref.WeakValueDictionary[int, ShmPool]" = weakref.WeakValueDictionary()

_STATS = ("blocks", "no_free_slot", "pool_arrays", "pool_bytes", "fallback_arrays",
          "fallback_bytes", "given_back_in_worker")
_S = {name: i for i, name in enumerate(_STATS)}

_local = threading.local()  # the worker's arena for the block being built (main thread)

#: Set to 1 to make :func:`new_shared_storage` take its public path (CI tests it).
PUBLIC_SHM_ENV = "LIT_ROIDATA_PUBLIC_SHM"


def new_shared_storage(nbytes: int) -> torch.UntypedStorage:
    """A zero-filled CPU storage of ``nbytes`` in a new shared-memory segment.

    ``UntypedStorage._new_shared`` (private, no public equivalent) only creates the
    segment: its pages read as zeros and cost memory once written. Where it is missing,
    or with ``LIT_ROIDATA_PUBLIC_SHM=1``, the public path zero-fills a private buffer and
    copies it into a new segment with ``share_memory_()``: the same result, but every
    page is written (slower, and a pool slot then costs its whole size).
    """
    new_shared = getattr(torch.UntypedStorage, "_new_shared", None)
    if new_shared is not None and os.environ.get(PUBLIC_SHM_ENV, "") in ("", "0"):
        return new_shared(nbytes)
    return torch.zeros(nbytes, dtype=torch.uint8).share_memory_().untyped_storage()


@dataclass(eq=False)
class _Arena:
    """One block's use of one slot (worker side); ``used``: some tensor of the sent batch
    lies in the slot."""

    pool: "ShmPool"
    worker: int
    slot: int
    index: int
    offset: int = 0
    used: bool = False


class ShmPool:
    """Per-worker reusable shared-memory slots (see the module documentation).

    Args:
        num_workers: DataLoader workers (rows of slots).
        slots: slots per worker; at least the batches a worker can have in flight
            (``prefetch_factor``) plus those the consumer holds, or workers fall back
            to new segments more often.
        slot_bytes: capacity of a slot (virtual; written pages only cost memory).
    """

    def __init__(self, num_workers: int, slots: int, slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        if num_workers < 1 or slots < 1 or slot_bytes < _ALIGN:
            raise ValueError(f"ShmPool needs num_workers >= 1, slots >= 1 and slot_bytes >= "
                             f"{_ALIGN}; got {num_workers}, {slots}, {slot_bytes}")
        self._setup(secrets.randbits(62), int(num_workers), int(slots), int(slot_bytes),
                    [new_shared_storage(int(slot_bytes)) for _ in range(num_workers * slots)],
                    torch.zeros((num_workers, slots), dtype=torch.uint8).share_memory_(),
                    torch.zeros((num_workers, len(_STATS)), dtype=torch.int64).share_memory_())

    def _setup(self, *state: Any) -> None:
        """``state``: token, num_workers, slots, slot_bytes, storages, flags, counters."""
        self._state = state
        self.token, self.num_workers, self.slots, self.slot_bytes, storages, flags, counters = state
        self._u8 = [torch.empty(0, dtype=torch.uint8).set_(s) for s in storages]
        self._np = [t.numpy() for t in self._u8]
        self._base = {int(t.data_ptr()): i for i, t in enumerate(self._u8)}
        self.flags, self.counters = flags.numpy(), counters.numpy()
        self._dirty = [0] * len(storages)  # bytes of each slot written by this process
        self._leases = [0, 0]  # made, released (main process)
        self._outstanding: list[tuple[weakref.ref, int, int]] = []  # leases not yet freed
        self._lock = threading.Lock()  # batches may be unpickled in the pin-memory thread
        _POOLS[self.token] = self

    def __reduce__(self) -> tuple:
        # Only ForkingPickler (spawned workers) can send the segments (as descriptors).
        return (_rebuild_pool, self._state)

    # ------------------------------------------------------------------ worker side
    def acquire(self, worker: int) -> _Arena | None:
        """Take a free slot of ``worker`` for one block; None when all are in use."""
        if not 0 <= worker < self.num_workers:
            return None
        row = self.flags[worker]
        self.counters[worker, _S["blocks"]] += 1
        free = np.flatnonzero(row == 0)
        if free.size == 0:
            self.counters[worker, _S["no_free_slot"]] += 1
            return None
        row[free[0]] = 1
        return _Arena(self, worker, int(free[0]), worker * self.slots + int(free[0]))

    def give_back(self, arena: _Arena) -> None:
        """Worker side: free a slot that nothing sent refers to."""
        self.counters[arena.worker, _S["given_back_in_worker"]] += 1
        self.flags[arena.worker, arena.slot] = 0

    def _alloc(self, arena: _Arena, shape: tuple[int, ...], dtype: torch.dtype,
               zero: bool = True) -> torch.Tensor | None:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        off = arena.offset + (-arena.offset) % _ALIGN
        end = off + nbytes
        w = arena.worker
        if nbytes == 0 or end > self.slot_bytes:
            if nbytes:
                self.counters[w, [_S["fallback_arrays"], _S["fallback_bytes"]]] += (1, nbytes)
            return None
        i = arena.index
        dirty = self._dirty[i]
        if zero and dirty > off:  # written by an earlier block: callers expect zeros
            self._np[i][off:min(end, dirty)] = 0
        self._dirty[i] = max(dirty, end)
        arena.offset = end
        self.counters[w, [_S["pool_arrays"], _S["pool_bytes"]]] += (1, nbytes)
        return self._u8[i][off:end].view(dtype).view(shape)

    def _descriptor(self, t: torch.Tensor, arena: _Arena) -> tuple | None:
        """``(offset, dtype, shape, stride, class)`` when ``t`` lies in a slot of this
        pool (it must then be ``arena``'s)."""
        try:
            base = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return None
        if (i := self._base.get(int(base))) is None:
            return None
        if i != arena.index:
            raise RuntimeError("shared-memory pool: a batch refers to another block's slot "
                               f"({i} vs {arena.index}); this is a bug in lit_roidata")
        off = (t.data_ptr() - base) if t.numel() else 0
        return (int(off), t.dtype, tuple(t.shape), tuple(t.stride()), type(t),
                dict(getattr(t, "__dict__", None) or {}))

    # ------------------------------------------------------------------ main side
    def _lease(self, worker: int, slot: int) -> memoryview:
        """A new object that holds slot ``(worker, slot)`` while it lives."""
        mv = memoryview(self._np[worker * self.slots + slot])
        with self._lock:
            self._leases[0] += 1
            self._outstanding.append((weakref.ref(mv), worker, slot))
        return mv

    def reclaim(self) -> int:
        """Main process: free the slots of every batch whose tensors are all gone.

        A lease's death runs no Python code (a plain weak reference, no callback or
        ``__del__``): a Ctrl-C arriving while a batch is freed would be swallowed by a
        finaliser ("Exception ignored in ...") and training would go on. Slots are
        instead reclaimed here, each time a batch arrives (:func:`_load_pooled`) and
        when stats are read; a worker that finds no free slot meanwhile uses new
        segments. Returns the number of slots freed.
        """
        with self._lock:
            live, freed = [], 0
            for ref, worker, slot in self._outstanding:
                if ref() is None:
                    self.flags[worker, slot] = 0
                    freed += 1
                else:
                    live.append((ref, worker, slot))
            self._outstanding = live
            self._leases[1] += freed
        return freed

    def in_use(self) -> int:
        """Slots in use now (being built, in flight, or held by the consumer)."""
        self.reclaim()
        return int(self.flags.sum())

    def stats(self) -> dict[str, int]:
        """Counters summed over the workers: ``blocks`` started, ``no_free_slot``
        (blocks that found every slot in use), ``pool_arrays``/``pool_bytes`` placed in a
        slot, ``fallback_arrays``/``fallback_bytes`` given a new segment (full slot),
        ``given_back_in_worker``; and, in this process, ``leases`` made and
        ``released``, ``in_use`` slots now, ``slots`` in all."""
        self.reclaim()
        return dict({name: int(v) for name, v in zip(_STATS, self.counters.sum(axis=0))},
                    leases=self._leases[0], released=self._leases[1], in_use=self.in_use(),
                    slots=self.num_workers * self.slots, slot_bytes=self.slot_bytes)

    def __repr__(self) -> str:
        return (f"ShmPool(num_workers={self.num_workers}, slots={self.slots}, "
                f"slot_bytes={self.slot_bytes}, in_use={self.in_use()})")


def _rebuild_pool(*state: Any) -> ShmPool:
    pool = _POOLS.get(state[0])
    if pool is None:  # (else: sent back to the process that has it)
        pool = ShmPool.__new__(ShmPool)
        pool._setup(*state)
    return pool


# ---------------------------------------------------------------------- worker API
def begin_block(pool: ShmPool | None) -> _Arena | None:
    """In a DataLoader worker: take a slot of ``pool`` for the block about to be built
    and make it the target of :func:`pool_tensor` in this thread (None: no pool, no
    worker, or no free slot; arrays then get new segments)."""
    end_block()
    info = torch.utils.data.get_worker_info() if pool is not None else None
    if info is None:
        return None
    _local.arena = arena = pool.acquire(int(info.id))
    return arena


def rewind() -> None:
    """Forget what the current block allocated so far (a failed attempt's arrays)."""
    if (arena := getattr(_local, "arena", None)) is not None:
        arena.offset = 0


def end_block() -> None:
    """Stop allocating from the current block's slot in this thread."""
    _local.arena = None


def pool_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A zeroed tensor in the current block's slot, or None (no slot, or it is full)."""
    return arena_tensor(getattr(_local, "arena", None), shape, dtype)


def arena_tensor(arena: _Arena | None, shape: tuple[int, ...], dtype: torch.dtype,
                 zero: bool = True) -> torch.Tensor | None:
    """As :func:`pool_tensor`, from a given arena (any thread); ``zero=False`` for a
    tensor the caller overwrites whole."""
    return None if arena is None else arena.pool._alloc(arena, shape, dtype, zero)


def _copyable(t: torch.Tensor) -> bool:
    """A private tensor the pool may copy into a slot: a plain tensor, or one of
    torchvision's ``tv_tensors`` (their metadata is their ``__dict__``)."""
    cls = type(t)
    return ((cls is torch.Tensor or cls.__module__.startswith("torchvision.tv_tensors"))
            and not t.requires_grad and not t.is_shared() and t.numel() > 0)


class _PoolPickler(ForkingPickler):
    """Sends tensors in the block's slot as descriptors. Private tensors are copied
    into the slot first when they fit (one copy, as the pickler would make into a new
    segment of their own), so a batch of many small tensors costs no segment at all."""

    def __init__(self, file: Any, arena: _Arena) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.arena, self.pool = arena, arena.pool
        self._copied: dict[int, tuple[torch.Tensor, tuple]] = {}  # id -> (tensor, desc)

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
            return None
        if (desc := self.pool._descriptor(obj, self.arena)) is None and _copyable(obj):
            seen = self._copied.get(id(obj))
            if seen is not None:  # the same tensor twice: one copy, as pickle's memo
                return seen[1]
            t = self.pool._alloc(self.arena, tuple(obj.shape), obj.dtype, zero=False)
            if t is None:
                return None
            t.copy_(obj)
            desc = self.pool._descriptor(t, self.arena)[:-2] + (
                type(obj), dict(getattr(obj, "__dict__", None) or {}))
            self._copied[id(obj)] = (obj, desc)
        if desc is not None:
            self.arena.used = True
        return desc


def pooled_reduce(rebuild: Callable[..., Any], args: tuple, arena: _Arena) -> tuple:
    """``__reduce__`` value that sends ``rebuild(*args)`` with its slot tensors as
    descriptors (worker side; see the module documentation)."""
    buf = io.BytesIO()
    _PoolPickler(buf, arena).dump((rebuild, args))
    if not arena.used:  # nothing sent lies in the slot: free it now
        arena.pool.give_back(arena)
        return (_load_plain, (buf.getvalue(),))
    return (_load_pooled, (arena.pool.token, arena.worker, arena.slot, buf.getvalue()))


class _PoolUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, pool: ShmPool, worker: int, slot: int) -> None:
        super().__init__(file)
        self.pool, self.worker, self.slot = pool, worker, slot
        self.lease: memoryview | None = None

    def persistent_load(self, pid: Any) -> torch.Tensor:
        off, dtype, shape, stride, cls, state = pid
        if int(np.prod(shape, dtype=np.int64)) == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            if self.lease is None:
                self.lease = self.pool._lease(self.worker, self.slot)
            span = 1 + sum((n - 1) * s for n, s in zip(shape, stride))
            t = torch.frombuffer(self.lease, dtype=dtype, count=span, offset=off).as_strided(
                shape, stride)
        if cls is not torch.Tensor:
            t = t.as_subclass(cls)
            t.__dict__.update(state)
        return t


def _load_pooled(token: int, worker: int, slot: int, data: bytes) -> Any:
    if (pool := _POOLS.get(token)) is None:
        raise RuntimeError("lit_roidata: a batch arrived from DataLoader workers whose "
                           "shared-memory pool no longer exists in this process (was the "
                           "loader deleted while its iterator was in use?)")
    pool.reclaim()
    rebuild, args = _PoolUnpickler(io.BytesIO(data), pool, worker, slot).load()
    return rebuild(*args)


def _load_plain(data: bytes) -> Any:
    rebuild, args = pickle.loads(data)
    return rebuild(*args)

