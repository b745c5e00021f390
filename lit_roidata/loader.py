"""The loaders and their builders, usable with or without Lightning.

* :func:`build_train_loader` / :func:`build_eval_loader`: a config and a roidb in, a
  loader out (Detectron2's injectable-builder spirit: pass your own ``dataset`` or
  ``sampler`` to replace one part). :class:`~lit_roidata.RoIDataModule` only calls them.
* :class:`StatefulRoIDataLoader`: the train loader that checkpoints the batches the model
  trained on and can end its iteration at a clean step boundary (:meth:`request_stop`).
* :class:`EvalLoader`: this rank's evaluation batches, every image once, in order.

Both loaders *wrap* a ``torch.utils.data.DataLoader`` instead of subclassing one, so
Lightning neither re-instantiates nor wraps them (it returns any object that is not a
``DataLoader`` unchanged, whatever ``use_distributed_sampler`` says) and never throws
the sampler's own DDP split away for a ``DistributedSampler`` (peers.md P9).

Nothing here imports Lightning: DataLoader workers import this module.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import signal
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from lit_roidata.config import DetectronConfig
from lit_roidata.dataset import EvalDataset, RoIBlockDataset
from lit_roidata.minibatch.shm_pool import DEFAULT_SLOT_BYTES, ShmPool
from lit_roidata.sampler import RoIBatchSampler
from lit_roidata.skip import BadImageLedger, SkipPolicy, holdback_blocks

__all__ = ["StatefulRoIDataLoader", "EvalLoader", "build_train_sampler", "train_repeat_factors",
           "build_train_dataset", "build_train_loader", "build_eval_loader",
           "passthrough_collate", "fork_safe_opencv"]

log = logging.getLogger(__name__)


def passthrough_collate(batch: Any) -> Any:
    """Return the dataset's result for one block unchanged: batching is the sampler's job
    (docs/architecture.md, "Worker output")."""
    return batch


def _init_worker(user_fn: Callable[[int], None] | None, worker_id: int) -> None:
    # A terminal's Ctrl-C reaches every process of the group; a worker that died of it
    # would break the graceful stop its main process makes (lit_roidata.callbacks.
    # GracefulStop). SIGTERM keeps its default: it is how the main process (and
    # multiprocessing at exit) ends a worker that does not stop by itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if user_fn is not None:
        user_fn(worker_id)


@contextlib.contextmanager
def _frozen_heap(dl: DataLoader) -> Iterator[None]:
    """Fork the workers with what they all use built once (the dataset's ``before_fork``)
    and the parent's Python objects in the GC's permanent generation (``gc.freeze``),
    thawed in the parent afterwards.

    A forked worker shares the parent's heap copy-on-write. Its garbage collector would
    otherwise walk every object inherited from the parent (the modules of torch, NumPy,
    the dataset ...) and write to their headers on its first full collection, copying
    those pages into the worker: private memory every worker pays again. Frozen objects
    are never visited. Nothing is frozen for ``spawn``/``forkserver`` workers (they
    inherit nothing) or without workers.
    """
    if dl.num_workers == 0 or gc.get_freeze_count():
        yield  # nothing to fork, or the caller froze the heap itself
        return
    # The context the DataLoader is about to start its workers with (the default one,
    # as it would take it, when none was given).
    ctx = dl.multiprocessing_context or torch.multiprocessing.get_context()
    if ctx.get_start_method() != "fork":
        yield  # spawn / forkserver workers inherit no heap
        return
    before_fork = getattr(dl.dataset, "before_fork", None)
    if callable(before_fork):
        before_fork()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class StatefulRoIDataLoader:
    """A checkpointable train loader over a :class:`RoIBatchSampler` (design principle 4).

    Iterating yields one item per block of this rank (the dataset's ``__getitems__``
    result, passed through ``collate_fn``): the rest of the current pass (epoch mode) or
    forever (infinite mode). ``len()`` is the sampler's length, equal on every rank.

    **Position.** The loader keeps its own account of the stream: the position (pass,
    cursor in global blocks) after the last batch handed out, and, for the batches
    handed out since the optimizer last stepped, the position before each. When
    ``optimizer_steps`` is given, :meth:`state_dict` leaves out the batches handed out
    since the step count last advanced (the batch of a step that raised; a whole
    unfinished gradient-accumulation window), so a checkpoint written on an exception
    (``OnExceptionCheckpoint``) resumes with them; after the optimizer stepped (e.g. in
    ``on_train_batch_end`` or validation) nothing is left out. Lightning does not
    prefetch from loaders with a length, so at most the batches of one step are handed
    out and not trained. Restoring is O(1), for any ``num_workers`` and even another
    ``world_size``. The loader never follows Lightning's epoch number: ``set_epoch``
    (on the loader or its sampler) has no effect, every iteration starts where the
    previous one stopped.

    **Stops.** :meth:`request_stop` makes the iteration end (``StopIteration``) at the
    first clean step boundary: before handing out a batch, when this iterator has handed
    out one already (never at an epoch's first fetch), the optimizer stepped since then
    (never inside an accumulation window) and ``ready()`` agrees.

    Args:
        dataset: map-style dataset; ``__getitems__(block)`` (or ``__getitem__`` per index)
            builds the blobs of one block in a worker. With a
            :class:`~lit_roidata.skip.BadImageLedger` (``on_bad_image="skip"``) the loader
            owns the :class:`~lit_roidata.skip.SkipPolicy` (:attr:`skip_policy`).
        batch_sampler: this rank's :class:`RoIBatchSampler`.
        num_workers, pin_memory, timeout, worker_init_fn, multiprocessing_context,
            prefetch_factor, persistent_workers: as for ``torch.utils.data.DataLoader``
            (workers ignore SIGINT: the main process stops them).
        collate_fn: defaults to :func:`passthrough_collate`.
        strict_resume: when a loaded state belongs to another stream (roidb length,
            orientation count, ``ims_per_batch``, seed, grouping or shuffle differ),
            ``True`` raises ``ValueError``; ``False`` logs a warning and starts a fresh pass.
        optimizer_steps: ``() -> int``, the optimizer steps taken so far (e.g.
            ``lambda: trainer.global_step``); without it every batch handed out counts
            as trained.
        shm_pool: with workers and a dataset that supports it (``RoIBlockDataset``),
            give each worker set a :class:`~lit_roidata.minibatch.shm_pool.ShmPool`:
            ``prefetch_factor + 3`` reusable shared-memory slots per worker.
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
                 optimizer_steps: Callable[[], int] | None = None, shm_pool: bool = True,
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
            pin_memory=pin_memory, timeout=timeout,
            worker_init_fn=functools.partial(_init_worker, worker_init_fn),
            multiprocessing_context=multiprocessing_context, generator=self._generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            in_order=True)
        state = batch_sampler.state_dict()
        self._pos: tuple[int, int] = (state["pass"], state["cursor"])
        self._consumed = 0  # global minibatches handed out over the run
        self._optimizer_steps = optimizer_steps
        # Positions before the batches handed out at step count _window_steps.
        self._window: list[tuple[int, int]] = []
        self._window_steps: int | None = None
        self._stop: tuple[Callable[[], bool] | None, Callable[[], None] | None] | None = None
        ledger = getattr(dataset, "ledger", None)
        #: The :class:`~lit_roidata.skip.SkipPolicy` (``on_bad_image="skip"``), else None.
        self.skip_policy = SkipPolicy(dataset) if isinstance(ledger, BadImageLedger) else None
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

    def __len__(self) -> int:
        """Batches per epoch on this rank (:meth:`RoIBatchSampler.__len__`); with repeat
        factors, the batches of the pass the loader's next batch comes from."""
        return self.batch_sampler.length_at(*self._pos)

    def __iter__(self) -> Iterator[Any]:
        """Batches from the loader's position on: to the end of the pass (epoch mode) or
        forever (infinite mode). Nothing runs until the first ``next()``."""
        return self._generate()

    def _generate(self) -> Iterator[Any]:
        sampler = self.batch_sampler
        self._pos = sampler.normalize(*self._pos)
        sampler.load_state_dict(sampler.state_at(*self._pos))  # whatever set_epoch did
        # Worker seeds depend on the position and the rank (global-RNG use inside workers,
        # e.g. a user's augmentation, differs between ranks); the blobs themselves are
        # seeded per block (lit_roidata.rng.block_rng) and do not depend on either.
        seed = np.random.SeedSequence([sampler.seed, *self._pos, sampler.rank]
                                      ).generate_state(1)[0]
        self._generator.manual_seed(int(seed))
        batches = self._start_workers()
        handed_out = False
        while True:
            if handed_out and self._stop is not None and self._stop_now(*self._stop):
                return
            try:
                batch = next(batches)
            except StopIteration:
                return
            if self.skip_policy is not None:
                batch = self.skip_policy.on_batch(batch)
            steps = self._steps()
            if steps != self._window_steps:
                self._window, self._window_steps = [], steps
            self._window.append(self._pos)
            # Advance before yielding: a checkpoint written after this batch's step
            # must resume after it.
            self._pos = sampler.advance(*self._pos, 1)
            self._consumed += 1
            handed_out = True
            yield batch

    def _steps(self) -> int:
        return -1 if self._optimizer_steps is None else int(self._optimizer_steps())

    def _in_flight(self) -> int:
        """Batches handed out since the optimizer last stepped (not trained)."""
        if self._optimizer_steps is None or self._window_steps is None:
            return 0
        return len(self._window) if self._steps() <= self._window_steps else 0

    def _stop_now(self, ready: Callable[[], bool] | None,
                  on_stop: Callable[[], None] | None) -> bool:
        if self._in_flight():  # inside a gradient-accumulation window
            return False
        if ready is not None and not ready():
            return False
        self._stop = None
        log.debug("StatefulRoIDataLoader: stopping at pass %d, block %d", *self._pos)
        if on_stop is not None:
            on_stop()
        return True

    def request_stop(self, ready: Callable[[], bool] | None = None,
                     on_stop: Callable[[], None] | None = None) -> None:
        """End the current iteration at the next clean step boundary (class docstring).

        Args:
            ready: asked at each candidate boundary; ``False`` waits for the next one.
            on_stop: called at the boundary, before the iteration ends (e.g. to write
                a checkpoint: every batch handed out is trained, nothing is in flight).
        """
        self._stop = (ready, on_stop)

    @property
    def stop_requested(self) -> bool:
        """Whether a :meth:`request_stop` is still waiting for its boundary."""
        return self._stop is not None

    def _start_workers(self) -> Iterator[Any]:
        """``iter(DataLoader)``; a new set of workers gets a new shared-memory pool
        (flags of earlier workers, alive or dead, are never seen by the new ones)."""
        dl = self._loader
        if not self._use_pool or (dl.persistent_workers and dl._iterator is not None):
            with _frozen_heap(dl):
                return iter(dl)
        pool = ShmPool(dl.num_workers, int(dl.prefetch_factor or 2) + 3, self._slot_bytes)
        self.dataset.shm_pool = pool  # the workers take it with the dataset (fork or spawn)
        try:
            with _frozen_heap(dl):
                it = iter(dl)
        finally:
            self.dataset.shm_pool = None  # no other loader's workers may use it
        it._lit_shm_pool = pool  # alive as long as the workers that write into it
        self._pool_ref = weakref.ref(pool)
        return it

    def close(self) -> None:
        """Stop persistent workers now (other workers stop with their iterator)."""
        it = self._loader._iterator
        self._loader._iterator = None
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()

    @property
    def shm_pool(self) -> ShmPool | None:
        """The shared-memory pool of the current workers (None: none, or they are gone);
        :meth:`ShmPool.stats` counts slot reuse and fallbacks."""
        return self._pool_ref()

    def set_epoch(self, epoch: int) -> None:
        """Accepted and ignored: the stream does not follow Lightning's epoch number
        (an epoch is the rest of the current pass, or ``len()`` batches when infinite)."""

    @property
    def consumed_batches(self) -> int:
        """Global minibatches handed out over the run (restored on resume)."""
        return self._consumed

    @property
    def position(self) -> tuple[int, int]:
        """``(pass, cursor)`` after the last batch handed out (cursor in global blocks)."""
        return self._pos

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The position after the batches trained (``sampler``:
        :meth:`RoIBatchSampler.state_at`), and the skip policy's state."""
        held = self._in_flight()
        pos = self._window[-held] if held else self._pos
        state = {"sampler": self.batch_sampler.state_at(*pos),
                 "consumed_batches": self._consumed - held, "num_workers": self.num_workers}
        if self.skip_policy is not None:
            state["skip"] = self.skip_policy.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool | None = None) -> None:
        """Continue from a saved position in O(1); no batch is replayed.

        Args:
            state_dict: from :meth:`state_dict` (or a bare sampler state).
            strict: overrides ``strict_resume`` for this call.

        Raises:
            ValueError: the state belongs to another stream and resuming is strict.
        """
        strict = self.strict_resume if strict is None else bool(strict)
        sampler = self.batch_sampler
        self._pos = sampler.check_state(state_dict.get("sampler", state_dict), strict=strict)
        self._consumed = int(state_dict.get("consumed_batches", 0))
        self._window, self._window_steps = [], None
        log.debug("StatefulRoIDataLoader: data stream resumes at pass %d, block %d",
                  *self._pos)
        sampler.load_state_dict(sampler.state_at(*self._pos))
        if self.skip_policy is not None and state_dict.get("skip") is not None:
            self.skip_policy.load_state_dict(state_dict["skip"], self._pos)

    def __repr__(self) -> str:
        return (f"StatefulRoIDataLoader(pass={self._pos[0]}, cursor={self._pos[1]}, "
                f"len={len(self)}, num_workers={self.num_workers})")


