"""Detectron's minibatch sampler: a locked cursor over per-pass permutations, split for DDP.

Detectron's ``RoIDataLoader`` keeps one permutation of the roidb (aspect-grouped or
plain), hands out ``IMS_PER_BATCH`` indices at a time under a lock, and draws a fresh
permutation when the cursor passes the end (Detectron semantics: sampler and aspect grouping). GPUs
take blocks from that
shared stream first-come (Detectron semantics: sampler and aspect grouping).
:class:`RoIBatchSampler` keeps the stream and makes it
deterministic and resumable (Detectron semantics: multi-gpu and weights, design principle 4):

* the permutation of pass ``p`` is a pure function of ``(seed, p)`` drawn from a private
  generator, so every rank computes the same stream without communication;
* a global minibatch is ``world_size`` consecutive blocks of the stream and rank ``r``
  takes block ``k * world_size + r``, so every rank yields the same number of batches;
* the state is ``(seed, pass, cursor)`` with the cursor counted in *global* blocks, so a
  resume is O(1) (no replay) and may change ``world_size`` without repeating or skipping
  a block;
* optional repeat factors (Detectron2's ``RepeatFactorTrainingSampler``, for LVIS): the
  multiset of entries of pass ``p`` (entry ``i`` ``floor(r_i)`` times, plus once more with
  probability ``frac(r_i)``) is also a pure function of ``(seed, p)``, so the pass length
  varies from pass to pass but every position stays recomputable in O(1) passes.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Sampler

__all__ = ["Block", "RoIBatchSampler", "STATE_VERSION", "draw_replacement"]

log = logging.getLogger(__name__)

STATE_VERSION = 1
# Domain separators so pass permutations and replacement draws never share a stream
# with each other or with lit_roidata.rng.block_rng for the same seed.
_PERM_DOMAIN = 0x7065726D  # "perm"
_REPLACE_DOMAIN = 0x7265706C  # "repl"
_REPEAT_DOMAIN = 0x72657066  # "repf": the stochastic rounding of repeat factors
# State keys that must match for a checkpointed position to mean the same blocks.
_STREAM_KEYS = ("seed", "ims_per_batch", "num_images", "num_horizontal",
                "aspect_grouping", "shuffle", "holdback")


def _block_indices(perm: np.ndarray, block_index: int, mb: int) -> list[int]:
    """The ``mb`` roidb indices of block ``block_index`` of the permutation ``perm``."""
    start = block_index * mb
    if start + mb <= perm.size:
        return perm[start:start + mb].tolist()
    # ungrouped last block wraps onto the head of the same permutation (Detectron semantics: sampler
    # and aspect grouping)
    return perm[(start + np.arange(mb)) % perm.size].tolist()


class Block(list):
    """One partial minibatch: a ``list`` of roidb indices plus its place in the stream.

    The coordinates travel with the indices through DataLoader index queues (the class
    is module-level and pickles with its attributes) so the worker can seed everything
    random from ``lit_roidata.rng.block_rng(seed, pass_index, block_index)``
    (docs/architecture.md, "Blocks and randomness").

    Attributes:
        seed: the sampler's stream seed.
        pass_index: the permutation (pass) the block comes from.
        block_index: position of the block in the global stream of its pass.
        attempt: 0 for a stream block; ``k >= 1`` for the k-th substitute made by
            :meth:`RoIBatchSampler.replacement_block`.
    """

    __slots__ = ("seed", "pass_index", "block_index", "attempt")

    def __init__(self, indices: Any, seed: int, pass_index: int, block_index: int,
                 attempt: int = 0) -> None:
        # The only constructor of blocks (the sampler's hot path calls it positionally,
        # once per batch). Callers inside the package pass lists of Python ints
        # (ndarray.tolist()); other iterables (NumPy arrays, tensors) are converted so
        # workers see plain ints.
        list.__init__(self, indices if type(indices) is list else [int(i) for i in indices])
        self.seed = seed
        self.pass_index = pass_index
        self.block_index = block_index
        self.attempt = attempt

    def derive(self, indices: Any, attempt: int | None = None) -> "Block":
        """A block at this block's place in the stream holding other ``indices`` (a
        replaced image, a substitute block); ``attempt`` defaults to this block's."""
        return Block(indices, self.seed, self.pass_index, self.block_index,
                     self.attempt if attempt is None else attempt)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Block, (list(self), self.seed, self.pass_index, self.block_index,
                        self.attempt))

    def __repr__(self) -> str:
        return (f"Block({list.__repr__(self)}, seed={self.seed}, pass_index={self.pass_index}, "
                f"block_index={self.block_index}, attempt={self.attempt})")


