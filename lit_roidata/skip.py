"""The bad-image skip policy (``on_bad_image="skip"``): replace only the bad image.

The bad image's slot is refilled from the pass's *reserve* (what the pass does not deliver),
with an image of the block's orientation not known to be bad: before reading for the frozen
set (:meth:`lit_roidata.plan.StreamPlan.final_block`), in stream order for a newly found one
(:meth:`BadImageLedger.substitute`). The guarantees and the reasons: docs/minibatch.md, "Bad
images".
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np

from lit_roidata.plan import MIN_RESERVE_IMAGES, Block, StreamPlan, holdback_blocks

__all__ = ["BadImageLedger", "SkipPolicy", "holdback_blocks", "merge_skip_reports",
           "summarize", "LEDGER_VERSION", "MIN_RESERVE_IMAGES"]

log = logging.getLogger(__name__)

LEDGER_VERSION = 1
#: What the report counts, by the ``why`` of a replacement made before reading.
PLANNED_REPLACEMENTS = ("known_bad", "reserve_exhausted")


def _file_keys(roidb: Any) -> Any:
    """One key per roidb entry naming its file (originals and flips share it), or None."""
    rows = getattr(roidb, "entry_image_rows", None)
    if rows is not None:
        return np.asarray(rows)
    if isinstance(roidb, Sequence) and len(roidb) and hasattr(roidb[0], "get"):
        return np.asarray([str(e.get("image")) for e in roidb])
    return None


class BadImageLedger:
    """The run's bad images and this rank's use of each pass's reserve (module doc).

    State only: which reserve image replaces which slot is the plan's
    (:meth:`~lit_roidata.plan.StreamPlan.final_block` for the frozen set of a pass,
    :meth:`substitute` for a newly found one). Owned by the train loader, in its process;
    its state is part of the loader's.

    Args:
        plan: this rank's :class:`~lit_roidata.plan.StreamPlan` (its ``holdback`` sets the
            reserve); a :class:`~lit_roidata.sampler.RoIBatchSampler` is one.
        roidb: the training roidb (an original and its flipped copy, one file, are one bad
            image).
    """

    def __init__(self, plan: StreamPlan, roidb: Any = None) -> None:
        self.plan = plan
        self._files = _file_keys(roidb) if roidb is not None else None
        self.known: dict[int, dict] = {}  # roidb index -> record (what was wrong)
        #: ``[(from_pass, frozenset)]``: the known set each pass uses (sorted by pass).
        self.frozen: list[tuple[int, frozenset]] = [(0, frozenset())]
        self.used: dict[tuple[int, Any], int] = {}  # (pass, orientation) -> share used
        #: A pass whose share this rank takes from the end: set after restoring a state
        #: saved by another rank mid-pass (that rank took from the front).
        self.reverse_pass: int | None = None
        self.restored_foreign = False

    def frozen_for(self, pass_index: int) -> frozenset:
        """The known-bad set replaced before reading in pass ``pass_index``."""
        return next((s for start, s in reversed(self.frozen) if start <= pass_index), frozenset())

    def mark_bad(self, index: int, record: Mapping[str, Any]) -> bool:
        """Remember ``index`` (and its flipped twin: same file) as bad; ``True`` if new."""
        new = int(index) not in self.known
        twins = ([int(index)] if self._files is None
                 else np.flatnonzero(self._files == self._files[int(index)]).tolist())
        for j in twins:
            self.known.setdefault(int(j), dict(record, index=int(index)))
        return new

    def freeze(self, from_pass: int) -> None:
        """Make every known bad image part of the frozen set from pass ``from_pass`` on
        (the same call on every rank: after an exchange)."""
        older = [(p, f) for p, f in self.frozen if p < from_pass][-1:]  # the stream never
        self.frozen = older + [(int(from_pass), frozenset(self.known))]  # goes back

    def apply_plan(self, block: Block) -> tuple[Block, list[dict]]:
        """``block`` with its frozen known-bad images replaced before reading, and one dict
        per replaced slot."""
        out = self.plan.final_block(block, self.frozen_for(block.pass_index))
        return out, [dict(s) for s in out.substitutes[len(block.substitutes):]]

    def substitute(self, block: Block, slot: int, attempt: int = 0) -> tuple[Block, dict]:
        """Replace ``block[slot]`` (found bad, already :meth:`mark_bad`) by this rank's next
        reserve image (main process, stream order); returns the new block and a dict
        describing the replacement."""
        plan = self.plan
        p, bad_index = int(block.pass_index), int(block[slot])
        o = plan.orientation(bad_index)
        _, pools = plan.known_bad_plan(p, self.frozen_for(p))
        share = pools.get(o, [])[plan.rank::plan.world_size]
        if p == self.reverse_pass:
            share = share[::-1]
        key, new, why = (p, o), None, "new_bad"
        while new is None and (n := self.used.get(key, 0)) < len(share):
            self.used[key] = n + 1  # a share entry found bad meanwhile is passed over
            new = None if share[n] in self.known else share[n]
        if new is None:
            new = plan.fallback(p, block.block_index, slot, attempt + 1, bad_index,
                                self.frozen_for(p) | frozenset(self.known), own_rank=True)
            why = "reserve_exhausted"
        sub = {"slot": int(slot), "bad_index": bad_index, "index": int(new), "why": why}
        return block.derive([*block[:slot], int(new), *block[slot + 1:]], substitutes=[sub]), sub

    def state_dict(self) -> dict[str, Any]:
        """Known bad images (with what was wrong), frozen snapshots, this rank's use of the
        reserve."""
        return {"version": LEDGER_VERSION,
                "known": {str(k): dict(v) for k, v in sorted(self.known.items())},
                "frozen": [[int(p), sorted(int(i) for i in s)] for p, s in self.frozen],
                "used": [[int(p), o, int(n)] for (p, o), n in sorted(
                    self.used.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))],
                "rank": int(self.plan.rank), "world_size": int(self.plan.world_size)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. The reserve use is restored only for the rank and
        world size that saved it (Lightning saves rank 0's state)."""
        self.known = {int(k): dict(v) for k, v in dict(state.get("known", {})).items()}
        self.frozen = [(int(p), frozenset(int(i) for i in s))
                       for p, s in state.get("frozen", [[0, []]])] or [(0, frozenset())]
        same = (int(state.get("rank", -1)) == self.plan.rank
                and int(state.get("world_size", -1)) == self.plan.world_size)
        self.used = {(int(p), o): int(n) for p, o, n in state.get("used", [])} if same else {}
        self.restored_foreign = not same

    def resumed_at(self, pass_index: int, cursor: int) -> None:
        """Where a resumed stream starts: with a state from another rank (or world size) and
        a mid-pass resume, this rank takes its share of that pass's reserve from the end, so
        it repeats no replacement delivered before the interruption."""
        if self.restored_foreign and cursor > 0:
            self.reverse_pass = int(pass_index)
        self.restored_foreign = False