def train_repeat_factors(cfg: DetectronConfig, roidb: Any) -> Any:
    """The roidb's per-entry repeat factors when the config asks for Detectron2's
    ``RepeatFactorTrainingSampler``, else None (``TrainingSampler``)."""
    from lit_roidata.config import check_sampler_train

    if not check_sampler_train(cfg):
        return None
    from lit_roidata.roidb.repeat_factors import repeat_factors_for_roidb

    return repeat_factors_for_roidb(roidb, cfg.DATALOADER.REPEAT_THRESHOLD,
                                    sqrt=bool(cfg.DATALOADER.REPEAT_SQRT))


def build_train_sampler(cfg: DetectronConfig, roidb: Any, *, seed: int | None = None,
                        rank: int = 0, world_size: int = 1, infinite: bool = False,
                        shuffle: bool = True, ims_per_batch: int | None = None,
                        bad_image_reserve: float = 0.0) -> RoIBatchSampler:
    """Detectron's batch sampler over ``roidb`` for this rank.

    With ``DATALOADER.SAMPLER_TRAIN: RepeatFactorTrainingSampler`` (Detectron2's key; the
    data module's ``sampling.repeat_factor_threshold`` sets it) the sampler gets the
    roidb's repeat factors for ``DATALOADER.REPEAT_THRESHOLD``
    (:func:`lit_roidata.roidb.repeat_factors.repeat_factors_for_roidb`, cached with the
    roidb).

    Args:
        cfg: ``TRAIN.IMS_PER_BATCH`` (per rank), ``TRAIN.ASPECT_GROUPING``, ``RNG_SEED``,
            ``DATALOADER.SAMPLER_TRAIN`` / ``REPEAT_THRESHOLD`` / ``REPEAT_SQRT``.
        seed: the stream seed (default ``cfg.RNG_SEED``).
        shuffle: ``False`` gives Detectron's ``RoIDataLoaderSimple`` identity order.
        ims_per_batch: images per block (default ``TRAIN.IMS_PER_BATCH``).
        bad_image_reserve: fraction of each pass held back as replacements for bad
            images (``on_bad_image="skip"``; :func:`lit_roidata.skip.holdback_blocks`).
    """
    mb = int(cfg.TRAIN.IMS_PER_BATCH if ims_per_batch is None else ims_per_batch)
    kw = dict(aspect_grouping=bool(cfg.TRAIN.ASPECT_GROUPING) and shuffle, shuffle=shuffle,
              seed=int(cfg.RNG_SEED if seed is None else seed), rank=rank,
              world_size=world_size, infinite=bool(infinite),
              repeat_factors=train_repeat_factors(cfg, roidb))
    sampler = RoIBatchSampler(roidb.widths, roidb.heights, mb, **kw)
    hb = holdback_blocks(sampler.blocks_per_pass, float(bad_image_reserve),
                         1 if infinite else int(world_size), mb) if bad_image_reserve else 0
    return RoIBatchSampler(roidb.widths, roidb.heights, mb, holdback=hb, **kw) if hb else sampler


