"""The loaders and their builders, usable with or without Lightning.

:func:`build_train_loader` / :func:`build_eval_loader` take a config and a roidb (pass your
own ``dataset`` or ``sampler`` to replace one part); :class:`StatefulRoIDataLoader`, the
train loader, alone owns the stream's position (docs/sampler.md); :class:`EvalLoader` gives
this rank's evaluation batches. Both *wrap* a ``torch.utils.data.DataLoader`` instead of
subclassing one, so Lightning neither re-instantiates nor wraps them and never swaps in a
``DistributedSampler``.

Nothing here imports Lightning: DataLoader workers import this module.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import inspect
import logging
import os
import re
import signal
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from lit_roidata.config import DetectronConfig, check_sampler_train
from lit_roidata.dataset import BadImageFound, EvalDataset, RoIBlockDataset
from lit_roidata.minibatch.shm_pool import DEFAULT_SLOT_BYTES, ShmPool
from lit_roidata.plan import Block, StreamPlan
from lit_roidata.sampler import RoIBatchSampler
from lit_roidata.skip import BadImageLedger, SkipPolicy

__all__ = ["StatefulRoIDataLoader", "EvalLoader", "WorkerDiedError", "build_train_sampler",
           "train_repeat_factors", "build_train_dataset", "build_train_loader",
           "build_eval_loader", "passthrough_collate", "fork_safe_opencv"]

log = logging.getLogger(__name__)


def passthrough_collate(batch: Any) -> Any:
    """Return the dataset's result for one block unchanged: batching is the plan's job
    (docs/architecture.md, "Worker output")."""
    return batch


def _init_worker(user_fn: Callable[[int], None] | None, worker_id: int) -> None:
    # A terminal's Ctrl-C and a scheduler's SIGTERM reach every process of the group; a
    # worker that died of them would turn the main process's graceful stop into an abort.
    # Workers end when the main process shuts them down (or exits: DataLoader workers
    # watch their parent).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _sigterm_only_from_parent()
    if user_fn is not None:
        user_fn(worker_id)


def _sigterm_only_from_parent() -> None:
    """Ignore SIGTERM in this worker unless the main process sent it.

    The main process ends a worker that does not stop by itself with SIGTERM
    (``Process.terminate``, e.g. at interpreter exit), and that must keep working; a
    SIGTERM from anyone else (a scheduler signalling the whole job) is ignored. The signal
    is blocked and a thread reads it with its sender (``sigwaitinfo``). Where that is not
    available, SIGTERM is simply ignored.
    """
    if not hasattr(signal, "sigwaitinfo"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return
    parent = os.getppid()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not a handler inherited from the parent
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def watch() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
            pass
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # in this thread:
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # die of it, as before

    threading.Thread(target=watch, name="lit-roidata-sigterm", daemon=True).start()


class WorkerDiedError(RuntimeError):
    """A DataLoader worker of the train loader died (killed by a signal or exited)."""


_DEATHS: dict[int, int] = {}  # worker pid -> the signal that killed it (SIGCHLD record)


def _record_child_death(signum: int, frame: Any) -> None:
    # Note which child died of which signal, without reaping it (its owner waits for it).
    with contextlib.suppress(ChildProcessError, OSError):
        info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None and info.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            _DEATHS[info.si_pid] = info.si_status


def _detect_deaths_at_fetch() -> None:
    """Make a worker's death an error at the next fetch, not at any bytecode.

    PyTorch's own SIGCHLD handler raises in the main thread wherever it happens to be: in
    the middle of a step (Lightning then counts a batch it never trained), or inside the
    checkpoint an earlier error is writing. Replaced by one that only records the signal;
    the DataLoader still reports the death when the next batch is fetched (it checks its
    workers whenever it waits), and the train loader names it (:class:`WorkerDiedError`).
    """
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGCHLD"):
        signal.signal(signal.SIGCHLD, _record_child_death)


def _worker_death(message: str, where: tuple[int, int]) -> str | None:
    """The named error for a DataLoader message about a dead worker, else None."""
    if "DataLoader worker" not in message or not re.search(
            r"killed by signal|exited unexpectedly", message):
        return None
    found = re.search(r"pid(?:\(s\))? ([\d, ]+)", message)
    pids = [int(p) for p in re.findall(r"\d+", found.group(1))] if found else []
    m = re.search(r"killed by signal: (\w+)", message)
    said = f"SIG{m.group(1).upper()}" if m else "an unknown cause"
    said = {"SIGKILLED": "SIGKILL", "SIGTERMINATED": "SIGTERM"}.get(said, said)
    parts = [f"pid {pid}, {said if s is None else signal.Signals(s).name}"
             for pid in pids or [0] for s in [_DEATHS.pop(pid, None)]]
    hint = ("SIGKILL is most often the kernel's out-of-memory killer (see `dmesg`): lower "
            "loader.num_workers, loader.prefetch_factor or TRAIN.IMS_PER_BATCH, or give the "
            "job more memory" if "SIGKILL" in " ".join(parts) else
            "Check the worker's log above for its own error")
    return (f"a DataLoader worker of the train loader died ({'; '.join(parts)}) while the "
            f"stream was at pass {where[0]}, block {where[1]}. {hint}. Nothing is lost: a "
            "checkpoint written now (OnExceptionCheckpoint) resumes the stream exactly. "
            f"(PyTorch: {message.strip()})")


@contextlib.contextmanager
def _frozen_heap(dl: DataLoader) -> Iterator[None]:
    """Fork the workers with what they all use built once (the dataset's ``before_fork``)
    and the parent's objects in the GC's permanent generation (``gc.freeze``), thawed in
    the parent afterwards, so a worker's collector never copies inherited pages. Nothing
    is done for ``spawn``/``forkserver`` workers (they inherit nothing) or without workers.
    """
    ctx = dl.multiprocessing_context or torch.multiprocessing.get_context()
    # nothing to fork, or the caller froze the heap itself
    if dl.num_workers == 0 or gc.get_freeze_count() or ctx.get_start_method() != "fork":
        yield
        return
    before_fork = getattr(dl.dataset, "before_fork", None)
    if callable(before_fork):
        before_fork()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _BlockSource:
    """The DataLoader's batch sampler: this rank's final blocks from :attr:`start` on,
    across pass ends (the loader decides where an epoch ends).

    Images known to be bad are replaced before anything is read. :attr:`issued` holds
    ``(planned block, block sent)`` for every block handed to the workers and not yet
    delivered, in stream order (the DataLoader delivers in order).
    """

    def __init__(self, plan: StreamPlan, ledger: BadImageLedger | None,
                 ahead: tuple[int, int]) -> None:
        # ahead: (read_ahead blocks, num_workers), see _AheadBlock
        self.plan, self.ledger, self.ahead, self.start = plan, ledger, ahead, (0, 0)
        self.issued: collections.deque[tuple[Any, Any]] = collections.deque()

    def __iter__(self) -> Iterator[Any]:
        plan, ledger, pos, (ahead, nw) = self.plan, self.ledger, self.start, self.ahead
        self.issued.clear()
        buf: collections.deque = collections.deque()
        while True:
            while len(buf) <= ahead * nw:
                blk, pos = plan.next_block(*pos)
                buf.append(blk)
            blk = buf.popleft()
            sent = blk if ledger is None else plan.final_block(
                blk, ledger.frozen_for(blk.pass_index))
            self.issued.append((blk, sent))
            yield _AheadBlock.of(sent, list(buf)[nw - 1::nw]) if ahead else sent

    def __len__(self) -> int:
        return self.plan.length_at(*self.start)


class _AheadBlock(Block):
    """A block and ``ahead``: the roidb indices of the next ``read_ahead`` blocks of the
    same worker (round robin), which it fetches while it decodes this one."""

    __slots__ = ("ahead",)

    @classmethod
    def of(cls, blk: Block, nxt: list) -> "_AheadBlock":
        out = cls(*blk.__reduce__()[1])
        out.ahead = [int(i) for b in nxt for i in b]
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return (_AheadBlock.of, (Block(*super().__reduce__()[1]), [self.ahead]))


class StatefulRoIDataLoader:
    """The checkpointable train loader of one rank, the one owner of the stream position.

    Iterating yields one item per block of this rank (the dataset's ``__getitems__``
    result): the rest of the current pass (epoch mode) or forever (infinite mode).
    :meth:`state_dict` saves the position after the batches *trained*; restoring is O(1),
    for any ``num_workers`` and another ``world_size``, and Lightning's counters never
    decide what data comes next (docs/sampler.md, docs/ddp_and_resume.md).

    Args:
        dataset: map-style dataset; ``__getitems__(block)`` builds one block in a worker
            (with ``hand_back_bad_images``, the loader owns the skip policy).
        batch_sampler: this rank's :class:`~lit_roidata.plan.StreamPlan` (a
            :class:`RoIBatchSampler` also gives the starting position).
        num_workers, pin_memory, timeout, worker_init_fn, multiprocessing_context,
            prefetch_factor, persistent_workers, collate_fn: as for ``DataLoader``
            (``collate_fn`` defaults to :func:`passthrough_collate`).
        strict_resume: a loaded state of another stream raises ``ValueError`` (``True``) or
            logs a warning and starts a fresh pass (``False``).
        optimizer_steps: ``() -> int``, the optimizer steps so far (``lambda:
            trainer.global_step``); without it every batch handed out counts as trained.
        shm_pool, shm_pool_slot_bytes: reusable shared-memory slots per worker.
        epoch_length: infinite mode: the batches of a Lightning epoch (default: a pass).
        read_ahead: blocks each worker fetches ahead (object storage; 0: off).

    Raises:
        TypeError: an ``IterableDataset`` or a sampler that is not a ``StreamPlan``.
    """

    def __init__(self, dataset: Any, batch_sampler: StreamPlan, *, num_workers: int = 0,
                 collate_fn: Callable[[Any], Any] | None = None, pin_memory: bool = False,
                 timeout: float = 0, worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, strict_resume: bool = True,
                 optimizer_steps: Callable[[], int] | None = None, shm_pool: bool = True,
                 shm_pool_slot_bytes: int = DEFAULT_SLOT_BYTES,
                 epoch_length: int | None = None, read_ahead: int = 0) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError("StatefulRoIDataLoader needs a map-style dataset (blocks of roidb "
                            f"indices are fetched by index); got {type(dataset).__name__}")
        if not isinstance(batch_sampler, StreamPlan):
            raise TypeError("StatefulRoIDataLoader: batch_sampler must be a RoIBatchSampler "
                            f"(or a StreamPlan), got {type(batch_sampler).__name__}")
        self.dataset, self.batch_sampler = dataset, batch_sampler
        self.strict_resume = bool(strict_resume)
        self.epoch_length = None if epoch_length is None else int(epoch_length)
        #: The :class:`~lit_roidata.skip.SkipPolicy` (``on_bad_image="skip"``), else None.
        self.skip_policy: SkipPolicy | None = (
            SkipPolicy(BadImageLedger(batch_sampler, dataset.roidb))
            if getattr(dataset, "hand_back_bad_images", False) else None)
        self._source = _BlockSource(batch_sampler, self.skip_policy and self.skip_policy.ledger,
                                    (int(read_ahead), max(1, num_workers)))
        if num_workers > 0:
            fork_safe_opencv()
        # A private generator: the DataLoader draws the worker base seed from it, so the
        # global torch RNG is never touched (a resumed run would otherwise diverge).
        self._generator = torch.Generator()
        self._make_loader = functools.partial(
            DataLoader, dataset, batch_sampler=self._source, num_workers=num_workers,
            collate_fn=passthrough_collate if collate_fn is None else collate_fn,
            pin_memory=pin_memory, timeout=timeout, generator=self._generator, in_order=True,
            worker_init_fn=functools.partial(_init_worker, worker_init_fn),
            multiprocessing_context=multiprocessing_context, prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers)
        self._loader = self._make_loader()
        self._persistent_started = False
        self._stream: Iterator[Any] | None = None  # the running DataLoader iterator
        self._stream_next: tuple[int, int] | None = None  # the position of its next block
        state = getattr(batch_sampler, "state_dict", lambda: {"pass": 0, "cursor": 0})()
        self._pos: tuple[int, int] = (state["pass"], state["cursor"])
        # Counts: global minibatches handed out over the run; batches of the current epoch
        # trained before a restore; the restored count the running epoch started with;
        # batches handed out by the current iteration.
        self._consumed = self._epoch_base = self._iter_base = self._epoch_count = 0
        self._epoch_start: tuple[int, int] | None = None  # where the current epoch began
        self._optimizer_steps = optimizer_steps
        self._window: list[tuple[int, int]] = []  # positions before the untrained batches
        self._window_steps: int | None = None
        self._stop: tuple[Callable[[], bool] | None, Callable[[], None] | None] | None = None
        self._abort = False
        self._use_pool = bool(shm_pool) and num_workers > 0 and hasattr(dataset, "shm_pool")
        self._slot_bytes = int(shm_pool_slot_bytes)
        self._pool_ref: Callable[[], ShmPool | None] = lambda: None

    # ------------------------------------------------------------------ DataLoader face
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
        """Batches of the current epoch on this rank, equal on every rank (class docstring).
        Infinite mode: the batches of a pass (Lightning's epoch length)."""
        base, start = ((self._epoch_base, self._pos) if self._epoch_start is None
                       else (self._iter_base, self._epoch_start))
        if self.batch_sampler.infinite:
            return self.epoch_length or self.batch_sampler.length_at(*start)
        return base + self.batch_sampler.remaining_at(*start)

    def __iter__(self) -> Iterator[Any]:
        """Batches from the loader's position on: to the end of the pass (epoch mode) or
        forever (infinite mode). A new epoch begins here; the workers start at the first
        ``next()``."""
        self._pos = self.batch_sampler.normalize(*self._pos)
        # A restored mid-epoch count belongs to the first epoch after the restore only.
        self._iter_base, self._epoch_base = self._epoch_base, 0
        self._epoch_start, self._epoch_count = self._pos, 0
        return self._generate()

    def _generate(self) -> Iterator[Any]:
        plan, epoch_pass, handed_out = self.batch_sampler, self._pos[0], False
        while True:
            if self._abort:
                self._abort = False
                raise KeyboardInterrupt("aborted at a step boundary (second signal)")
            if handed_out and self._stop is not None and self._stop_now(*self._stop):
                return
            if not plan.infinite and plan.normalize(*self._pos)[0] != epoch_pass:
                self._epoch_start = None  # the epoch (the pass) is complete
                return
            died = None
            try:
                batch = next(self._stream_at(self._pos))
            except RuntimeError as exc:
                died = _worker_death(str(exc), self._pos)
                if died is None:
                    self._stream = None
                    raise
            if died is not None:  # outside the handler: no traceback keeps the workers
                self.close()
                raise WorkerDiedError(died)
            batch = self._finish(self._current(batch))
            steps = self._steps()
            if steps != self._window_steps:
                self._window, self._window_steps = [], steps
            self._window.append(self._pos)
            # Advance before yielding: a checkpoint written after this batch's step
            # must resume after it.
            self._pos = self._stream_next = plan.advance(*self._pos, 1)
            self._consumed += 1
            self._epoch_count += 1
            handed_out = True
            yield batch

    def _current(self, batch: Any) -> Any:
        """``batch``, or its block built again (main process) when a skip exchange has
        changed the known-bad images of its pass since the workers were given it."""
        planned, sent = self._source.issued.popleft()
        if self.skip_policy is None:
            return batch
        want = self.batch_sampler.final_block(
            planned, self.skip_policy.ledger.frozen_for(planned.pass_index))
        if list(want) == list(sent) and want.substitutes == sent.substitutes:
            return batch
        log.debug("block %d of pass %d built again: known bad images changed",
                  planned.block_index, planned.pass_index)
        return self.dataset.build_stream_block(want)

    def _stream_at(self, pos: tuple[int, int]) -> Iterator[Any]:
        """The DataLoader iterator whose next block is the one at ``pos``.

        The iterator outlives the epoch (and Lightning's ``iter()`` calls): its workers
        build the next pass's first blocks while the current pass ends, so a pass boundary
        costs no wait. It is started again only at another position (a restored state).
        A block built ahead with known-bad images that a skip exchange has changed since is
        built again when it is delivered (:meth:`_current`).
        """
        plan = self.batch_sampler
        if (self._stream is not None and self._stream_next is not None
                and plan.normalize(*self._stream_next) == plan.normalize(*pos)):
            return self._stream
        self._stream = None  # dropping the iterator shuts its (non-persistent) workers down
        # Worker seeds depend on the position and the rank (global-RNG use inside workers
        # differs between ranks); the blobs are seeded per block and depend on neither.
        seed = np.random.SeedSequence([plan.seed, *pos, plan.rank]).generate_state(1)[0]
        self._generator.manual_seed(int(seed))
        self._source.start = pos
        self._stream, self._stream_next = self._start_workers(), pos
        return self._stream

    def _finish(self, item: Any) -> Any:
        """Finish a block whose worker found a bad image (main process, stream order) and
        count the batch's skips."""
        policy, tries = self.skip_policy, 0
        while isinstance(item, BadImageFound):
            if policy is None or tries > self.dataset.max_attempts:
                raise RuntimeError(
                    f"block {item.block.requested} (pass {item.block.pass_index}, block "
                    f"{item.block.block_index}): {tries} bad images replaced in a row and the "
                    f"last one is bad too ({item.record.get('message')}). Check the image "
                    "files (the skip report lists them)")
            tries += 1
            new = policy.ledger.mark_bad(int(item.block[item.slot]), item.record)
            if new:
                log.warning("skipping %s (replacing only this image of its block)",
                            item.record.get("message"))
            block, _ = policy.ledger.substitute(item.block, item.slot, attempt=tries - 1)
            item = self.dataset.build_stream_block(
                block, item.skipped + [dict(item.record, again=not new)])
        meta = item.get("_meta") if isinstance(item, dict) else getattr(item, "meta", None)
        if policy is not None and isinstance(meta, Mapping):
            policy.count(meta)
        return item

    def _steps(self) -> int:
        return -1 if self._optimizer_steps is None else int(self._optimizer_steps())

    def _in_flight(self) -> int:
        """Batches handed out since the optimizer last stepped (not trained)."""
        if self._optimizer_steps is None or self._window_steps is None:
            return 0
        return len(self._window) if self._steps() <= self._window_steps else 0

    def _stop_now(self, ready: Callable[[], bool] | None,
                  on_stop: Callable[[], None] | None) -> bool:
        # not inside a gradient-accumulation window
        if self._in_flight() or (ready is not None and not ready()):
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

    def request_abort(self) -> None:
        """Raise ``KeyboardInterrupt`` before the next batch is handed out (an abort
        between two steps, where every count agrees with the batches trained)."""
        self._abort = True

    @property
    def stop_requested(self) -> bool:
        """Whether a :meth:`request_stop` is still waiting for its boundary."""
        return self._stop is not None

    def _start_workers(self) -> Iterator[Any]:
        """``iter(DataLoader)``; a new set of workers gets a new shared-memory pool
        (flags of earlier workers, alive or dead, are never seen by the new ones)."""
        dl = self._loader
        reuse = dl.persistent_workers and self._persistent_started
        self._persistent_started = dl.persistent_workers
        pool = None
        if self._use_pool and not reuse:
            pool = ShmPool(dl.num_workers, int(dl.prefetch_factor or 2) + 3, self._slot_bytes)
            self.dataset.shm_pool = pool  # the workers take it with the dataset
        try:
            with _frozen_heap(dl):
                it = iter(dl)
        finally:
            if pool is not None:
                self.dataset.shm_pool = None  # no other loader's workers may use it
        if pool is not None:
            it.lit_shm_pool = pool  # alive as long as the workers that write into it
            self._pool_ref = weakref.ref(pool)
        if dl.num_workers:
            _detect_deaths_at_fetch()
        return it

    def close(self) -> None:
        """Stop the workers now: the running iterator and the DataLoader holding them are
        dropped (which shuts the workers down) and a fresh DataLoader takes their place."""
        self._stream = self._stream_next = None
        self._loader = self._make_loader()
        self._persistent_started = False
        gc.collect()  # the iterator's own reference cycles, if any

    @property
    def shm_pool(self) -> ShmPool | None:
        """The shared-memory pool of the current workers (None: none, or they are gone);
        :meth:`ShmPool.stats` counts slot reuse and fallbacks."""
        return self._pool_ref()

    def set_epoch(self, epoch: int) -> None:
        """Accepted and ignored: the stream does not follow Lightning's epoch number."""

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
        """The position after the batches trained, the batches of the current epoch
        trained, and the skip policy's state."""
        held = self._in_flight()
        pos = self._window[-held] if held else self._pos
        epoch = (self._epoch_base if self._epoch_start is None
                 else self._iter_base + self._epoch_count - held)
        state = {"sampler": self.batch_sampler.state_at(*pos),
                 "consumed_batches": self._consumed - held, "epoch_batches": epoch,
                 "num_workers": self.num_workers}
        if self.skip_policy is not None:
            state["skip"] = self.skip_policy.state_dict()
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool | None = None) -> None:
        """Continue from a saved position in O(1); no batch is replayed. Loading the same
        state twice is harmless.

        Raises:
            ValueError: the state belongs to another stream and resuming is strict.
        """
        strict = self.strict_resume if strict is None else bool(strict)
        plan = self.batch_sampler
        self._pos = plan.check_state(state_dict.get("sampler", state_dict), strict=strict)
        self._consumed = int(state_dict.get("consumed_batches", 0))
        self._epoch_base = int(state_dict.get("epoch_batches", 0))
        if plan.infinite or plan.normalize(*self._pos) != self._pos:
            self._epoch_base = 0  # the saved epoch had ended
        self._epoch_start, self._epoch_count = None, 0
        self._window, self._window_steps = [], None
        self._stream = self._stream_next = None  # blocks built ahead belong to the old position
        log.debug("StatefulRoIDataLoader: data stream resumes at pass %d, block %d", *self._pos)
        if self.skip_policy is not None and state_dict.get("skip") is not None:
            self.skip_policy.load_state_dict(state_dict["skip"], self._pos)

    def __repr__(self) -> str:
        return (f"StatefulRoIDataLoader(pass={self._pos[0]}, cursor={self._pos[1]}, "
                f"len={len(self)}, num_workers={self.num_workers})")


