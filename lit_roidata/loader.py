"""The loaders: the train DataLoader that checkpoints the batches the training loop
consumed (:class:`StatefulRoIDataLoader`), this rank's evaluation loader
(:class:`EvalLoader`), and the worker setup they share (:func:`fork_safe_opencv`).

A plain ``DataLoader`` over :class:`~lit_roidata.sampler.RoIBatchSampler` would resume at
the sampler's cursor, which runs ``num_workers * prefetch_factor`` blocks ahead of
training; and Lightning, seeing a ``DataLoader`` in a distributed run, would rebuild it
around a ``DistributedSampler`` (``use_distributed_sampler=True``) and throw the batch
sampler's own DDP split away (peers.md P9). :class:`StatefulRoIDataLoader` solves both:

* it *wraps* a ``DataLoader`` instead of subclassing one. Lightning's
  ``_DataConnector._prepare_dataloader`` (trainer/connectors/data_connector.py) returns
  any object that is not a ``torch.utils.data.DataLoader`` unchanged, so the loader is
  neither re-instantiated nor wrapped, whatever ``use_distributed_sampler`` says;
* it implements ``state_dict``/``load_state_dict`` (Lightning's ``_Stateful`` protocol):
  the fit loop stores the state under ``loops.fit_loop.state_dict.combined_loader`` in
  every checkpoint (loops/fit_loop.py ``on_save_checkpoint``) and restores it before
  creating the iterator; since every train loader is stateful, Lightning's mid-epoch
  resume warning is not raised (loops/training_epoch_loop.py);
* the position advances when a batch is *handed to the loop*, not when a worker is given
  a block. Lightning does not prefetch from loaders that have a length
  (loops/fetchers.py ``_PrefetchDataFetcher.__iter__``), and this loader always has one,
  so at most the batch being moved to the device or trained on is handed out and not
  yet trained; the ``inflight`` callback (the data module's) says so when a checkpoint
  is written on an interrupt. Batches come out in sampler order (``in_order=True``), so
  counting them is exact;
* restoring is O(1): the saved ``(pass, cursor)`` is set on the sampler; nothing is
  replayed (design principle 4).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from lit_roidata.config import DetectronConfig
from lit_roidata.dataset import EvalDataset
from lit_roidata.minibatch.shm_pool import DEFAULT_SLOT_BYTES, ShmPool
from lit_roidata.sampler import RoIBatchSampler

__all__ = ["StatefulRoIDataLoader", "EvalLoader", "passthrough_collate", "fork_safe_opencv"]

log = logging.getLogger(__name__)


def passthrough_collate(batch: Any) -> Any:
    """Return the dataset's result for one block unchanged: batching is the sampler's job
    (docs/architecture.md, "Worker output")."""
    return batch


class _EpochHook:
    """What Lightning finds at ``loader.sampler``: it only calls ``set_epoch`` there
    (lightning_fabric/utilities/data.py ``_set_sampler_epoch``), and the epoch must reach the
    loader's consumed position, not only the sampler's draw position."""

    __slots__ = ("_loader",)

    def __init__(self, loader: "StatefulRoIDataLoader") -> None:
        self._loader = loader

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)


class StatefulRoIDataLoader:
    """A checkpointable train loader over a :class:`RoIBatchSampler` (design principle 4).

    Iterating yields one item per block of this rank (the dataset's ``__getitems__``
    result, passed through ``collate_fn``). ``len()`` is the sampler's length, equal on
    every rank. The state is the sampler's position after the last batch handed out,
    counted in global blocks, so a checkpoint taken mid-epoch resumes with exactly the
    batches an uninterrupted run would have produced, for any ``num_workers`` and even
    with another ``world_size``.

    Args:
        dataset: map-style dataset; ``__getitems__(block)`` (or ``__getitem__`` per index)
            builds the blobs of one block in a worker.
        batch_sampler: this rank's :class:`RoIBatchSampler`.
        num_workers, pin_memory, timeout, worker_init_fn, multiprocessing_context,
            prefetch_factor, persistent_workers: as for ``torch.utils.data.DataLoader``.
        collate_fn: defaults to :func:`passthrough_collate`.
        strict_resume: when a loaded state belongs to another stream (roidb length,
            orientation count, ``ims_per_batch``, seed, grouping or shuffle differ),
            ``True`` raises ``ValueError``; ``False`` logs a warning and starts a fresh pass.
        inflight: optional ``() -> int``: batches handed to the loop but not trained on
            when :meth:`state_dict` runs (e.g. 1 when ``training_step`` raised and
            ``OnExceptionCheckpoint`` saves); the saved position is moved back before them
            (up to 8).
        on_pass_end: optional ``() -> None`` called when the batch that finishes a pass is
            handed out (local work only: no collective inside batch fetching).
        on_batch: optional ``batch -> batch`` applied in this process, in stream order, to
            every batch before it is handed out (e.g. ``RoIBlockDataset.repair`` of the
            skip policy, counting skips).
        on_restore: optional ``(loader, state) -> None`` called at the end of
            :meth:`load_state_dict` (the data module aligns Lightning's loop counters with
            the restored position there).
        shm_pool: with workers and a dataset that supports it (``RoIBlockDataset``),
            give each worker set a :class:`~lit_roidata.minibatch.shm_pool.ShmPool`:
            ``prefetch_factor + 3`` reusable shared-memory slots per worker, so batches
            leave the workers without creating, faulting in and mapping new segments.
            A slot is reused only once every tensor of the batch it held is gone.
        shm_pool_slot_bytes: capacity of a slot (virtual: only written pages cost
            memory); an array that does not fit gets a new segment.

    Raises:
        TypeError: an ``IterableDataset`` or a batch sampler that is not a
            ``RoIBatchSampler``.
    """

    def __init__(self, dataset: Any, batch_sampler: RoIBatchSampler, *, num_workers: int = 0,
                 collate_fn: Callable[[Any], Any] | None = None, pin_memory: bool = False,
                 timeout: float = 0, worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, strict_resume: bool = True,
                 inflight: Callable[[], int] | None = None,
                 on_pass_end: Callable[[], None] | None = None,
                 on_restore: Callable[["StatefulRoIDataLoader", Mapping[str, Any]], None]
                 | None = None,
                 on_batch: Callable[[Any], Any] | None = None, shm_pool: bool = True,
                 shm_pool_slot_bytes: int = DEFAULT_SLOT_BYTES) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError("StatefulRoIDataLoader needs a map-style dataset (blocks of roidb "
                            f"indices are fetched by index); got {type(dataset).__name__}")
        if not isinstance(batch_sampler, RoIBatchSampler):
            raise TypeError("StatefulRoIDataLoader: batch_sampler must be a RoIBatchSampler, "
                            f"got {type(batch_sampler).__name__}")
        self.dataset = dataset
        self.batch_sampler = batch_sampler
        self.strict_resume = bool(strict_resume)
        if num_workers > 0:
            fork_safe_opencv()
        # A private generator: the DataLoader draws the worker base seed from it, so the
        # global torch RNG is never touched (a resumed run would otherwise diverge).
        self._generator = torch.Generator()
        self._loader = DataLoader(
            dataset, batch_sampler=batch_sampler, num_workers=num_workers,
            collate_fn=passthrough_collate if collate_fn is None else collate_fn,
            pin_memory=pin_memory, timeout=timeout, worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context, generator=self._generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            in_order=True)
        state = batch_sampler.state_dict()
        self._pos: tuple[int, int] = (state["pass"], state["cursor"])
        self._consumed = 0  # global minibatches handed out over the run (informational)
        self._recent: deque[tuple[int, int]] = deque(maxlen=8)  # positions before them
        self._inflight = inflight
        self._on_pass_end = on_pass_end
        self._on_restore = on_restore
        self._on_batch = on_batch
        self.sampler = _EpochHook(self)
        self._use_pool = bool(shm_pool) and num_workers > 0 and hasattr(dataset, "shm_pool")
        self._slot_bytes = int(shm_pool_slot_bytes)
        self._pool_ref: Callable[[], ShmPool | None] = lambda: None

    # ------------------------------------------------------------------ DataLoader face
    @property
    def dataloader(self) -> DataLoader:
        """The wrapped ``torch.utils.data.DataLoader``."""
        return self._loader

    @property
    def num_workers(self) -> int:
        return self._loader.num_workers

    @property
    def pin_memory(self) -> bool:
        return self._loader.pin_memory

    @property
    def persistent_workers(self) -> bool:
        return self._loader.persistent_workers

    @property
    def collate_fn(self) -> Callable[[Any], Any]:
        return self._loader.collate_fn

    @property
    def _iterator(self) -> Any:
        # Lightning's CombinedLoader.reset() shuts persistent workers down through this.
        return self._loader._iterator

    @_iterator.setter
    def _iterator(self, value: Any) -> None:
        self._loader._iterator = value

    def __len__(self) -> int:
        """Batches per epoch on this rank (:meth:`RoIBatchSampler.__len__`)."""
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[Any]:
        """Batches from the consumed position on: to the end of the pass (epoch mode) or
        forever (infinite mode). Nothing runs until the first ``next()``, so Lightning can
        create the iterator, then call ``set_epoch``, then fetch."""
        return self._generate()

    def _generate(self) -> Iterator[Any]:
        sampler = self.batch_sampler
        self._pos = sampler.normalize(*self._pos)
        sampler.load_state_dict(sampler.state_at(*self._pos))
        # Worker seeds depend on the position and the rank (global-RNG use inside workers,
        # e.g. a user's augmentation, differs between ranks); the blobs themselves are
        # seeded per block (lit_roidata.rng.block_rng) and do not depend on either.
        seed = np.random.SeedSequence([sampler.seed, *self._pos, sampler.rank]
                                      ).generate_state(1)[0]
        self._generator.manual_seed(int(seed))
        for batch in self._start_workers():
            if self._on_batch is not None:
                batch = self._on_batch(batch)
            # Advance before yielding: a checkpoint written while the loop holds this
            # batch must resume after it.
            self._recent.append(self._pos)
            self._pos = sampler.advance(*self._pos, 1)
            self._consumed += 1
            if self._on_pass_end is not None and self._pass_ended(self._recent[-1]):
                self._on_pass_end()
            yield batch

    def _start_workers(self) -> Iterator[Any]:
        """``iter(DataLoader)``; a new set of workers gets a new shared-memory pool
        (flags of earlier workers, alive or dead, are never seen by the new ones)."""
        dl = self._loader
        if not self._use_pool or (dl.persistent_workers and dl._iterator is not None):
            return iter(dl)
        pool = ShmPool(dl.num_workers, int(dl.prefetch_factor or 2) + 3, self._slot_bytes)
        self.dataset.shm_pool = pool  # the workers take it with the dataset (fork or spawn)
        try:
            it = iter(dl)
        finally:
            self.dataset.shm_pool = None  # no other loader's workers may use it
        it._lit_shm_pool = pool  # alive as long as the workers that write into it
        self._pool_ref = weakref.ref(pool)
        return it

    @property
    def shm_pool(self) -> ShmPool | None:
        """The shared-memory pool of the current workers (None: none, or they are gone);
        :meth:`ShmPool.stats` counts slot reuse and fallbacks."""
        return self._pool_ref()

    def _pass_ended(self, before: tuple[int, int]) -> bool:
        if self.batch_sampler.infinite:
            return self._pos[0] != before[0]
        return self.batch_sampler.normalize(*self._pos)[0] != self._pos[0]

    def set_epoch(self, epoch: int) -> None:
        """Epoch mode: start pass ``epoch`` unless it is the current one (a mid-epoch
        resume keeps its cursor). Infinite mode: no effect. Lightning calls this through
        ``loader.sampler.set_epoch`` at every epoch start."""
        self.batch_sampler.set_epoch(epoch)
        if not self.batch_sampler.infinite and epoch != self._pos[0]:
            self._pos = (int(epoch), 0)
            self._recent.clear()

    @property
    def consumed_batches(self) -> int:
        """Global minibatches handed to the loop over the run (restored on resume)."""
        return self._consumed

    @property
    def position(self) -> tuple[int, int]:
        """``(pass, cursor)`` after the last batch handed out (cursor in global blocks)."""
        return self._pos

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The consumed position (``sampler`` entry, :meth:`RoIBatchSampler.state_at`)."""
        pos, consumed = self._pos, self._consumed
        held = 0 if self._inflight is None else int(self._inflight())
        if held > 0:
            if held > len(self._recent):
                raise RuntimeError(f"StatefulRoIDataLoader: {held} batches in flight but only "
                                   f"{len(self._recent)} recent positions are known")
            pos, consumed = self._recent[-held], consumed - held
        return {"sampler": self.batch_sampler.state_at(*pos),
                "consumed_batches": consumed, "num_workers": self.num_workers}

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool | None = None) -> None:
        """Continue from a saved position in O(1); no batch is replayed.

        Args:
            state_dict: from :meth:`state_dict` (or a bare sampler state).
            strict: overrides ``strict_resume`` for this call.

        Raises:
            ValueError: the state belongs to another stream and resuming is strict.
        """
        strict = self.strict_resume if strict is None else bool(strict)
        sampler_state = state_dict.get("sampler", state_dict)
        self._pos = self.batch_sampler.check_state(sampler_state, strict=strict)
        self._consumed = int(state_dict.get("consumed_batches", 0))
        self._recent.clear()
        log.debug("StatefulRoIDataLoader: data stream resumes at pass %d, block %d",
                  *self._pos)
        self.batch_sampler.load_state_dict(self.batch_sampler.state_at(*self._pos))
        if self._on_restore is not None:
            self._on_restore(self, state_dict)

    def __repr__(self) -> str:
        return (f"StatefulRoIDataLoader(pass={self._pos[0]}, cursor={self._pos[1]}, "
                f"len={len(self)}, num_workers={self.num_workers})")


