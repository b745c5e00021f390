"""The bad-image skip policy (``on_bad_image="skip"``): replace only the bad image.

A block (one rank's partial minibatch) that holds an unreadable image keeps its good
images in their slots; only the bad image's slot is refilled, with an image that

* is of the block's orientation when the sampler groups by aspect ratio,
* is not delivered anywhere else in the same pass (so every good image of a pass is
  delivered exactly once), and
* is not known to be bad (a file found bad is never read again once every rank knows it),

chosen deterministically: the same on every rank, after a resume, and whatever the
number of workers or their timing.

**The reserve.** With the skip policy the sampler holds back the last few blocks of every
pass (``RoIBatchSampler(holdback=...)``): the first ``blocks_per_pass`` blocks of
Detectron's permutation are delivered unchanged; the held-back images, together with the
images a pass leaves out anyway (aspect-grouping tails, the last blocks of an epoch that
do not fill a global minibatch), form the pass's *reserve*, ordered by a generator
seeded from ``(seed, pass)``. Replacements come only from the reserve, each reserve
image at most once per pass; the images of the reserve are simply not delivered in that
pass otherwise (the next pass reshuffles everything).

**Two kinds of bad images.**

* *Known* bad images (the frozen set ``F``: everything known on every rank at the last
  exchange) are replaced before they are read. Which reserve image replaces which slot is
  a pure function of ``(seed, pass, F)``: the slots holding known-bad images, in stream
  order, take the reserve's good images in order. Any worker computes it.
* A *newly found* bad image (not in ``F``) is found by the worker that reads it. The
  worker cannot know what other workers or ranks found at the same moment, so it hands
  the block back unbuilt (:class:`RepairRequest`); the rank's main process, which sees its
  batches in stream order, takes the next image of **its own share** of the rest of the
  reserve (share ``r`` of ``world_size``: disjoint between ranks) and rebuilds the block.
  Bad images are rare, so this costs one block build in the main process per bad image.

**Exchange.** New discoveries are exchanged between ranks (one ``all_gather_object``)
only at epoch ends (:meth:`SkipPolicy.exchange`, which
:class:`lit_roidata.callbacks.BadImageReport` runs in ``on_train_epoch_end``), never while
a batch is fetched. The merged set becomes the frozen set for the passes that have not
started yet. Between two exchanges a rank does not know what another rank found; a file
found bad on rank 1 can be read once more by rank 0 in a later pass before the next
exchange (it is then replaced, and counted once).

**Exhausted reserve.** When a pass has more bad images of one orientation than reserve
images, the extra slots are filled with a deterministic draw of a good image of that
orientation that the pass delivers anyway: that image is delivered twice in the pass. It
is counted (``reserve_exhausted``) and reported; raise ``bad_image_reserve``.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

__all__ = ["BadImageLedger", "RepairRequest", "SkipPolicy", "holdback_blocks",
           "merge_skip_reports", "summarize", "LEDGER_VERSION"]

log = logging.getLogger(__name__)

LEDGER_VERSION = 1
_RESERVE_DOMAIN = 0x72737276  # "rsrv": reserve order of a pass
_FALLBACK_DOMAIN = 0x66616c6c  # "fall": the draw when the reserve is exhausted


MIN_RESERVE_IMAGES = 16


def holdback_blocks(natural_blocks: int, fraction: float, world_size: int = 1,
                    ims_per_batch: int = 1) -> int:
    """Blocks to hold back per pass for a reserve of ``fraction`` of a pass.

    At least :data:`MIN_RESERVE_IMAGES` images (a small dataset still has a reserve of
    each orientation: an image and its flipped copy are two entries), at most a quarter
    of the pass and never so many that fewer than ``world_size`` blocks are left. 0 when
    ``fraction`` is 0 (no reserve: every replacement is a counted repeat).
    """
    if fraction < 0 or fraction >= 1:
        raise ValueError(f"bad_image_reserve={fraction}: use a fraction of a pass in [0, 1)")
    if fraction == 0:
        return 0
    want = max(int(np.ceil(fraction * natural_blocks)),
               -(-MIN_RESERVE_IMAGES // max(1, int(ims_per_batch))))
    want = min(want, max(1, natural_blocks // 4))
    return max(0, min(want, natural_blocks - max(1, world_size)))


class RepairRequest:
    """A block whose worker found a bad image not yet known (handed to the main process).

    Attributes:
        block: the block as the worker tried it (known-bad images already replaced).
        slot: position in ``block`` of the bad image.
        record: what was wrong (reason, path, image id, dataset, message, index).
        substitutes: replacements made so far in this block (dicts, see ``_meta``).
        skipped: bad images found so far in this block (records).
        requested: the stream block as the sampler gave it.
    """

    __slots__ = ("block", "slot", "record", "substitutes", "skipped", "requested")

    def __init__(self, block: Any, slot: int, record: dict, substitutes: list, skipped: list,
                 requested: Any = None) -> None:
        self.block, self.slot, self.record = block, int(slot), record
        self.substitutes, self.skipped = substitutes, skipped
        self.requested = block if requested is None else requested

    def __reduce__(self) -> tuple:
        return (RepairRequest, (self.block, self.slot, self.record, self.substitutes,
                                self.skipped, self.requested))

    def __repr__(self) -> str:
        return f"RepairRequest(block={self.block!r}, slot={self.slot}, reason={self.record.get('reason')})"


def _file_keys(roidb: Any) -> Any:
    """One key per roidb entry naming its file (originals and flips share it), or None."""
    rows = getattr(roidb, "_entry_img", None)
    if rows is not None:
        return np.asarray(rows)
    if isinstance(roidb, Sequence) and len(roidb) and hasattr(roidb[0], "get"):
        return np.asarray([str(e.get("image")) for e in roidb])
    return None


class BadImageLedger:
    """The run's bad images, each pass's reserve and the replacement rules (module doc).

    One ledger per process; workers get a copy (frozen for their lifetime) with the
    dataset. Its state (known bad images with what was wrong, the frozen snapshots and
    this rank's use of the reserve) is saved with the data module's checkpoint state.

    Args:
        sampler: the :class:`~lit_roidata.sampler.RoIBatchSampler` of this rank (its
            ``holdback`` sets the reserve).
        roidb: the training roidb (to treat an original and its flipped copy, one file,
            as one bad image).
    """

    def __init__(self, sampler: Any, roidb: Any = None) -> None:
        self.sampler = sampler
        self._files = _file_keys(roidb) if roidb is not None else None
        self.known: dict[int, dict] = {}  # roidb index -> record (what was wrong)
        #: ``[(from_pass, frozenset)]``: the known set each pass uses (sorted by pass).
        self.frozen: list[tuple[int, frozenset]] = [(0, frozenset())]
        self.used: dict[tuple[int, Any], int] = {}  # (pass, orientation) -> share used
        #: A pass whose share this rank takes from the end: set after restoring a state
        #: saved by another rank mid-pass (this rank's use of its share before the
        #: interruption is unknown; it took from the front).
        self.reverse_pass: int | None = None
        self.restored_foreign = False
        self._cache: dict[int, tuple[frozenset, dict, dict]] = {}

    # ------------------------------------------------------------------ sets
    def frozen_for(self, pass_index: int) -> frozenset:
        """The known-bad set replaced before reading in pass ``pass_index``."""
        out = frozenset()
        for start, s in self.frozen:
            if start <= pass_index:
                out = s
        return out

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
        (call with the same arguments on every rank: after an exchange)."""
        s = frozenset(self.known)
        # Only the snapshot in force just before ``from_pass`` can still be asked for (the
        # stream never goes back), so older ones are dropped.
        older = [(p, f) for p, f in self.frozen if p < from_pass][-1:]
        self.frozen = older + [(int(from_pass), s)]
        self._cache = {p: v for p, v in self._cache.items() if p < from_pass}

    # ------------------------------------------------------------------ reserve
    def _orient(self, index: int) -> Any:
        sm = self.sampler
        return bool(sm.is_horizontal[int(index)]) if sm.grouped else None

    def delivered_blocks(self, pass_index: int) -> int:
        """How many blocks of pass ``pass_index`` the stream delivers (all ranks)."""
        sm = self.sampler
        nb = sm.pass_blocks(pass_index)  # varies by pass with repeat factors
        if sm.infinite:
            return nb
        return nb // sm.world_size * sm.world_size

    def reserve(self, pass_index: int) -> np.ndarray:
        """The images pass ``pass_index`` does not deliver, in the pass's reserve order."""
        sm = self.sampler
        perm = sm.permutation(pass_index)
        delivered = perm[: self.delivered_blocks(pass_index) * sm.ims_per_batch]
        rest = np.setdiff1d(np.arange(sm.num_images, dtype=np.int64), delivered)
        g = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
            [_RESERVE_DOMAIN, sm.seed, int(pass_index)])))
        return rest[g.permutation(rest.size)]

    def _pass_plan(self, pass_index: int) -> tuple[frozenset, dict, dict]:
        """``(F, {(block, slot): (replacement, why)}, {orientation: free reserve images})``."""
        hit = self._cache.get(pass_index)
        bad = self.frozen_for(pass_index)
        if hit is not None and hit[0] is bad:
            return hit
        sm = self.sampler
        mb = sm.ims_per_batch
        perm = sm.permutation(pass_index)
        nd = self.delivered_blocks(pass_index)
        delivered = perm[: nd * mb]
        res = self.reserve(pass_index)
        bad_arr = np.fromiter(bad, dtype=np.int64, count=len(bad))
        res = res[~np.isin(res, bad_arr)]
        pools: dict[Any, list[int]] = {}
        for i in res.tolist():
            pools.setdefault(self._orient(i), []).append(i)
        plan: dict[tuple[int, int], int] = {}
        if bad_arr.size:
            for pos in np.flatnonzero(np.isin(delivered, bad_arr)).tolist():
                b, slot = divmod(pos, mb)
                idx = int(delivered[pos])
                pool = pools.get(self._orient(idx))
                plan[(b, slot)] = ((pool.pop(0), "known_bad") if pool else
                                   (self._fallback(pass_index, b, slot, 0, idx, bad),
                                    "reserve_exhausted"))
        out = (bad, plan, pools)
        self._cache[pass_index] = out
        return out

    def _fallback(self, pass_index: int, block_index: int, slot: int, attempt: int,
                  index: int, bad: Iterable[int], own_rank: bool = False) -> int:
        """A good image the pass delivers anyway (a repeat): the reserve is exhausted.

        Drawn from the blocks before ``block_index`` (all read already: with
        ``own_rank``, only this rank's, so none of them can be an unknown bad image),
        else from the whole delivered pass.
        """
        sm = self.sampler
        mb = sm.ims_per_batch
        perm = sm.permutation(pass_index)
        blocks = np.arange(min(int(block_index), self.delivered_blocks(pass_index)))
        if own_rank:
            blocks = blocks[blocks % sm.world_size == sm.rank]
        delivered = perm[(blocks[:, None] * mb + np.arange(mb)).reshape(-1)]
        if delivered.size == 0:
            delivered = perm[: self.delivered_blocks(pass_index) * mb]
        bad = set(int(i) for i in bad)
        ok = ~np.isin(delivered, np.fromiter(bad, dtype=np.int64, count=len(bad)))
        o = self._orient(index)
        cand = delivered[ok & (sm.is_horizontal[delivered] == o)] if o is not None else delivered[ok]
        if cand.size == 0:  # nothing good of this orientation: any good image at all
            every = np.arange(sm.num_images, dtype=np.int64)
            cand = every[~np.isin(every, np.fromiter(bad, dtype=np.int64, count=len(bad)))]
        if cand.size == 0:
            raise RuntimeError(
                f"on_bad_image='skip': no good image is left to replace roidb entry {index} "
                f"in pass {pass_index}: every image is known to be bad. Fix or remove the "
                "bad images (the skip report lists them)")
        g = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
            [_FALLBACK_DOMAIN, sm.seed, int(pass_index), int(block_index), int(slot),
             int(attempt)])))
        return int(cand[int(g.integers(cand.size))])

    # ------------------------------------------------------------------ replacing
    def apply_plan(self, block: Any) -> tuple[Any, list[dict]]:
        """Replace the known-bad images of a stream block before anything is read.

        Returns:
            ``(block, substitutes)``: the block to build (``block`` itself when nothing
            is known bad in it) and one dict per replaced slot.
        """
        bad = self.frozen_for(block.pass_index)
        if not bad or not any(int(i) in bad for i in block):
            return block, []
        _, plan, _ = self._pass_plan(block.pass_index)
        inds, subs = list(block), []
        for slot, i in enumerate(block):
            if int(i) in bad:
                new, why = plan.get((block.block_index, slot), (None, "reserve_exhausted"))
                if new is None:  # a block outside the delivered pass (not expected)
                    new = self._fallback(block.pass_index, block.block_index, slot, 0, int(i),
                                         bad)
                inds[slot] = new
                subs.append({"slot": slot, "bad_index": int(i), "index": int(new), "why": why})
        return block.derive([int(i) for i in inds]), subs

    def substitute(self, block: Any, slot: int, attempt: int = 0) -> tuple[Any, dict]:
        """Replace ``block[slot]`` (found bad, already :meth:`mark_bad`) by this rank's next
        reserve image (main process, stream order).

        Returns:
            ``(block, substitute)``: the block with the slot refilled and a dict
            describing the replacement.
        """
        sm = self.sampler
        p = int(block.pass_index)
        bad_index = int(block[slot])
        o = self._orient(bad_index)
        _, _, pools = self._pass_plan(p)
        share = pools.get(o, [])[sm.rank::sm.world_size]
        if p == self.reverse_pass:
            share = share[::-1]
        key = (p, o)
        new = None
        why = "new_bad"
        while self.used.get(key, 0) < len(share):
            cand = share[self.used.get(key, 0)]
            self.used[key] = self.used.get(key, 0) + 1
            if cand not in self.known:
                new = cand
                break
        if new is None:
            new = self._fallback(p, block.block_index, slot, attempt + 1, bad_index,
                                 self.frozen_for(p) | frozenset(self.known), own_rank=True)
            why = "reserve_exhausted"
        inds = list(block)
        inds[slot] = new
        return block.derive([int(i) for i in inds]), {"slot": int(slot),
                                                      "bad_index": bad_index,
                                                      "index": int(new), "why": why}

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Known bad images (with what was wrong), frozen snapshots, this rank's use of
        the reserve."""
        return {"version": LEDGER_VERSION,
                "known": {str(k): dict(v) for k, v in sorted(self.known.items())},
                "frozen": [[int(p), sorted(int(i) for i in s)] for p, s in self.frozen],
                "used": [[int(p), o, int(n)] for (p, o), n in sorted(
                    self.used.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))],
                "rank": int(self.sampler.rank), "world_size": int(self.sampler.world_size)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. The reserve use is restored only for the rank and
        world size that saved it (Lightning saves rank 0's state)."""
        self.known = {int(k): dict(v) for k, v in dict(state.get("known", {})).items()}
        self.frozen = [(int(p), frozenset(int(i) for i in s))
                       for p, s in state.get("frozen", [[0, []]])] or [(0, frozenset())]
        same = (int(state.get("rank", -1)) == self.sampler.rank
                and int(state.get("world_size", -1)) == self.sampler.world_size)
        self.used = {(int(p), o): int(n) for p, o, n in state.get("used", [])} if same else {}
        self.restored_foreign = not same
        self._cache = {}

    def resumed_at(self, pass_index: int, cursor: int) -> None:
        """Tell the ledger where a resumed stream starts. If the state came from another
        rank (or world size) and the resume is mid-pass, this rank takes its share of that
        pass's reserve from the end, so it does not repeat a replacement it delivered
        before the interruption (it took those from the front)."""
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