def draw_replacement(block: Block, attempt: int, pool: np.ndarray | int, size: int, *,
                     seed: int | None = None, domain: int | None = None) -> Block:
    """The replacement-block policy: a deterministic substitute for an invalid block.

    Every substitute block of the package is drawn here: ``size`` images without
    replacement from ``pool`` (roidb indices, or an int ``n`` for all of ``range(n)``) by
    a generator seeded from ``(domain, seed, pass_index, block_index, attempt)``. A pure
    function of its arguments, so any worker process draws the same block.
    :meth:`RoIBatchSampler.replacement_block` passes the block's orientation group
    (grouped sampler) or the whole roidb; :class:`~lit_roidata.dataset.RoIBlockDataset`
    without a sampler passes the orientation group with its own seed ``domain``.

    Args:
        block: the invalid block (its stream coordinates are kept).
        attempt: ``1, 2, ...`` for successive substitutes of the same block.
        pool: the candidate roidb indices, or their count.
        size: images in the substitute (at most the pool's size).
        seed: the stream seed (default: ``block.seed``).
        domain: seed domain separating this draw from the package's other streams
            (default: the sampler's).

    Returns:
        the substitute: ``block``'s stream coordinates, ``attempt``, the drawn indices.
    """
    attempt = _check_int("attempt", attempt, 1)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        [_REPLACE_DOMAIN if domain is None else domain, block.seed if seed is None else seed, block.pass_index, block.block_index,
         attempt])))
    n = pool if isinstance(pool, (int, np.integer)) else pool.size
    pick = rng.choice(n, size=size, replace=False)
    inds = pick if isinstance(pool, (int, np.integer)) else pool[pick]
    return Block(inds.tolist(), block.seed, block.pass_index, block.block_index, attempt)


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"RoIBatchSampler: {name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"RoIBatchSampler: {name} must be >= {low}, got {value}")
    return int(value)


