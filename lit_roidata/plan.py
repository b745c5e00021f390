"""The stream plan: which roidb entries every block of the training stream holds (pure).

Detectron's ``RoIDataLoader`` stream as a pure function of ``(seed, pass, block, world
size, rank)``: the pass permutations (aspect-grouped or plain, optional repeat factors),
global minibatches of ``world_size`` consecutive blocks (rank ``r`` takes block
``k * world_size + r``; a position counts global blocks, so it means the same blocks for any
world size) and the bad-image reserve held back at the end of every pass (docs/sampler.md).
The loader (:class:`~lit_roidata.loader.StatefulRoIDataLoader`) owns the position and asks
the plan what comes next; :class:`~lit_roidata.sampler.RoIBatchSampler` is the plan with a
cursor, for use without that loader.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = ["Block", "StreamPlan", "STATE_VERSION", "draw_replacement", "holdback_blocks",
           "MIN_RESERVE_IMAGES"]

log = logging.getLogger(__name__)

STATE_VERSION = 1
# Domain separators: the streams drawn for one seed never coincide.
PERM_DOMAIN = 0x7065726D  # "perm": pass permutations
REPLACE_DOMAIN = 0x7265706C  # "repl": substitutes for invalid blocks
REPEAT_DOMAIN = 0x72657066  # "repf": stochastic rounding of repeat factors
RESERVE_DOMAIN = 0x72737276  # "rsrv": reserve order of a pass
FALLBACK_DOMAIN = 0x66616c6c  # "fall": the draw when the reserve is exhausted
# State keys that must match for a saved position to mean the same blocks.
STREAM_KEYS = ("seed", "ims_per_batch", "num_images", "num_horizontal", "aspect_grouping",
               "shuffle", "holdback")
MIN_RESERVE_IMAGES = 16


def _generator(*words: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(w) for w in words])))


def check_int(owner: str, name: str, value: Any, low: int) -> int:
    """``value`` as an int ``>= low``, or a ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{owner}: {name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{owner}: {name} must be >= {low}, got {value}")
    return int(value)


class Block(list):
    """One partial minibatch: a ``list`` of roidb indices plus its place in the stream.

    The coordinates travel with the indices to the worker (the class pickles with its
    attributes), which seeds everything random from ``(seed, pass_index, block_index)``
    (docs/architecture.md, "Blocks and randomness").

    Attributes:
        seed, pass_index, block_index: the block's place in the global stream.
        attempt: 0 for a stream block; ``k >= 1`` for the k-th substitute of an invalid one.
        substitutes: the replacements the plan made in this block before it was read
            (dicts with ``slot``, ``bad_index``, ``index``, ``why``).
    """

    __slots__ = ("seed", "pass_index", "block_index", "attempt", "substitutes")

    def __init__(self, indices: Any, seed: int, pass_index: int, block_index: int,
                 attempt: int = 0, substitutes: tuple = ()) -> None:
        list.__init__(self, indices if type(indices) is list else [int(i) for i in indices])
        self.seed, self.pass_index, self.block_index = seed, pass_index, block_index
        self.attempt, self.substitutes = attempt, tuple(substitutes)

    def derive(self, indices: Any, attempt: int | None = None,
               substitutes: Iterable[Mapping[str, Any]] = ()) -> "Block":
        """A block at this block's place holding other ``indices`` (a replaced image, a
        substitute block); ``substitutes`` are added to this block's."""
        return Block(indices, self.seed, self.pass_index, self.block_index,
                     self.attempt if attempt is None else attempt,
                     self.substitutes + tuple(dict(s) for s in substitutes))

    @property
    def requested(self) -> list[int]:
        """The indices the stream gave before any replacement in this block."""
        out = list(self)
        for sub in reversed(self.substitutes):
            out[int(sub["slot"])] = int(sub["bad_index"])
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return (Block, (list(self), self.seed, self.pass_index, self.block_index,
                        self.attempt, self.substitutes))

    def __repr__(self) -> str:
        return (f"Block({list.__repr__(self)}, seed={self.seed}, pass_index={self.pass_index}, "
                f"block_index={self.block_index}, attempt={self.attempt})")


def draw_replacement(block: Block, attempt: int, pool: np.ndarray | int, size: int, *,
                     seed: int | None = None, domain: int | None = None) -> Block:
    """A deterministic substitute for an invalid block: ``size`` images without replacement
    from ``pool`` (roidb indices, or an int ``n`` for ``range(n)``), drawn from
    ``(domain, seed, pass_index, block_index, attempt)``; the block's coordinates kept.
    Every substitute block of the package is drawn here."""
    attempt = check_int("draw_replacement", "attempt", attempt, 1)
    rng = _generator(REPLACE_DOMAIN if domain is None else domain,
                     block.seed if seed is None else seed, block.pass_index,
                     block.block_index, attempt)
    if isinstance(pool, (int, np.integer)):
        pool = np.arange(pool)
    inds = pool[rng.choice(pool.size, size=size, replace=False)]
    return Block(inds.tolist(), block.seed, block.pass_index, block.block_index, attempt)


def holdback_blocks(natural_blocks: int, fraction: float, world_size: int = 1,
                    ims_per_batch: int = 1) -> int:
    """Blocks to hold back per pass for a reserve of ``fraction`` of a pass.

    At least :data:`MIN_RESERVE_IMAGES` images (an image and its flipped copy are two
    entries), at most a quarter of the pass and never so many that fewer than
    ``world_size`` blocks are left. 0 when ``fraction`` is 0 (every replacement a repeat).
    """
    if fraction < 0 or fraction >= 1:
        raise ValueError(f"bad_image_reserve={fraction}: use a fraction of a pass in [0, 1)")
    if fraction == 0:
        return 0
    want = max(int(np.ceil(fraction * natural_blocks)),
               -(-MIN_RESERVE_IMAGES // max(1, int(ims_per_batch))))
    want = min(want, max(1, natural_blocks // 4))
    return max(0, min(want, natural_blocks - max(1, world_size)))


def _block_indices(perm: np.ndarray, block_index: int, mb: int) -> list[int]:
    start = block_index * mb
    if start + mb <= perm.size:
        return perm[start:start + mb].tolist()
    # an ungrouped last block wraps onto the head of the same permutation (Detectron)
    return perm[(start + np.arange(mb)) % perm.size].tolist()


class StreamPlan:
    """The training stream of one rank as a pure function (module docstring).

    Args:
        widths, heights: per-entry image size (``roidb.widths``/``roidb.heights``);
            ``width >= height`` is horizontal.
        ims_per_batch: images per block, one rank's share (``TRAIN.IMS_PER_BATCH``).
        aspect_grouping: ``TRAIN.ASPECT_GROUPING``: single-orientation blocks, tails cut.
        shuffle: ``False`` gives Detectron's ``RoIDataLoaderSimple`` order (identity in
            blocks, wrapping to 0; grouping ignored).
        seed: stream seed, equal on every rank.
        rank, world_size: this process and how many share a global minibatch.
        infinite: the stream runs across pass ends (``max_steps`` training) instead of
            one pass per epoch (the last ``blocks % world_size`` blocks of a pass left out).
        holdback: blocks held back at the end of every pass as the bad-image reserve.
        bad_image_reserve: or the reserve as a fraction of a pass (:func:`holdback_blocks`).
        repeat_factors: per-entry repeat factors (>= 1) or None (every entry once).

    Raises:
        ValueError: sizes that give no block (Detectron quirk Q14, docs/detectron_quirks.md),
            a rank outside ``range(world_size)``, or (epoch mode) fewer blocks per pass than
            ranks.
    """

    _owner = "RoIBatchSampler"

    def __init__(self, widths: Any, heights: Any, ims_per_batch: int, *,
                 aspect_grouping: bool = True, shuffle: bool = True, seed: int = 3, rank: int = 0,
                 world_size: int = 1, infinite: bool = False, holdback: int = 0,
                 repeat_factors: Any = None, bad_image_reserve: float = 0.0) -> None:
        own = self._owner
        w, h = np.asarray(widths).reshape(-1), np.asarray(heights).reshape(-1)
        if w.shape != h.shape:
            raise ValueError(f"{own}: widths has {w.size} entries but heights has {h.size}; "
                             "pass roidb.widths and roidb.heights of one roidb")
        self.ims_per_batch = check_int(own, "ims_per_batch", ims_per_batch, 1)
        self.seed = check_int(own, "seed", seed, 0)
        self.world_size = check_int(own, "world_size", world_size, 1)
        self.rank = check_int(own, "rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"{own}: rank={rank} is outside range(world_size={world_size})")
        self.shuffle, self.infinite = bool(shuffle), bool(infinite)
        self.aspect_grouping = bool(aspect_grouping)
        self.grouped = self.aspect_grouping and self.shuffle
        #: Read-only ``width >= height`` per entry (a block's orientation when grouped).
        self.is_horizontal = horizontal = w >= h
        horizontal.setflags(write=False)
        self.num_images, self.num_horizontal = int(w.size), int(horizontal.sum())
        self.horizontal = np.flatnonzero(horizontal).astype(np.int64)
        self.vertical = np.flatnonzero(~horizontal).astype(np.int64)
        self.repeat_factors, self.repeat_digest = self._check_repeat_factors(repeat_factors)
        mb = self.ims_per_batch
        natural = self._natural(self.horizontal.size, self.vertical.size)
        #: Blocks of the whole permutation (every entry once); ``blocks_per_pass`` excludes
        #: the held-back ones (with repeat factors: their lower bound).
        self.natural_blocks_per_pass = natural
        self.holdback = check_int(own, "holdback", holdback, 0) or holdback_blocks(
            natural, float(bad_image_reserve), 1 if self.infinite else self.world_size, mb)
        if self.holdback and self.holdback >= natural:
            raise ValueError(f"{own}: holdback={holdback} blocks leaves no block of a pass of "
                             f"{natural}; lower the bad-image reserve")
        self.blocks_per_pass = natural - self.holdback
        if self.grouped and self.natural_blocks_per_pass == 0:
            raise ValueError(
                f"{own}: aspect grouping with IMS_PER_BATCH={mb} needs at least {mb} images of one "
                f"orientation, but the roidb has {self.horizontal.size} horizontal (w >= h) and "
                f"{self.vertical.size} vertical images; the permutation would be empty (Detectron "
                "fails with IndexError: Detectron quirk Q14, see docs/detectron_quirks.md). Add "
                "images, lower TRAIN.IMS_PER_BATCH or set TRAIN.ASPECT_GROUPING False")
        if not self.grouped and self.num_images < mb:
            raise ValueError(
                f"{own}: the roidb has {self.num_images} images, fewer than IMS_PER_BATCH={mb}; "
                "no block can be drawn (Detectron quirk Q14, see docs/detectron_quirks.md). "
                "Add images or lower TRAIN.IMS_PER_BATCH")
        if not self.infinite and self.blocks_per_pass < self.world_size:
            raise ValueError(
                f"{own}: a pass has {self.blocks_per_pass} blocks of {mb} images, fewer than "
                f"world_size={self.world_size}, so an epoch would have no global minibatch. "
                "Use infinite=True (max_steps training), fewer ranks or a smaller IMS_PER_BATCH")
        self._memo: dict[str, tuple[Any, Any]] = {}
        self._pass_blocks: dict[int, int] = {}  # repeat factors: pass -> blocks

    def _check_repeat_factors(self, repeat_factors: Any) -> tuple[np.ndarray | None, str | None]:
        if repeat_factors is None:
            return None, None
        r = np.array(repeat_factors, dtype=np.float32).reshape(-1)
        if r.size != self.num_images:
            raise ValueError(f"{self._owner}: repeat_factors has {r.size} entries but the roidb "
                             f"has {self.num_images}; pass one factor per roidb entry (flipped "
                             "entries included)")
        bad = np.flatnonzero(~(np.isfinite(r) & (r >= 1)))
        if bad.size:
            raise ValueError(f"{self._owner}: repeat factors must be finite and >= 1; entry "
                             f"{int(bad[0])} has {r[bad[0]]!r} ({bad.size} such entries)")
        r.setflags(write=False)
        return r, hashlib.sha256(r.tobytes()).hexdigest()[:16]

    def _memoised(self, key: str, arg: Any, compute: Any) -> Any:
        hit = self._memo.get(key)
        if hit is None or hit[0] != arg:
            hit = self._memo[key] = (arg, compute())
        return hit[1]

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__, _memo={}, _pass_blocks={})

    # ------------------------------------------------------------------ passes
    def repeat_counts(self, pass_index: int) -> np.ndarray | None:
        """How many times each entry appears in pass ``pass_index`` (``floor(r)`` plus
        once more with probability ``frac(r)``, from ``(seed, pass)``); None without
        repeat factors."""
        r = self.repeat_factors
        if r is None:
            return None
        p = check_int(self._owner, "pass_index", pass_index, 0)

        def draw() -> np.ndarray:
            whole = np.trunc(r).astype(np.int64)  # Detectron2's split, exact in float32
            frac = (r - np.trunc(r)).astype(np.float64)
            if not (frac > 0).any():
                return whole
            counts = whole + (_generator(REPEAT_DOMAIN, self.seed, p).random(r.size) < frac)
            counts.setflags(write=False)
            return counts
        return self._memoised("counts", p, draw)

    def natural_blocks(self, pass_index: int) -> int:
        """Blocks of the whole permutation of pass ``pass_index`` (holdback included)."""
        counts = self.repeat_counts(pass_index)
        if counts is None:
            return self.natural_blocks_per_pass
        return self._natural(int(counts[self.horizontal].sum()), int(counts[self.vertical].sum()))

    def _natural(self, h: int, v: int) -> int:
        """Blocks of a permutation of ``h`` horizontal and ``v`` vertical entries."""
        mb = self.ims_per_batch
        return h // mb + v // mb if self.grouped else -(-(h + v) // mb)

    def pass_blocks(self, pass_index: int) -> int:
        """Blocks pass ``pass_index`` delivers (``blocks_per_pass`` without repeat factors)."""
        if self.repeat_factors is None:
            return self.blocks_per_pass
        nb = self._pass_blocks.get(pass_index)
        if nb is None:
            if len(self._pass_blocks) > 4096:
                self._pass_blocks.clear()
            nb = self._pass_blocks[pass_index] = self.natural_blocks(pass_index) - self.holdback
        return nb

    def batches_in_pass(self, pass_index: int) -> int:
        """This rank's batches in pass ``pass_index`` (epoch mode; at least 1)."""
        return max(1, self.pass_blocks(pass_index) // self.world_size)

    def permutation(self, pass_index: int) -> np.ndarray:
        """The read-only order of pass ``pass_index``, a pure function of ``(seed, pass)``.

        Grouped: ``natural_blocks(p) * ims_per_batch`` entries whose aligned rows are
        single-orientation. Otherwise a permutation (identity without ``shuffle``).
        """
        p = check_int(self._owner, "pass_index", pass_index, 0)
        return self._memoised("perm", p, lambda: self._compute_permutation(p))

    def _compute_permutation(self, p: int) -> np.ndarray:
        counts = self.repeat_counts(p)
        every = np.arange(self.num_images, dtype=np.int64)
        horz, vert = self.horizontal, self.vertical
        if counts is not None:
            every, horz, vert = (np.repeat(every, counts), np.repeat(horz, counts[horz]),
                                 np.repeat(vert, counts[vert]))
        rng, mb = _generator(PERM_DOMAIN, self.seed, p), self.ims_per_batch
        if not self.shuffle:
            perm = every
        elif not self.grouped:
            perm = rng.permutation(every)
        else:
            # three draws, in Detectron's order: horizontal, vertical, then the rows
            horz, vert = rng.permutation(horz), rng.permutation(vert)
            rows = np.concatenate([horz[: horz.size // mb * mb],
                                   vert[: vert.size // mb * mb]]).reshape(-1, mb)
            perm = rows[rng.permutation(rows.shape[0])].reshape(-1)
        perm.setflags(write=False)  # int64 throughout
        return perm

    def block(self, pass_index: int, block_index: int) -> Block:
        """Block ``block_index`` of pass ``pass_index`` of the global stream."""
        nb = self.pass_blocks(pass_index)
        if not 0 <= block_index < nb:
            raise IndexError(f"block_index {block_index} outside pass {pass_index} of {nb} blocks")
        inds = _block_indices(self.permutation(pass_index), block_index, self.ims_per_batch)
        return Block(inds, self.seed, pass_index, block_index)

    # ------------------------------------------------------------------ positions
    def normalize(self, pass_index: int, cursor: int) -> tuple[int, int]:
        """Where the next draw starts from position ``(pass_index, cursor)``.

        Epoch mode: a pass with fewer than ``world_size`` blocks left is finished (the next
        draw is ``(pass + 1, 0)``). Infinite mode: a cursor past the pass end carries over.
        """
        p, c = int(pass_index), int(cursor)
        if not self.infinite:
            return (p + 1, 0) if c + self.world_size > self.pass_blocks(p) else (p, c)
        if self.repeat_factors is None:
            return p + c // self.blocks_per_pass, c % self.blocks_per_pass
        while c >= self.pass_blocks(p):
            c -= self.pass_blocks(p)
            p += 1
        return p, c

    def length_at(self, pass_index: int, cursor: int) -> int:
        """This rank's batches in the pass the next draw from ``(pass_index, cursor)``
        comes from (the loader's ``len()``)."""
        return self.batches_in_pass(self.normalize(pass_index, cursor)[0])

    def remaining_at(self, pass_index: int, cursor: int) -> int:
        """Epoch mode: this rank's batches left in the pass from ``(pass_index, cursor)``
        (a finished pass: the whole next one)."""
        p, c = self.normalize(pass_index, cursor)
        return max(1, (self.pass_blocks(p) - c) // self.world_size)

    def advance(self, pass_index: int, cursor: int, num_batches: int) -> tuple[int, int]:
        """The position after ``num_batches`` more global minibatches, without replay (O(1);
        with repeat factors O(passes crossed))."""
        n, ws, p, c = int(num_batches), self.world_size, int(pass_index), int(cursor)
        if self.infinite:
            return self.normalize(p, c + n * ws)
        left = (self.pass_blocks(p) - c) // ws
        if n <= left:
            return p, c + n * ws
        n -= left
        if self.repeat_factors is None:
            full, rem = divmod(n - 1, self.blocks_per_pass // ws)  # n >= 1 batches to go
            return p + full + 1, (rem + 1) * ws
        p += 1
        while n > self.pass_blocks(p) // ws:
            n -= self.pass_blocks(p) // ws
            p += 1
        return p, n * ws

    def next_block(self, pass_index: int, cursor: int, *, stop_at_pass_end: bool = False
                   ) -> tuple[Block | None, tuple[int, int]]:
        """This rank's next block from position ``(pass_index, cursor)`` and the position
        after it. Epoch mode with ``stop_at_pass_end``: ``(None, position)`` at a pass end."""
        p, c, ws = int(pass_index), int(cursor), self.world_size
        if self.infinite:
            (q, b), (p, c) = self.normalize(p, c + self.rank), self.normalize(p, c + ws)
        else:
            q, b = self.normalize(p, c)  # a finished pass: (p + 1, 0)
            if q != p and stop_at_pass_end:
                return None, (p, c)
            p, c, b = q, b + ws, b + self.rank
        perm = self.permutation(q)
        return Block(_block_indices(perm, b, self.ims_per_batch), self.seed, q, b), (p, c)

    # ------------------------------------------------------------------ state
    def state_at(self, pass_index: int, cursor: int) -> dict[str, Any]:
        """The state dict naming position ``(pass_index, cursor)`` of this stream."""
        state = {"version": STATE_VERSION, "seed": self.seed, "pass": int(pass_index),
                 "cursor": int(cursor), "ims_per_batch": self.ims_per_batch,
                 "world_size": self.world_size, "num_images": self.num_images,
                 "num_horizontal": self.num_horizontal, "aspect_grouping": self.grouped,
                 "shuffle": self.shuffle, "infinite": self.infinite, "holdback": self.holdback}
        if self.repeat_digest is not None:
            state["repeat_factors"] = self.repeat_digest
        return state

    def check_state(self, state: Mapping[str, Any], strict: bool = True) -> tuple[int, int]:
        """Validate a saved position against this stream; return the position to go on from.

        Another ``world_size`` is accepted (cursors count global blocks). Another seed, roidb
        size, orientation count, ``ims_per_batch``, grouping, shuffle, holdback or repeat
        factors name other blocks: ``strict`` raises ``ValueError``, otherwise a warning is
        logged and a fresh pass (``saved pass + 1``) begins.
        """
        state = {"holdback": 0, "repeat_factors": None, **state}
        missing = [k for k in ("pass", "cursor", *STREAM_KEYS) if k not in state]
        if missing:
            raise ValueError(f"{self._owner}: sampler state lacks {missing}; it was not "
                             "written by a lit_roidata train loader or sampler")
        mine = {"repeat_factors": None, **self.state_at(0, 0)}
        diffs = [f"{k}: checkpoint {state[k]!r}, now {mine[k]!r}"
                 for k in (*STREAM_KEYS, "repeat_factors") if state[k] != mine[k]]
        p, c = (check_int(self._owner, f"state[{k!r}]", state[k], 0) for k in ("pass", "cursor"))
        if not diffs and c > self.pass_blocks(p):
            diffs.append(f"cursor {c} beyond pass {p} of {self.pass_blocks(p)} blocks")
        if diffs:
            msg = (f"{self._owner}: the saved data-stream position does not match this "
                   "roidb/sampler (" + "; ".join(diffs) + ")")
            if strict:
                raise ValueError(msg + ". Restore the original dataset and TRAIN.IMS_PER_BATCH"
                                 "/seed, or load with strict=False (loader: strict_resume="
                                 "False) to start a fresh pass")
            log.warning("%s; starting a fresh pass %d", msg, p + 1)
            return p + 1, 0
        if state.get("world_size", self.world_size) != self.world_size:
            log.info("%s: resuming with world_size %d (checkpoint: %s); the global block stream "
                     "continues at pass %d, block %d", self._owner, self.world_size,
                     state.get("world_size"), p, c)
        return p, c

    # ------------------------------------------------------------------ replacements
    def replacement_block(self, block: Block, attempt: int) -> Block:
        """The ``attempt``-th substitute of an invalid block (Detectron drops it and takes
        the next one, which would shift one rank's stream under DDP): images of the
        block's orientation group (grouped) or of the whole roidb, drawn from ``(seed,
        pass, block, attempt)``."""
        if not block:
            raise ValueError("replacement_block: empty block")
        o = self.orientation(block[0])
        pool = self.num_images if o is None else self.horizontal if o else self.vertical
        return draw_replacement(block, attempt, pool, self.ims_per_batch, seed=self.seed)

    def orientation(self, index: int) -> bool | None:
        """The orientation group of entry ``index`` (None when blocks are not grouped)."""
        return bool(self.is_horizontal[int(index)]) if self.grouped else None

    def delivered_blocks(self, pass_index: int) -> int:
        """How many blocks of pass ``pass_index`` the stream delivers (all ranks)."""
        nb = self.pass_blocks(pass_index)
        return nb if self.infinite else nb // self.world_size * self.world_size

    def _delivered(self, p: int) -> np.ndarray:
        return self.permutation(p)[: self.delivered_blocks(p) * self.ims_per_batch]

    def reserve(self, pass_index: int) -> np.ndarray:
        """The entries pass ``pass_index`` does not deliver, in the pass's reserve order."""
        rest = np.setdiff1d(np.arange(self.num_images, dtype=np.int64),
                            self._delivered(pass_index))
        return rest[_generator(RESERVE_DOMAIN, self.seed, pass_index).permutation(rest.size)]

    def known_bad_plan(self, pass_index: int, bad: frozenset) -> tuple[dict, dict]:
        """How pass ``pass_index`` replaces the entries of ``bad`` before reading:
        ``({(block, slot): (index, why)}, {orientation: free reserve entries})``. The slots
        holding bad entries, in stream order, take the reserve's good entries in order."""
        return self._memoised("bad_plan", (pass_index, bad),
                              lambda: self._known_bad_plan(pass_index, bad))

    def _known_bad_plan(self, p: int, bad: frozenset) -> tuple[dict, dict]:
        mb, delivered = self.ims_per_batch, self._delivered(p)
        bad_arr = np.fromiter(bad, dtype=np.int64, count=len(bad))
        res = self.reserve(p)
        pools: dict[Any, list[int]] = {}
        for i in res[~np.isin(res, bad_arr)].tolist():
            pools.setdefault(self.orientation(i), []).append(i)
        plan: dict[tuple[int, int], tuple[int, str]] = {}
        for pos in np.flatnonzero(np.isin(delivered, bad_arr)).tolist():
            b, slot = divmod(pos, mb)
            idx = int(delivered[pos])
            pool = pools.get(self.orientation(idx))
            plan[(b, slot)] = ((pool.pop(0), "known_bad") if pool else
                               (self.fallback(p, b, slot, 0, idx, bad), "reserve_exhausted"))
        return plan, pools

    def fallback(self, pass_index: int, block_index: int, slot: int, attempt: int, index: int,
                 bad: Iterable[int], own_rank: bool = False) -> int:
        """A good entry the pass delivers anyway, for when the reserve is exhausted (a
        counted repeat): drawn from the blocks before ``block_index`` (with ``own_rank``
        only this rank's: all read already), else from the whole delivered pass."""
        mb, perm = self.ims_per_batch, self.permutation(pass_index)
        blocks = np.arange(min(int(block_index), self.delivered_blocks(pass_index)))
        if own_rank:
            blocks = blocks[blocks % self.world_size == self.rank]
        delivered = perm[(blocks[:, None] * mb + np.arange(mb)).reshape(-1)]
        if delivered.size == 0:
            delivered = self._delivered(pass_index)
        bad_arr = np.fromiter({int(i) for i in bad}, dtype=np.int64)
        o = self.orientation(index)
        if o is not None:
            delivered = delivered[self.is_horizontal[delivered] == o]
        cand = delivered[~np.isin(delivered, bad_arr)]
        if cand.size == 0:  # nothing good of this orientation: any good entry at all
            cand = np.setdiff1d(np.arange(self.num_images, dtype=np.int64), bad_arr)
        if cand.size == 0:
            raise RuntimeError(
                f"on_bad_image='skip': no good image is left to replace roidb entry {index} in "
                f"pass {pass_index}: every image is known to be bad. Fix or remove the bad "
                "images (the skip report lists them)")
        g = _generator(FALLBACK_DOMAIN, self.seed, pass_index, block_index, slot, attempt)
        return int(cand[int(g.integers(cand.size))])

    def final_block(self, block: Block, bad: frozenset) -> Block:
        """``block`` with its entries in ``bad`` replaced before anything is read (the
        replacements listed in ``Block.substitutes``); ``block`` itself when none is bad."""
        if not bad or not any(int(i) in bad for i in block):
            return block
        plan, _ = self.known_bad_plan(block.pass_index, bad)
        inds, subs = list(block), []
        for slot, i in enumerate(block):
            if int(i) in bad:
                # (a block outside the delivered pass is not expected: then a fallback)
                new, why = plan.get((block.block_index, slot)) or (self.fallback(
                    block.pass_index, block.block_index, slot, 0, int(i), bad), "reserve_exhausted")
                inds[slot] = int(new)
                subs.append({"slot": slot, "bad_index": int(i), "index": int(new), "why": why})
        return block.derive(inds, substitutes=subs)