def merge_skip_reports(parts: Sequence[Mapping[str, Any]]
                       ) -> tuple[Counter, dict[str, dict[str, Any]]]:
    """Merge the ranks' skip reports (``{"counts": ..., "files": [record, ...]}`` each).

    Returns:
        ``(counts, files)``: the counts by kind, one count per file (a file two ranks
        found in the same epoch counts once by its reason, each further find as
        ``read_again``), and one record per file path (records without a path are kept
        apart).
    """
    counts: Counter[str] = Counter()
    files: dict[str, dict[str, Any]] = {}
    for part in parts:
        counts.update(part["counts"])
        for rec in part["files"]:
            key = rec.get("path")
            files.setdefault(str(key) if key is not None else f"<no path {len(files)}>", rec)
    found = Counter(str(r.get("reason")) for part in parts for r in part["files"])
    counts.subtract(found)
    counts.update(Counter(str(r.get("reason")) for r in files.values()))
    counts["read_again"] += sum(found.values()) - len(files)
    return Counter({k: v for k, v in counts.items() if v > 0}), files


def summarize(records: Sequence[Mapping[str, Any]], counts: Mapping[str, int],
              title: str = "data: skip report") -> str:
    """A readable multi-line skip report: the counts by kind, then one line per file."""
    lines = [f"{title}: {dict(sorted(Counter(counts).items()))}"]
    if records:
        lines.append(f"bad images found ({len(records)}):")
        lines += [f"  {r.get('path')} (image id {r.get('image_id')}, dataset "
                  f"{r.get('dataset')}, roidb index {r.get('index')}): {r.get('reason')}: "
                  f"{r.get('message')}" for r in records]
    return "\n".join(lines)


def _report(counts: Mapping[str, int], files: Mapping[str, Any], log_it: bool, title: str
            ) -> dict[str, Any]:
    report = {"counts": dict(sorted(counts.items())), "files": list(files.values())}
    if log_it and report["counts"]:
        log.warning("%s", summarize(report["files"], report["counts"], title))
    return report