class RoIBatchSampler(Sampler[Block]):
    """Yield this rank's partial minibatches (:class:`Block`) in Detectron's order, resumably.

    Grouping (Detectron semantics: sampler and aspect grouping), wrap-around (Detectron semantics:
    sampler and aspect grouping), the DDP split (Detectron semantics: multi-gpu and weights) and the
    resume cursor
    all act on blocks, so they live in one object: one state to save, one place to test.

    Two modes:

    * epoch mode (``infinite=False``): one iteration is one pass; ``len()`` is the number
      of *full* global minibatches in a pass, ``blocks_per_pass // world_size``, equal on
      every rank. The last ``blocks_per_pass % world_size`` blocks of a pass are left out
      so no rank waits for another. ``set_epoch(e)`` selects pass ``e``.
    * infinite mode (``infinite=True``, Detectron's stream for ``max_steps`` training): the
      iterator never stops; global minibatches run across pass boundaries exactly as
      Detectron's cursor does. ``len()`` is still ``max(1, blocks_per_pass // world_size)``
      so Lightning has an epoch length for progress and validation scheduling.

    Draws (:meth:`draw` and iteration) are atomic under a lock: threads sharing one
    sampler get whole blocks, none lost or duplicated (Detectron semantics: tested invariants).

    Args:
        widths, heights: per-entry image size (``roidb.widths``/``roidb.heights``);
            ``width >= height`` is horizontal (squares count as horizontal).
        ims_per_batch: images per block, i.e. one rank's share (``TRAIN.IMS_PER_BATCH``).
        aspect_grouping: ``TRAIN.ASPECT_GROUPING``: single-orientation blocks, tails cut.
        shuffle: ``False`` gives Detectron's ``RoIDataLoaderSimple`` order: identity
            permutation in blocks, wrapping to 0, grouping ignored (Detectron semantics:
            cross-process exchange).
        seed: stream seed; must be equal on every rank.
        rank, world_size: this process's index and how many share a global minibatch.
        infinite: stream mode (never stops) instead of epoch mode.
        holdback: blocks held back at the end of every pass (default 0: Detectron's
            stream). Their images are not delivered by the pass; with
            ``on_bad_image="skip"`` they are the reserve that replaces bad images
            (:class:`lit_roidata.skip.BadImageLedger`). The delivered blocks are the
            first ``blocks_per_pass`` blocks of Detectron's permutation, unchanged.
        repeat_factors: per-entry repeat factors (>= 1; e.g.
            :func:`lit_roidata.roidb.repeat_factors.repeat_factors_for_roidb`), or None
            (default: every entry once per pass, Detectron's stream bit for bit). Pass
            ``p`` then permutes a multiset: entry ``i`` appears ``floor(r_i)`` times plus
            once more with probability ``frac(r_i)`` (Detectron2's stochastic rounding),
            drawn from ``(seed, p)``. Grouping, wrap-around, the DDP split, holdback and
            resume act on that multiset; the number of blocks of pass ``p`` is
            :meth:`pass_blocks` ``(p)`` and :attr:`blocks_per_pass` is only its lower
            bound (every image once).

    Raises:
        ValueError: sizes that give no block at all (Detectron's ``IndexError``, Detectron quirk Q14
            (docs/detectron_quirks.md)), a
            rank outside ``range(world_size)``, or (epoch mode) fewer blocks per pass
            than ranks.
    """

    def __init__(self, widths: Any, heights: Any, ims_per_batch: int, *,
                 aspect_grouping: bool = True, shuffle: bool = True, seed: int = 3,
                 rank: int = 0, world_size: int = 1, infinite: bool = False,
                 holdback: int = 0, repeat_factors: Any = None) -> None:
        w = np.asarray(widths).reshape(-1)
        h = np.asarray(heights).reshape(-1)
        if w.shape != h.shape:
            raise ValueError(f"RoIBatchSampler: widths has {w.size} entries but heights has "
                             f"{h.size}; pass roidb.widths and roidb.heights of one roidb")
        self.ims_per_batch = _check_int("ims_per_batch", ims_per_batch, 1)
        self.seed = _check_int("seed", seed, 0)
        self.world_size = _check_int("world_size", world_size, 1)
        self.rank = _check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"RoIBatchSampler: rank={rank} is outside "
                             f"range(world_size={world_size})")
        self.shuffle = bool(shuffle)
        self.aspect_grouping = bool(aspect_grouping)
        self.infinite = bool(infinite)
        self.num_images = int(w.size)
        horizontal = w >= h
        self.num_horizontal = int(horizontal.sum())
        self._is_horz = horizontal.astype(bool)
        self._is_horz.setflags(write=False)
        # Orientation groups, used by the permutation and by replacement_block.
        self._horz = np.flatnonzero(horizontal).astype(np.int64)
        self._vert = np.flatnonzero(~horizontal).astype(np.int64)
        self._grouped = self.aspect_grouping and self.shuffle
        mb = self.ims_per_batch
        self._repeat: np.ndarray | None = None
        self.repeat_digest: str | None = None
        if repeat_factors is not None:
            self._set_repeat_factors(repeat_factors)
        if self._grouped:
            self.blocks_per_pass = self._horz.size // mb + self._vert.size // mb
        else:
            self.blocks_per_pass = math.ceil(self.num_images / mb)
        #: Blocks of the full permutation; ``blocks_per_pass`` excludes the held-back ones.
        self.natural_blocks_per_pass = self.blocks_per_pass
        self.holdback = _check_int("holdback", holdback, 0)
        if self.holdback and self.holdback >= self.blocks_per_pass:
            raise ValueError(f"RoIBatchSampler: holdback={holdback} blocks leaves no block of a "
                             f"pass of {self.blocks_per_pass}; lower the bad-image reserve")
        self.blocks_per_pass -= self.holdback
        self._check_sizes()
        self._lock = threading.Lock()
        self._cache: tuple[int, np.ndarray] | None = None
        self._nb_cache: dict[int, int] = {}  # pass -> natural blocks (repeat factors)
        self._counts_cache: tuple[int, np.ndarray] | None = None
        self._pass = 0
        self._cursor = 0  # global blocks of the current pass already drawn

    def _set_repeat_factors(self, repeat_factors: Any) -> None:
        r = np.asarray(repeat_factors, dtype=np.float32).reshape(-1)
        if r.size != self.num_images:
            raise ValueError(f"RoIBatchSampler: repeat_factors has {r.size} entries but the "
                             f"roidb has {self.num_images}; pass one factor per roidb entry "
                             "(flipped entries included)")
        bad = np.flatnonzero(~(np.isfinite(r) & (r >= 1)))
        if bad.size:
            raise ValueError(f"RoIBatchSampler: repeat factors must be finite and >= 1; entry "
                             f"{int(bad[0])} has {r[bad[0]]!r} ({bad.size} such entries)")
        r = r.copy()
        r.setflags(write=False)
        self._repeat = r
        # Detectron2's split (float32 trunc, and r - trunc(r), exact in float32).
        self._rep_int = np.trunc(r).astype(np.int64)
        self._rep_frac = (r - np.trunc(r)).astype(np.float64)
        self._rep_has_frac = bool((self._rep_frac > 0).any())
        self.repeat_digest = hashlib.sha256(r.tobytes()).hexdigest()[:16]

    def _check_sizes(self) -> None:
        mb = self.ims_per_batch
        if self._grouped and self.blocks_per_pass == 0:
            raise ValueError(
                f"RoIBatchSampler: aspect grouping with IMS_PER_BATCH={mb} needs at least {mb} "
                f"images of one orientation, but the roidb has {self._horz.size} horizontal "
                f"(w >= h) and {self._vert.size} vertical images; the permutation would be "
                "empty (Detectron fails with IndexError: Detectron quirk Q14, see "
                "docs/detectron_quirks.md). Add images, lower "
                "TRAIN.IMS_PER_BATCH or set TRAIN.ASPECT_GROUPING False")
        if not self._grouped and self.num_images < mb:
            raise ValueError(
                f"RoIBatchSampler: the roidb has {self.num_images} images, fewer than "
                f"IMS_PER_BATCH={mb}; no block can be drawn (Detectron quirk Q14, see "
                "docs/detectron_quirks.md). Add images or lower "
                "TRAIN.IMS_PER_BATCH")
        if not self.infinite and self.blocks_per_pass < self.world_size:
            raise ValueError(
                f"RoIBatchSampler: a pass has {self.blocks_per_pass} blocks of {mb} images, "
                f"fewer than world_size={self.world_size}, so an epoch would have no global "
                "minibatch. Use infinite=True (max_steps training), fewer ranks or a "
                "smaller IMS_PER_BATCH")

    @property
    def grouped(self) -> bool:
        """Whether blocks are single-orientation (``aspect_grouping`` and ``shuffle``)."""
        return self._grouped

    @property
    def is_horizontal(self) -> np.ndarray:
        """Read-only ``width >= height`` per roidb entry (a block's orientation when
        :attr:`grouped`)."""
        return self._is_horz

    # ------------------------------------------------------------------ permutations
    def permutation(self, pass_index: int) -> np.ndarray:
        """The order of pass ``pass_index`` (Detectron semantics: sampler and aspect grouping); a
        pure function of ``(seed, pass)``.

        Grouped: length ``blocks_per_pass * ims_per_batch``, aligned rows single-orientation.
        Otherwise a permutation of ``0..L-1`` (identity when ``shuffle=False``).
        The result is read-only and cached for the current pass.
        """
        cache = self._cache
        if cache is not None and cache[0] == pass_index:
            return cache[1]
        perm = self._compute_permutation(_check_int("pass_index", pass_index, 0))
        perm.setflags(write=False)
        self._cache = (pass_index, perm)
        return perm

    def repeat_counts(self, pass_index: int) -> np.ndarray | None:
        """How many times each entry appears in pass ``pass_index`` (repeat factors:
        ``floor(r) + Bernoulli(frac(r))``, drawn from ``(seed, pass)``); None without
        repeat factors (every entry once)."""
        if self._repeat is None:
            return None
        pass_index = _check_int("pass_index", pass_index, 0)
        if not self._rep_has_frac:
            return self._rep_int
        hit = self._counts_cache
        if hit is not None and hit[0] == pass_index:
            return hit[1]
        rng = np.random.Generator(np.random.PCG64(
            np.random.SeedSequence([_REPEAT_DOMAIN, self.seed, pass_index])))
        counts = self._rep_int + (rng.random(self.num_images) < self._rep_frac)
        counts.setflags(write=False)
        self._counts_cache = (pass_index, counts)  # the pass start needs it twice
        return counts

    def natural_blocks(self, pass_index: int) -> int:
        """Blocks of the whole permutation of pass ``pass_index`` (holdback included)."""
        if self._repeat is None:
            return self.natural_blocks_per_pass
        nb = self._nb_cache.get(pass_index)
        if nb is None:
            counts = self.repeat_counts(pass_index)
            nb = self._blocks_for(counts)
            if len(self._nb_cache) > 4096:
                self._nb_cache.clear()
            self._nb_cache[pass_index] = nb
        return nb

    def _blocks_for(self, counts: np.ndarray) -> int:
        mb = self.ims_per_batch
        if self._grouped:
            return int(counts[self._horz].sum()) // mb + int(counts[self._vert].sum()) // mb
        return -(-int(counts.sum()) // mb)

    def pass_blocks(self, pass_index: int) -> int:
        """Blocks pass ``pass_index`` delivers (``blocks_per_pass`` without repeat
        factors; with them it varies by pass)."""
        if self._repeat is None:
            return self.blocks_per_pass
        return self.natural_blocks(pass_index) - self.holdback

    def batches_in_pass(self, pass_index: int) -> int:
        """This rank's batches in pass ``pass_index`` (epoch mode; at least 1)."""
        return max(1, self.pass_blocks(pass_index) // self.world_size)

    def _compute_permutation(self, pass_index: int) -> np.ndarray:
        counts = self.repeat_counts(pass_index)
        if counts is not None:
            return self._compute_repeat_permutation(pass_index, counts)
        if not self.shuffle:
            return np.arange(self.num_images, dtype=np.int64)
        rng = np.random.Generator(np.random.PCG64(
            np.random.SeedSequence([_PERM_DOMAIN, self.seed, pass_index])))
        if not self._grouped:
            return rng.permutation(self.num_images).astype(np.int64)
        mb = self.ims_per_batch
        horz = rng.permutation(self._horz)  # three draws, in Detectron's order
        vert = rng.permutation(self._vert)
        horz = horz[: horz.size // mb * mb]
        vert = vert[: vert.size // mb * mb]
        rows = np.concatenate([horz, vert]).reshape(-1, mb)
        return rows[rng.permutation(rows.shape[0])].reshape(-1)

    def _compute_repeat_permutation(self, pass_index: int, counts: np.ndarray) -> np.ndarray:
        # The same three steps over the pass's multiset instead of the set of entries.
        if not self.shuffle:
            return np.repeat(np.arange(self.num_images, dtype=np.int64), counts)
        rng = np.random.Generator(np.random.PCG64(
            np.random.SeedSequence([_PERM_DOMAIN, self.seed, pass_index])))
        if not self._grouped:
            return rng.permutation(np.repeat(np.arange(self.num_images, dtype=np.int64),
                                             counts))
        mb = self.ims_per_batch
        horz = rng.permutation(np.repeat(self._horz, counts[self._horz]))
        vert = rng.permutation(np.repeat(self._vert, counts[self._vert]))
        horz = horz[: horz.size // mb * mb]
        vert = vert[: vert.size // mb * mb]
        rows = np.concatenate([horz, vert]).reshape(-1, mb)
        return rows[rng.permutation(rows.shape[0])].reshape(-1)

    def block(self, pass_index: int, block_index: int) -> Block:
        """Block ``block_index`` of pass ``pass_index`` of the global stream (pure)."""
        nb = self.pass_blocks(pass_index)
        if not 0 <= block_index < nb:
            raise IndexError(f"block_index {block_index} outside pass {pass_index} of "
                             f"{nb} blocks")
        inds = _block_indices(self.permutation(pass_index), block_index, self.ims_per_batch)
        return Block(inds, self.seed, pass_index, block_index)

    # ------------------------------------------------------------------ positions
    def __len__(self) -> int:
        """Batches per pass for this rank; equal on every rank, so DDP cannot hang. With
        repeat factors: the batches of the pass the next draw comes from."""
        if self._repeat is None:
            return max(1, self.blocks_per_pass // self.world_size)
        return self.length_at(self._pass, self._cursor)

    def length_at(self, pass_index: int, cursor: int) -> int:
        """``len()`` for a stream at position ``(pass_index, cursor)``: this rank's
        batches of the pass the next draw comes from."""
        return self.batches_in_pass(self.normalize(pass_index, cursor)[0])

    def normalize(self, pass_index: int, cursor: int) -> tuple[int, int]:
        """Where the next draw starts from position ``(pass_index, cursor)`` (pure).

        Epoch mode: a pass with fewer than ``world_size`` blocks left is finished, so the
        next draw starts at ``(pass + 1, 0)``. Infinite mode: a cursor at or past the end of
        the pass carries into the next passes.
        """
        if self._repeat is not None:
            if self.infinite:
                nb = self.pass_blocks(pass_index)
                while cursor >= nb:
                    cursor -= nb
                    pass_index += 1
                    nb = self.pass_blocks(pass_index)
                return pass_index, cursor
            if cursor + self.world_size > self.pass_blocks(pass_index):
                return pass_index + 1, 0
            return pass_index, cursor
        if self.infinite:
            extra, cursor = divmod(cursor, self.blocks_per_pass)
            return pass_index + extra, cursor
        if cursor + self.world_size > self.blocks_per_pass:
            return pass_index + 1, 0
        return pass_index, cursor

    def advance(self, pass_index: int, cursor: int, num_batches: int) -> tuple[int, int]:
        """The position after ``num_batches`` more global minibatches (pure; O(1), with
        repeat factors O(passes crossed)).

        Used by the stateful loader to count consumed batches, and to resume at any step
        without replaying the stream.
        """
        n, ws = int(num_batches), self.world_size
        if self.infinite:
            return self.normalize(pass_index, cursor + n * ws)
        if self._repeat is not None:
            # Pass lengths vary: walk the passes (O(1) per pass crossed, each pass's
            # length from its (seed, pass) draw).
            left = (self.pass_blocks(pass_index) - cursor) // ws
            if n <= left:
                return pass_index, cursor + n * ws
            n -= left
            q = pass_index + 1
            per = self.pass_blocks(q) // ws
            while n > per:
                n -= per
                q += 1
                per = self.pass_blocks(q) // ws
            return q, n * ws
        left = (self.blocks_per_pass - cursor) // ws  # minibatches left in this pass
        if n <= left:
            return pass_index, cursor + n * ws
        per_pass = self.blocks_per_pass // ws
        full, rem = divmod(n - left, per_pass)
        if rem == 0:
            return pass_index + full, per_pass * ws
        return pass_index + full + 1, rem * ws

    def _draw_locked(self, stop_at_pass_end: bool) -> Block | None:
        # The per-batch hot path (caller holds the lock): normalize() and the permutation
        # cache lookup inlined.
        if self._repeat is not None:
            return self._draw_repeat_locked(stop_at_pass_end)
        ws, nb, mb = self.world_size, self.blocks_per_pass, self.ims_per_batch
        p, c = self._pass, self._cursor
        if not self.infinite and c + ws > nb:
            if stop_at_pass_end:
                return None
            p, c = p + 1, 0
        q, b = p, c + self.rank
        if b >= nb:  # infinite mode: this rank's block lies in a later pass
            extra, b = divmod(b, nb)
            q += extra
        cache = self._cache
        perm = cache[1] if cache is not None and cache[0] == q else self.permutation(q)
        inds = _block_indices(perm, b, mb)
        c += ws
        if self.infinite and c >= nb:
            extra, c = divmod(c, nb)
            p += extra
        self._pass, self._cursor = p, c
        return Block(inds, self.seed, q, b)

    def _draw_repeat_locked(self, stop_at_pass_end: bool) -> Block | None:
        # _draw_locked with a pass length that depends on the pass.
        ws, mb = self.world_size, self.ims_per_batch
        p, c = self._pass, self._cursor
        if not self.infinite:
            if c + ws > self.pass_blocks(p):
                if stop_at_pass_end:
                    return None
                p, c = p + 1, 0
            q, b = p, c + self.rank
            c += ws
        else:
            nb = self.pass_blocks(p)
            if c >= nb:
                p, c = self.normalize(p, c)
                nb = self.pass_blocks(p)
            q, b = p, c + self.rank
            if b >= nb:  # this rank's block lies in a later pass
                q, b = self.normalize(p, b)
            c += ws
            if c >= nb:
                p, c = self.normalize(p, c)
        cache = self._cache
        perm = cache[1] if cache is not None and cache[0] == q else self.permutation(q)
        inds = _block_indices(perm, b, mb)
        self._pass, self._cursor = p, c
        return Block(inds, self.seed, q, b)

    def draw(self) -> Block:
        """Take this rank's next block, atomically (Detectron's locked cursor, Detectron semantics:
        sampler and aspect grouping).

        Never stops: in epoch mode a finished pass rolls over to the next permutation.
        """
        with self._lock:
            blk = self._draw_locked(stop_at_pass_end=False)
        assert blk is not None
        return blk

    def __iter__(self) -> Iterator[Block]:
        """This rank's blocks from the current position: to the end of the pass (epoch
        mode) or forever (infinite mode)."""
        with self._lock:
            self._pass, self._cursor = self.normalize(self._pass, self._cursor)
        while True:
            with self._lock:
                blk = self._draw_locked(stop_at_pass_end=True)
            if blk is None:
                return
            yield blk

    def set_epoch(self, epoch: int) -> None:
        """Epoch mode: start pass ``epoch`` unless it is already the current pass (so a
        mid-epoch resume keeps its cursor). Infinite mode: no effect (the stream does not
        follow epochs)."""
        epoch = _check_int("epoch", epoch, 0)
        if self.infinite:
            return
        with self._lock:
            if epoch != self._pass:
                self._pass, self._cursor = epoch, 0

    # ------------------------------------------------------------------ state
    def state_at(self, pass_index: int, cursor: int) -> dict[str, Any]:
        """The state dict describing position ``(pass_index, cursor)`` of this stream
        (with repeat factors, ``repeat_factors`` holds a digest of them)."""
        state = {"version": STATE_VERSION, "seed": self.seed, "pass": int(pass_index),
                 "cursor": int(cursor), "ims_per_batch": self.ims_per_batch,
                 "world_size": self.world_size, "num_images": self.num_images,
                 "num_horizontal": self.num_horizontal,
                 "aspect_grouping": self._grouped, "shuffle": self.shuffle,
                 "infinite": self.infinite, "holdback": self.holdback}
        if self.repeat_digest is not None:
            state["repeat_factors"] = self.repeat_digest
        return state

    def state_dict(self) -> dict[str, Any]:
        """Seed, pass and cursor (in global blocks of the pass) plus what they depend on."""
        with self._lock:
            return self.state_at(self._pass, self._cursor)

    def check_state(self, state: Mapping[str, Any], strict: bool = True) -> tuple[int, int]:
        """Validate ``state`` against this stream; return the position to continue from.

        A different ``world_size`` is accepted (the cursor counts global blocks). A
        different seed, roidb size, orientation count, ``ims_per_batch``, grouping or
        shuffle means the saved position names other blocks: ``strict`` raises, otherwise a
        warning is logged and a fresh pass (``saved pass + 1``, cursor 0) begins.

        Raises:
            ValueError: a mismatch with ``strict=True``, or a malformed state.
        """
        # States written before holdback / repeat factors existed.
        state = {"holdback": 0, "repeat_factors": None, **state}
        missing = [k for k in ("pass", "cursor", *_STREAM_KEYS) if k not in state]
        if missing:
            raise ValueError(f"RoIBatchSampler: sampler state lacks {missing}; it was not "
                             "written by RoIBatchSampler.state_dict()")
        mine = {"repeat_factors": None, **self.state_at(0, 0)}
        diffs = [f"{k}: checkpoint {state[k]!r}, now {mine[k]!r}"
                 for k in (*_STREAM_KEYS, "repeat_factors") if state[k] != mine[k]]
        p = _check_int("state['pass']", state["pass"], 0)
        c = _check_int("state['cursor']", state["cursor"], 0)
        if not diffs and c > self.pass_blocks(p):
            diffs.append(f"cursor {c} beyond pass {p} of {self.pass_blocks(p)} blocks")
        if diffs:
            msg = ("RoIBatchSampler: the saved data-stream position does not match this "
                   "roidb/sampler (" + "; ".join(diffs) + ")")
            if strict:
                raise ValueError(msg + ". Restore the original dataset and TRAIN.IMS_PER_BATCH"
                                 "/seed, or load with strict=False (loader: "
                                 "strict_resume=False) to start a fresh pass")
            log.warning("%s; starting a fresh pass %d", msg, p + 1)
            return p + 1, 0
        if state.get("world_size", self.world_size) != self.world_size:
            log.info("RoIBatchSampler: resuming with world_size %d (checkpoint: %s); the "
                     "global block stream continues at pass %d, block %d",
                     self.world_size, state.get("world_size"), p, c)
        return p, c

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore the position in O(1) (no replay); see :meth:`check_state`."""
        p, c = self.check_state(state, strict=strict)
        with self._lock:
            self._pass, self._cursor = p, c

    # ------------------------------------------------------------------ invalid blocks
    def replacement_block(self, block: Block, attempt: int) -> Block:
        """A deterministic substitute for an invalid block (Detectron semantics: sampler and aspect
        grouping; tested invariants).

        Detectron drops an invalid minibatch and takes the next one from the shared
        stream; under DDP that would shift one rank's stream against the others. Instead
        the worker that finds block ``b`` invalid asks for ``replacement_block(b, 1)``,
        then ``(b, 2)``, ... until one is valid: the invalid block's slot is consumed, every
        rank still yields one batch per step, and no other block moves. The substitute's
        ``ims_per_batch`` images are drawn without replacement from ``b``'s orientation
        group (grouped sampler) or from the whole roidb, by a generator seeded from
        ``(seed, pass_index, block_index, attempt)``: a pure function, safe to call in any
        worker process. The caller bounds ``attempt`` (a cap with a clear error).
        """
        if not block:
            raise ValueError("RoIBatchSampler.replacement_block: empty block")
        pool: np.ndarray | int = self.num_images
        if self._grouped:
            pool = self._horz if self._is_horz[int(block[0])] else self._vert
        return draw_replacement(block, attempt, pool, self.ims_per_batch, seed=self.seed)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        state["_cache"] = None
        state["_counts_cache"] = None
        state.pop("_rep_int", None)  # derived from _repeat (workers get a copy)
        state.pop("_rep_frac", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        if self.__dict__.get("_repeat") is not None:
            r = self._repeat
            self._rep_int = np.trunc(r).astype(np.int64)
            self._rep_frac = (r - np.trunc(r)).astype(np.float64)