def train_repeat_factors(cfg: DetectronConfig, roidb: Any) -> Any:
    """The roidb's per-entry repeat factors when the config asks for Detectron2's
    ``RepeatFactorTrainingSampler``, else None (``TrainingSampler``)."""
    if not check_sampler_train(cfg):
        return None
    from lit_roidata.roidb.repeat_factors import repeat_factors_for_roidb

    return repeat_factors_for_roidb(roidb, cfg.DATALOADER.REPEAT_THRESHOLD,
                                    sqrt=bool(cfg.DATALOADER.REPEAT_SQRT))


def build_train_sampler(cfg: DetectronConfig, roidb: Any, *, seed: int | None = None,
                        rank: int = 0, world_size: int = 1, infinite: bool = False,
                        shuffle: bool = True, ims_per_batch: int | None = None,
                        bad_image_reserve: float = 0.0) -> RoIBatchSampler:
    """This rank's stream over ``roidb`` (a :class:`RoIBatchSampler`: the plan with a
    starting position).

    Args:
        cfg: ``TRAIN.IMS_PER_BATCH`` (per rank), ``TRAIN.ASPECT_GROUPING``, ``RNG_SEED``,
            ``DATALOADER.SAMPLER_TRAIN`` / ``REPEAT_THRESHOLD`` / ``REPEAT_SQRT`` (repeat
            factors, cached with the roidb).
        seed: the stream seed (default ``cfg.RNG_SEED``).
        shuffle: ``False`` gives Detectron's ``RoIDataLoaderSimple`` identity order.
        ims_per_batch: images per block (default ``TRAIN.IMS_PER_BATCH``).
        bad_image_reserve: fraction of each pass held back as replacements for bad
            images (``on_bad_image="skip"``; :func:`lit_roidata.plan.holdback_blocks`).
    """
    mb = int(cfg.TRAIN.IMS_PER_BATCH if ims_per_batch is None else ims_per_batch)
    return RoIBatchSampler(roidb.widths, roidb.heights, mb,
                           aspect_grouping=bool(cfg.TRAIN.ASPECT_GROUPING) and shuffle,
                           shuffle=shuffle, seed=int(cfg.RNG_SEED if seed is None else seed),
                           rank=rank, world_size=world_size, infinite=bool(infinite),
                           bad_image_reserve=float(bad_image_reserve),
                           repeat_factors=train_repeat_factors(cfg, roidb))