def _report_lines(records: Sequence[Mapping[str, Any]]) -> list[str]:
    return [f"  {r.get('path')} (image id {r.get('image_id')}, dataset {r.get('dataset')}, "
            f"roidb index {r.get('index')}): {r.get('reason')}: {r.get('message')}"
            for r in records]


def summarize(records: Sequence[Mapping[str, Any]], counts: Mapping[str, int],
              title: str = "data: skip report") -> str:
    """A readable multi-line skip report: the counts by kind, then one line per file."""
    lines = [f"{title}: {dict(sorted(Counter(counts).items()))}"]
    if records:
        lines.append(f"bad images found ({len(records)}):")
        lines += _report_lines(records)
    return "\n".join(lines)


class SkipPolicy:
    """``on_bad_image="skip"`` for one train loader: the one object that applies it.

    :class:`~lit_roidata.loader.StatefulRoIDataLoader` makes one when its dataset has a
    :class:`BadImageLedger` (``loader.skip_policy``) and passes every batch through
    :meth:`on_batch` in stream order, in its own process. :meth:`exchange` is the policy's
    only collective: :class:`lit_roidata.callbacks.BadImageReport` runs it at every epoch
    end, on every rank. The state (known bad images, reserve use, skips not reported yet)
    is part of the loader's state, so it is in every checkpoint and follows a reloaded
    loader.

    Args:
        dataset: the loader's :class:`~lit_roidata.dataset.RoIBlockDataset` with a ledger.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        self.ledger: BadImageLedger = dataset.ledger
        dataset.defer_repair = True  # every repair in on_batch, in stream order
        self.pending: Counter[str] = Counter()  # skips since the last exchange, by kind
        self.records: list[dict[str, Any]] = []  # bad files found since then
        self.run_counts: Counter[str] = Counter()
        self.run_files: dict[str, dict[str, Any]] = {}
        #: ``{"counts": ..., "files": [...]}`` of the last :meth:`exchange` (all ranks).
        self.last_report: dict[str, Any] = {"counts": {}, "files": []}

    def on_batch(self, batch: Any) -> Any:
        """Finish a block with a newly found bad image and count every skip (main process,
        stream order, before the device transfer; any ``output_format``)."""
        batch = self.dataset.repair(batch)
        meta = batch.get("_meta") if isinstance(batch, dict) else getattr(batch, "meta", None)
        if not isinstance(meta, Mapping):
            return batch
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
        for sub in meta.get("substitutes") or ():
            if sub.get("why") in ("known_bad", "reserve_exhausted"):
                self.pending[str(sub["why"])] += 1
        if meta.get("num_invalid_replaced"):
            self.pending["invalid_minibatch"] += int(meta["num_invalid_replaced"])
        return batch

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
        p, c = self.ledger.sampler.normalize(*position)
        self.ledger.freeze(p if c == 0 else p + 1)
        report = {"counts": dict(sorted(counts.items())), "files": list(files.values())}
        self.last_report = report
        self.run_counts.update(counts)
        for path, rec in files.items():
            self.run_files.setdefault(path, rec)
        if counts and (not distributed or dist.get_rank() == 0):
            log.warning("%s", summarize(report["files"], report["counts"],
                                        "data: skip report of the epoch (on_bad_image=skip)"))
        return report

    def run_report(self, log_it: bool = True) -> dict[str, Any]:
        """Every skip of the run so far (no collective); logged when ``log_it``."""
        report = {"counts": dict(sorted(self.run_counts.items())),
                  "files": list(self.run_files.values())}
        if log_it and report["counts"]:
            log.warning("%s", summarize(report["files"], report["counts"],
                                        "data: skip report of the whole run"))
        return report

    def state_dict(self) -> dict[str, Any]:
        """The ledger's state and the skips not exchanged yet."""
        return {"ledger": self.ledger.state_dict(), "pending": dict(self.pending),
                "records": [dict(r) for r in self.records]}

    def load_state_dict(self, state: Mapping[str, Any], position: tuple[int, int]) -> None:
        """Restore :meth:`state_dict` for a stream that continues at ``position``."""
        self.ledger.load_state_dict(state["ledger"])
        self.ledger.resumed_at(*self.ledger.sampler.normalize(*position))
        self.pending = Counter(state.get("pending", {}))
        self.records = [dict(r) for r in state.get("records", [])]