def fork_safe_opencv() -> None:
    """Stop OpenCV's thread pool in this process before DataLoader workers fork.

    A worker forked while the parent's pool exists inherits its locks but not its
    threads, and its first call that uses the pool (or ``cv2.setNumThreads``) can wait
    forever.
    The parent's pool is started by any earlier multi-threaded OpenCV call (demo data
    generation, ``num_workers=0`` loading, the tools), so it is shut down here; the main
    process then runs OpenCV single-threaded, which costs nothing when workers decode.
    Both loaders of this module call it when they start workers.
    """
    import cv2

    if cv2.getNumThreads() != 1:
        cv2.setNumThreads(1)


class EvalLoader:
    """This rank's evaluation batches: a contiguous shard of the roidb, in order.

    Shards differ by at most one image (no padding, no duplicates: COCO AP counts every
    image once). Like :class:`~lit_roidata.loader.StatefulRoIDataLoader` it wraps the
    ``DataLoader`` so Lightning never swaps in a ``DistributedSampler``, which would
    pad the shards with repeated images.
    """

    def __init__(self, roidb: Any, cfg: DetectronConfig, *, rank: int = 0, world_size: int = 1,
                 ims_per_batch: int = 1, pixel_format: str = "uint8", num_workers: int = 0,
                 pin_memory: bool = False, with_rois: bool = False,
                 persistent_workers: bool = False, prefetch_factor: int | None = None
                 ) -> None:
        shard = np.array_split(np.arange(len(roidb)), world_size)[rank]
        self.batches = [shard[i:i + ims_per_batch].tolist()
                        for i in range(0, len(shard), ims_per_batch)]
        self.dataset = EvalDataset(roidb, cfg, pixel_format=pixel_format, with_rois=with_rois)
        self.num_workers = min(int(num_workers), len(self.batches))
        if self.num_workers > 0:
            fork_safe_opencv()
        # A private generator: creating the iterator draws the workers' base seed, which
        # would otherwise come from (and advance) the global torch RNG, so a validation
        # would change the training that follows it.
        self._loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=self.batches, collate_fn=passthrough_collate,
            num_workers=self.num_workers, pin_memory=pin_memory,
            persistent_workers=bool(persistent_workers) and self.num_workers > 0,
            prefetch_factor=prefetch_factor if self.num_workers > 0 else None,
            generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        return iter(self._loader)