class SkipPolicy:
    """``on_bad_image="skip"``'s bookkeeping for one train loader: the ledger, the counts
    and the reports.

    :class:`~lit_roidata.loader.StatefulRoIDataLoader` owns it (``loader.skip_policy``),
    replaces bad images through :attr:`ledger` and passes every batch through :meth:`count`
    in stream order. :meth:`exchange` is its only collective:
    :class:`lit_roidata.callbacks.BadImageReport` runs it at every epoch end, on every rank.
    Its state is part of the loader's state.
    """

    def __init__(self, ledger: BadImageLedger) -> None:
        self.ledger = ledger
        self.pending: Counter[str] = Counter()  # skips since the last exchange, by kind
        self.records: list[dict[str, Any]] = []  # bad files found since then
        self.run_counts: Counter[str] = Counter()
        self.run_files: dict[str, dict[str, Any]] = {}
        #: ``{"counts": ..., "files": [...]}`` of the last :meth:`exchange` (all ranks).
        self.last_report: dict[str, Any] = {"counts": {}, "files": []}

    def count(self, meta: Mapping[str, Any]) -> None:
        """Count the skips and replacements of one delivered batch (its ``_meta``)."""
        for item in meta.get("skipped") or ():
            if item.get("again"):  # a file already reported (an original and its flip)
                self.pending["read_again"] += 1
                continue
            self.pending[str(item.get("reason", "bad_image"))] += 1
            rec = {k: item.get(k) for k in ("reason", "path", "image_id", "dataset",
                                              "message", "index")}
            rec.update(pass_index=meta.get("pass_index"), block_index=meta.get("block_index"))
            self.records.append(rec)
            if rec["index"] is not None:
                self.ledger.mark_bad(int(rec["index"]), rec)
        self.pending.update(str(s["why"]) for s in meta.get("substitutes") or ()
                            if s.get("why") in PLANNED_REPLACEMENTS)
        if meta.get("num_invalid_replaced"):
            self.pending["invalid_minibatch"] += int(meta["num_invalid_replaced"])

    def exchange(self, position: tuple[int, int]) -> dict[str, Any]:
        """Merge the bad images every rank found since the last exchange and report them.

        A collective under DDP (one ``all_gather_object``): call it on every rank at the
        same step, never while a batch is fetched. The merged bad images are replaced
        before reading from the first pass not started at ``position`` (the loader's
        :attr:`~lit_roidata.loader.StatefulRoIDataLoader.position`). Rank 0 logs every
        file with its reason.

        Returns:
            ``{"counts": {kind: n}, "files": [record, ...]}`` since the last exchange.
        """
        import torch.distributed as dist

        mine = {"counts": dict(self.pending), "files": list(self.records)}
        self.pending, self.records = Counter(), []
        parts: list[Any] = [mine]
        distributed = dist.is_available() and dist.is_initialized()
        if distributed:
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, mine)
        counts, files = merge_skip_reports(parts)
        for rec in (r for part in parts for r in part["files"]):
            if rec.get("index") is not None:
                self.ledger.mark_bad(int(rec["index"]), rec)
        p, c = self.ledger.plan.normalize(*position)
        self.ledger.freeze(p if c == 0 else p + 1)
        self.run_counts.update(counts)
        for path, rec in files.items():
            self.run_files.setdefault(path, rec)
        self.last_report = _report(counts, files, not distributed or dist.get_rank() == 0,
                                   "data: skip report of the epoch (on_bad_image=skip)")
        return self.last_report

    def run_report(self, log_it: bool = True) -> dict[str, Any]:
        """Every skip of the run so far (no collective); logged when ``log_it``."""
        return _report(self.run_counts, self.run_files, log_it,
                       "data: skip report of the whole run")

    def state_dict(self) -> dict[str, Any]:
        """The ledger's state and the skips not exchanged yet."""
        return {"ledger": self.ledger.state_dict(), "pending": dict(self.pending),
                "records": [dict(r) for r in self.records]}

    def load_state_dict(self, state: Mapping[str, Any], position: tuple[int, int]) -> None:
        """Restore :meth:`state_dict` for a stream that continues at ``position``."""
        self.ledger.load_state_dict(state["ledger"])
        self.ledger.resumed_at(*self.ledger.plan.normalize(*position))
        self.pending = Counter(state.get("pending", {}))
        self.records = [dict(r) for r in state.get("records", [])]