def build_train_dataset(cfg: DetectronConfig, roidb: Any, sampler: RoIBatchSampler | None = None,
                        *, on_bad_image: str = "raise", **options: Any) -> RoIBlockDataset:
    """The workers' :class:`~lit_roidata.dataset.RoIBlockDataset` over ``roidb``.

    Args:
        sampler: replaces invalid minibatches (``replacement_block``); with
            ``on_bad_image="skip"`` the dataset also gets a
            :class:`~lit_roidata.skip.BadImageLedger` over it.
        **options: :class:`~lit_roidata.dataset.RoIBlockDataset` keywords
            (``output_format``, ``pixel_format``, ``rng_mode``, ``augment``, ...).
    """
    ledger = (BadImageLedger(sampler, roidb)
              if on_bad_image == "skip" and sampler is not None else None)
    return RoIBlockDataset(roidb, cfg, ledger=ledger, on_bad_image=on_bad_image,
                           replacement=None if sampler is None else sampler.replacement_block,
                           **options)


_LOADER_KEYS = ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor",
                "strict_resume", "optimizer_steps", "shm_pool", "worker_init_fn",
                "multiprocessing_context", "timeout")
_SAMPLER_KEYS = ("seed", "rank", "world_size", "infinite", "shuffle", "ims_per_batch",
                 "bad_image_reserve")