def build_train_dataset(cfg: DetectronConfig, roidb: Any, sampler: StreamPlan | None = None, *,
                        on_bad_image: str = "raise", output_format: str = "detectron",
                        pixel_format: str = "uint8", rng_mode: str = "block", augment: Any = None,
                        mask_format: str = "detectron", target_format: str = "detectron",
                        fix_rpn_quirks: bool = False) -> RoIBlockDataset:
    """The workers' :class:`~lit_roidata.dataset.RoIBlockDataset` over ``roidb``.

    Args:
        sampler: the rank's plan: invalid minibatches are replaced by its pure
            ``replacement_block``; with ``on_bad_image="skip"`` a block with an unreadable
            image is handed back to the train loader, which replaces only that image.
        on_bad_image, output_format, pixel_format, rng_mode, augment, mask_format,
            target_format, fix_rpn_quirks: :class:`~lit_roidata.dataset.RoIBlockDataset`'s.
    """
    return RoIBlockDataset(roidb, cfg, on_bad_image=on_bad_image, output_format=output_format,
                           pixel_format=pixel_format, rng_mode=rng_mode, augment=augment,
                           mask_format=mask_format, target_format=target_format,
                           fix_rpn_quirks=fix_rpn_quirks,
                           replacement=None if sampler is None else sampler.replacement_block,
                           hand_back_bad_images=sampler is not None and on_bad_image == "skip")


