"""``RoIBatchSampler``: Detectron's locked cursor over the stream plan, for any DataLoader.

The blocks come from :class:`~lit_roidata.plan.StreamPlan`; this class adds a cursor
``(pass, cursor in global blocks)``, drawn under a lock and saved and restored in O(1).
lit_roidata's own train loader keeps the position itself and does not use this cursor.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from typing import Any, cast

from torch.utils.data import Sampler

from lit_roidata.plan import STATE_VERSION, Block, StreamPlan, check_int, draw_replacement

__all__ = ["Block", "RoIBatchSampler", "STATE_VERSION", "draw_replacement"]


class RoIBatchSampler(StreamPlan, Sampler[Block]):
    """Yield this rank's partial minibatches (:class:`Block`) in Detectron's order, resumably.

    Takes :class:`~lit_roidata.plan.StreamPlan`'s arguments. Epoch mode: one iteration is
    the rest of the current pass and ``set_epoch(e)`` selects pass ``e``; infinite mode: the
    iterator never stops. Draws are atomic under a lock: threads sharing one sampler get
    whole blocks, none lost or duplicated.
    """

    def __init__(self, widths: Any, heights: Any, ims_per_batch: int, **kwargs: Any) -> None:
        StreamPlan.__init__(self, widths, heights, ims_per_batch, **kwargs)
        self._lock = threading.Lock()
        self._pos = (0, 0)  # (pass, global blocks of it already drawn)

    def __len__(self) -> int:
        """Batches per pass for this rank (with repeat factors: of the pass the next draw
        comes from); equal on every rank, so DDP cannot hang."""
        return self.length_at(*self._pos)

    def _draw(self, stop_at_pass_end: bool) -> Block | None:
        with self._lock:
            blk, self._pos = self.next_block(*self._pos, stop_at_pass_end=stop_at_pass_end)
        return blk

    def draw(self) -> Block:
        """Take this rank's next block, atomically; a finished pass rolls over (never stops)."""
        return cast(Block, self._draw(False))  # never None: it does not stop at a pass end

    def __iter__(self) -> Iterator[Block]:
        """This rank's blocks from the current position: to the end of the pass (epoch mode)
        or forever (infinite mode)."""
        with self._lock:
            self._pos = self.normalize(*self._pos)
        while (blk := self._draw(True)) is not None:
            yield blk

    def set_epoch(self, epoch: int) -> None:
        """Epoch mode: start pass ``epoch`` unless it is the current one (a mid-epoch resume
        keeps its cursor). Infinite mode: no effect."""
        epoch = check_int(self._owner, "epoch", epoch, 0)
        if not self.infinite:
            with self._lock:
                if epoch != self._pos[0]:
                    self._pos = (epoch, 0)

    def state_dict(self) -> dict[str, Any]:
        """Seed, pass and cursor (in global blocks of the pass) plus what they depend on."""
        with self._lock:
            return self.state_at(*self._pos)

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Restore the position in O(1) (no replay); see :meth:`StreamPlan.check_state`."""
        pos = self.check_state(state, strict=strict)
        with self._lock:
            self._pos = pos

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in StreamPlan.__getstate__(self).items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