def build_train_loader(cfg: DetectronConfig, roidb: Any, *, dataset: Any = None,
                       sampler: RoIBatchSampler | None = None, on_bad_image: str = "raise",
                       **options: Any) -> StatefulRoIDataLoader:
    """The checkpointable train loader of one rank, with or without Lightning.

    Example::

        loader = build_train_loader(cfg, combined_roidb_for_training(...), num_workers=4,
                                    rank=rank, world_size=world_size, infinite=True)

    Args:
        cfg: the Detectron config (``TRAIN.*``, ``RNG_SEED``).
        roidb: the training roidb (``widths``/``heights`` columns and entries).
        dataset: your own map-style dataset (default :func:`build_train_dataset`).
        sampler: your own :class:`RoIBatchSampler` (default :func:`build_train_sampler`).
        on_bad_image: ``"raise"`` or ``"skip"`` (the reserve: ``bad_image_reserve``,
            default 0.01 of a pass).
        **options: sampler keywords (``seed``, ``rank``, ``world_size``, ``infinite``,
            ``shuffle``, ``ims_per_batch``, ``bad_image_reserve``), loader keywords
            (``num_workers``, ``pin_memory``, ``persistent_workers``, ``prefetch_factor``,
            ``strict_resume``, ``optimizer_steps``, ``shm_pool``, ...) and dataset
            keywords (``output_format``, ``pixel_format``, ``rng_mode``, ``augment``,
            ``mask_format``, ``target_format``, ``fix_rpn_quirks``).

    Raises:
        ValueError: ``persistent_workers`` with ``on_bad_image="skip"`` (each epoch's
            workers must see the bad images found in the previous one).
    """
    ld = {k: options.pop(k) for k in _LOADER_KEYS if k in options}
    sm = {k: options.pop(k) for k in _SAMPLER_KEYS if k in options}
    if on_bad_image == "skip":
        sm.setdefault("bad_image_reserve", 0.01)
        if ld.get("persistent_workers") and ld.get("num_workers"):
            raise ValueError("persistent_workers=True with on_bad_image='skip': each "
                             "epoch's workers must be new to skip the bad images found in "
                             "the previous epoch; drop one of the two")
    else:
        sm.pop("bad_image_reserve", None)
    if sampler is None:
        sampler = build_train_sampler(cfg, roidb, **sm)
    if dataset is None:
        dataset = build_train_dataset(cfg, roidb, sampler, on_bad_image=on_bad_image, **options)
    elif options:
        raise TypeError(f"build_train_loader: dataset options {sorted(options)} given with "
                        "your own dataset; set them on the dataset")
    nw = int(ld.pop("num_workers", 0))
    if nw == 0:  # PyTorch refuses these without workers
        ld.pop("prefetch_factor", None)
        ld["persistent_workers"] = False
    return StatefulRoIDataLoader(dataset, sampler, num_workers=nw, **ld)


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
            worker_init_fn=functools.partial(_init_worker, None),
            generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Any:
        return iter(self._loader)


def build_eval_loader(cfg: DetectronConfig, roidb: Any, *, rank: int = 0, world_size: int = 1,
                      **options: Any) -> EvalLoader:
    """This rank's :class:`EvalLoader` over an evaluation roidb (or ``[]`` for ``None``).

    ``options``: ``ims_per_batch``, ``pixel_format``, ``with_rois`` (the split has
    proposal files), ``num_workers``, ``pin_memory``, ``persistent_workers``,
    ``prefetch_factor``.
    """
    if roidb is None:
        return []  # type: ignore[return-value]
    return EvalLoader(roidb, cfg, rank=rank, world_size=world_size, **options)