#: The dataset options of :func:`build_train_dataset` and their defaults (one source).
_DATASET_DEFAULTS = {name: p.default for name, p in
                     inspect.signature(build_train_dataset).parameters.items()
                     if p.kind is p.KEYWORD_ONLY and name != "on_bad_image"}


def build_train_loader(cfg: DetectronConfig, roidb: Any, *, dataset: Any = None,
                       sampler: StreamPlan | None = None, seed: int | None = None, rank: int = 0,
                       world_size: int = 1, infinite: bool = False, shuffle: bool = True,
                       ims_per_batch: int | None = None, on_bad_image: str = "raise",
                       bad_image_reserve: float = 0.01, num_workers: int = 0,
                       pin_memory: bool = False, persistent_workers: bool = False,
                       prefetch_factor: int | None = None, strict_resume: bool = True,
                       optimizer_steps: Callable[[], int] | None = None, shm_pool: bool = True,
                       worker_init_fn: Callable[[int], None] | None = None,
                       multiprocessing_context: Any = None, timeout: float = 0,
                       output_format: str = "detectron", pixel_format: str = "uint8",
                       rng_mode: str = "block", augment: Any = None, mask_format: str = "detectron",
                       target_format: str = "detectron", fix_rpn_quirks: bool = False,
                       epoch_length: int | None = None, read_ahead: int = 0
                       ) -> StatefulRoIDataLoader:
    """The checkpointable train loader of one rank, with or without Lightning.

    Example::

        loader = build_train_loader(cfg, combined_roidb_for_training(...), num_workers=4,
                                    rank=rank, world_size=world_size, infinite=True)

    Args:
        cfg: the Detectron config (``TRAIN.*``, ``RNG_SEED``).
        roidb: the training roidb (``widths``/``heights`` columns and entries).
        dataset: your own map-style dataset (default :func:`build_train_dataset`; the
            dataset options below then do not apply).
        sampler: your own plan/sampler (default :func:`build_train_sampler` with ``seed``,
            ``rank``, ``world_size``, ``infinite``, ``shuffle``, ``ims_per_batch`` and, with
            ``on_bad_image="skip"``, ``bad_image_reserve``).
        on_bad_image: ``"raise"`` or ``"skip"`` (only the bad image of a block is replaced,
            from a reserve of ``bad_image_reserve`` of each pass).
        num_workers, pin_memory, persistent_workers, prefetch_factor, worker_init_fn,
            multiprocessing_context, timeout, strict_resume, optimizer_steps, shm_pool,
            epoch_length, read_ahead: :class:`StatefulRoIDataLoader`'s.
        output_format, pixel_format, rng_mode, augment, mask_format, target_format,
            fix_rpn_quirks: the dataset's (:class:`~lit_roidata.dataset.RoIBlockDataset`).
    """
    if sampler is None:
        sampler = build_train_sampler(
            cfg, roidb, seed=seed, rank=rank, world_size=world_size, infinite=infinite,
            shuffle=shuffle, ims_per_batch=ims_per_batch,
            bad_image_reserve=bad_image_reserve if on_bad_image == "skip" else 0.0)
    options = dict(output_format=output_format, pixel_format=pixel_format, rng_mode=rng_mode,
                   augment=augment, mask_format=mask_format, target_format=target_format,
                   fix_rpn_quirks=fix_rpn_quirks)
    if dataset is None:
        dataset = build_train_dataset(cfg, roidb, sampler, on_bad_image=on_bad_image, **options)
    elif given := sorted(k for k, v in options.items() if v != _DATASET_DEFAULTS[k]):
        raise TypeError(f"build_train_loader: dataset options {given} given with your own "
                        "dataset; set them on the dataset")
    return StatefulRoIDataLoader(
        dataset, sampler, num_workers=num_workers, pin_memory=pin_memory,
        persistent_workers=persistent_workers and num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        strict_resume=strict_resume, optimizer_steps=optimizer_steps, shm_pool=shm_pool,
        worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
        timeout=timeout, epoch_length=epoch_length, read_ahead=read_ahead)


def fork_safe_opencv() -> None:
    """Stop OpenCV's thread pool in this process before DataLoader workers fork: a worker
    forked while it exists inherits its locks but not its threads and can wait forever.
    The main process then runs OpenCV single-threaded (free when workers decode)."""
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
                 persistent_workers: bool = False, prefetch_factor: int | None = None) -> None:
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
                      ims_per_batch: int = 1, pixel_format: str = "uint8",
                      with_rois: bool = False, num_workers: int = 0, pin_memory: bool = False,
                      persistent_workers: bool = False, prefetch_factor: int | None = None
                      ) -> EvalLoader:
    """This rank's :class:`EvalLoader` over an evaluation roidb (or ``[]`` for ``None``);
    ``with_rois``: the split has proposal files."""
    if roidb is None:
        return []  # type: ignore[return-value]
    return EvalLoader(roidb, cfg, rank=rank, world_size=world_size, ims_per_batch=ims_per_batch,
                      pixel_format=pixel_format, with_rois=with_rois, num_workers=num_workers,
                      pin_memory=pin_memory, persistent_workers=persistent_workers,
                      prefetch_factor=prefetch_factor)
