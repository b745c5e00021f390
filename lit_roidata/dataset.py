"""The workers' datasets: ``RoIBlockDataset`` (a block of roidb indices in, one partial
training minibatch out) and ``EvalDataset`` (evaluation batches at the test scale).

Runs inside DataLoader workers, which are stateless: every random draw of a block comes
from its coordinates ``(seed, pass_index, block_index)`` (docs/architecture.md, "Blocks and
randomness"), so :func:`rebuild_block` reproduces a block bit for bit in any process. The
dataset only builds: it knows nothing of the sampler, the stream position or the skip
policy. Invalid minibatches and unreadable images: docs/sampler.md, "Invalid minibatches",
and docs/minibatch.md, "Bad images"; every replacement is recorded in ``"_meta"``.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.utils.data

from lit_roidata.config import DetectronConfig, load_detectron_cfg
from lit_roidata.minibatch.core import build_minibatch
from lit_roidata.minibatch.decode import BadImageError, dataset_name, load_image
from lit_roidata.minibatch.fpn import add_multilevel_rois, rois_blob
from lit_roidata.minibatch.image import PIXEL_FORMATS
from lit_roidata.minibatch import shm_pool as _pool
from lit_roidata.storage import prefetch_block
from lit_roidata.minibatch.transport import packed, shared_empty
from lit_roidata.osutil import malloc_trim
from lit_roidata.rng import RNG, block_rng
from lit_roidata.plan import Block, draw_replacement

__all__ = ["RoIBlockDataset", "BadImageFound", "rebuild_block", "EvalDataset"]

log = logging.getLogger(__name__)

_DETECTRON_DOMAIN = 0x64747270  # "dtrp": RandomState seeds never equal block_rng streams
_REPLACE_DOMAIN = 0x64737270  # "dsrp": the fallback replacement when no sampler is given


def _coords(block: Any) -> tuple[int, int, int, int]:
    try:
        return (int(block.seed), int(block.pass_index), int(block.block_index),
                int(getattr(block, "attempt", 0)))
    except AttributeError as exc:
        raise TypeError("RoIBlockDataset needs a lit_roidata.sampler.Block (a list of roidb "
                        "indices with seed, pass_index and block_index); got "
                        f"{type(block).__name__}. Use RoIBatchSampler as the DataLoader's "
                        "batch_sampler, or rebuild_block() for a one-off") from exc


class BadImageFound:
    """A block whose build hit an unreadable image (``hand_back_bad_images``): the typed
    result the train loader finishes in the main process, in stream order.

    Attributes:
        block: the block as it was tried (its planned replacements in ``block.substitutes``).
        slot: position in ``block`` of the bad image.
        record: what was wrong (reason, path, image id, dataset, message, index).
        skipped: bad images found earlier in this block (records).
    """

    __slots__ = ("block", "slot", "record", "skipped")

    def __init__(self, block: Block, slot: int, record: dict, skipped: list) -> None:
        self.block, self.slot, self.record, self.skipped = block, int(slot), record, skipped

    def __repr__(self) -> str:
        return (f"BadImageFound(block={self.block!r}, slot={self.slot}, "
                f"reason={self.record.get('reason')})")


def _in_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


#: Shared-memory tensors behind the arrays ``_shared_alloc`` handed out for the block
#: being built, by data address (``torch.from_numpy`` of such an array makes a tensor
#: that no longer knows it is shared, so ``_package`` sends the original tensor).
_SHARED: dict[int, torch.Tensor] = {}


_TRIM_EVERY = 8  # blocks between two malloc_trim calls in a worker (~1 ms each)
_TRIM_COUNTER = itertools.count(1)


def _shared_alloc(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    # Allocated in shared memory where it is built, so sending it to the main process
    # copies nothing (ForkingPickler passes a handle to the segment).
    t = shared_empty(shape, dtype)  # a new segment: zero-filled by the OS (ftruncate)
    arr = t.numpy()
    if arr.size:
        _SHARED[arr.ctypes.data] = t
    return arr


def _as_tensor(value: np.ndarray) -> torch.Tensor:
    """``value`` as a tensor: its shared-memory tensor if ``_shared_alloc`` made it."""
    t = _SHARED.get(value.ctypes.data) if value.size else None
    if (t is not None and tuple(t.shape) == value.shape and value.flags.c_contiguous
            and t.numpy().dtype == value.dtype):
        return t
    return torch.from_numpy(value)


class RoIBlockDataset(torch.utils.data.Dataset):
    """Build one partial minibatch per :class:`~lit_roidata.sampler.Block` (Detectron semantics:
    minibatch primitives).

    Use it with ``DataLoader(dataset, batch_sampler=RoIBatchSampler(...),
    collate_fn=lambda b: b)``: the DataLoader calls :meth:`__getitems__` with the
    whole block, so batching happens in the sampler.

    Args:
        roidb: a ``RoIDB`` or any sequence of roidb entries (docs/architecture.md, "A roidb entry").
        cfg: the Detectron config.
        output_format: ``"detectron"`` (blob dict + ``"_meta"``) or ``"torchvision"``
            (``TorchvisionBatch``: images, targets and ``.meta``).
        pixel_format: ``"uint8"`` (fast; normalise on the device with
            :func:`lit_roidata.minibatch.normalize_on_device`) or ``"detectron"``.
        rng_mode: ``"block"`` (PCG64 per block) or ``"detectron"`` (legacy
            ``RandomState`` per block, Detectron's call order).
        on_bad_image: ``"raise"`` or ``"skip"`` (replace the bad image, count the skip).
        replacement: ``(block, attempt) -> Block`` for invalid minibatches, a pure function
            (e.g. ``StreamPlan.replacement_block``); default: a deterministic draw of the
            same number of images with the same orientation.
        hand_back_bad_images: with ``on_bad_image="skip"``, return a stream block with an
            unreadable image as :class:`BadImageFound` (the train loader replaces only that
            image) instead of replacing the whole block.
        augment: optional :class:`~lit_roidata.minibatch.augment.Augmentation`.
        max_attempts: replacements tried before giving up with an error.
        loader: optional ``entry -> BGR uint8 HWC`` image reader (tests, caches).
        mask_format: ``"detectron"`` (class-specific ``masks_int32``, Detectron's
            shape) or ``"compact"`` (``(n, M*M)`` plus ``mask_class_int32``; 80x less
            data at COCO settings; expand with
            :func:`lit_roidata.minibatch.device.finalize_on_device`); torchvision output:
            bit-packed mask crops, pasted by :func:`~lit_roidata.minibatch.device.finish_batch`.
        fix_rpn_quirks: passed to the RPN target builder (Detectron quirk Q2/Q3
            (docs/detectron_quirks.md) fix).
        target_format: ``"detectron"`` (RPN wide blobs and RetinaNet class labels built
            densely in the worker, Detectron's blobs) or ``"compact"`` (only the sampled
            anchors, their labels, targets and weights; a few KB instead of ~45 MB per
            FPN batch; expand with
            :func:`lit_roidata.minibatch.device.finalize_on_device`).
    """

    def __init__(self, roidb: Sequence[Mapping[str, Any]], cfg: Any, *,
                 output_format: str = "detectron", pixel_format: str = "uint8",
                 rng_mode: str = "block", on_bad_image: str = "raise", max_attempts: int = 10,
                 replacement: Callable[[Any, int], Any] | None = None, augment: Any = None,
                 loader: Callable[[Mapping[str, Any]], np.ndarray] | None = None,
                 mask_format: str = "detectron", fix_rpn_quirks: bool = False,
                 target_format: str = "detectron", hand_back_bad_images: bool = False) -> None:
        for name, value, valid in (("output_format", output_format, ("detectron", "torchvision")),
                                   ("pixel_format", pixel_format, PIXEL_FORMATS),
                                   ("rng_mode", rng_mode, ("block", "detectron")),
                                   ("on_bad_image", on_bad_image, ("raise", "skip")),
                                   ("mask_format", mask_format, ("detectron", "compact")),
                                   ("target_format", target_format, ("detectron", "compact"))):
            if value not in valid:
                raise ValueError(f"RoIBlockDataset: {name}={value!r} is not one of {valid}")
        if max_attempts < 0:
            raise ValueError(f"max_attempts must be >= 0, got {max_attempts}")
        self.roidb, self.cfg, self.augment, self.loader = roidb, cfg, augment, loader
        self.output_format, self.pixel_format, self.rng_mode = output_format, pixel_format, rng_mode
        self.mask_format, self.target_format = mask_format, target_format
        self.on_bad_image, self.replacement = on_bad_image, replacement
        self.max_attempts, self.fix_rpn_quirks = int(max_attempts), bool(fix_rpn_quirks)
        self.hand_back_bad_images = bool(hand_back_bad_images) and on_bad_image == "skip"
        #: Skips and replacements made by *this process* (workers report theirs in _meta).
        self.skip_counts: Counter[str] = Counter()
        #: Set by :class:`~lit_roidata.loader.StatefulRoIDataLoader` while it starts its
        #: workers: their reusable shared-memory slots (``None``: a new segment per array).
        self.shm_pool: _pool.ShmPool | None = None

    def before_fork(self) -> None:
        """Build what every worker would build alike (the anchor arrays of RPN / RetinaNet
        targets) in this process, so that workers forked from it share one read-only copy
        instead of each holding its own (:class:`~lit_roidata.loader.StatefulRoIDataLoader`
        calls it before it forks its workers)."""
        if self.output_format != "torchvision":
            from lit_roidata.minibatch.anchors import build_anchor_caches

            build_anchor_caches(self.cfg)

    def __len__(self) -> int:
        return len(self.roidb)

    def __getitem__(self, block: Any) -> Any:
        """Same as :meth:`__getitems__` (for DataLoaders with ``batch_size=None``)."""
        return self.__getitems__(block)

    # ------------------------------------------------------------------ randomness
    def block_rng(self, block: Any) -> RNG:
        """The generator of ``block`` (a pure function of its coordinates)."""
        seed, p, b, _ = _coords(block)
        if self.rng_mode == "detectron":
            state = np.random.SeedSequence([_DETECTRON_DOMAIN, seed, p, b]).generate_state(4)
            return np.random.RandomState(state)
        return block_rng(seed, p, b)

    def _replacement(self, block: Any, attempt: int) -> Any:
        if self.replacement is not None:
            return self.replacement(block, attempt)
        # No sampler: the same policy (lit_roidata.sampler.draw_replacement) from the
        # block's orientation group (safe with or without aspect grouping), in a seed
        # domain of its own.
        _coords(block)
        pool = np.arange(len(self.roidb))
        widths, heights = getattr(self.roidb, "widths", None), getattr(self.roidb, "heights", None)
        if widths is not None and heights is not None and len(block):
            horz = np.asarray(widths) >= np.asarray(heights)
            pool = np.flatnonzero(horz == horz[int(block[0])])
        return draw_replacement(block, attempt, pool, min(len(block), pool.size),
                                domain=_REPLACE_DOMAIN)

    # ------------------------------------------------------------------ building
    def _build_once(self, block: Any, reads: list) -> tuple[Any, bool, list[Mapping[str, Any]]]:
        """Build ``block`` once; ``reads`` counts the images read (to know which failed)."""
        entries = [self.roidb[int(i)] for i in block]
        rng = self.block_rng(block)
        _SHARED.clear()
        _pool.rewind()  # an earlier attempt's arrays are dropped: reuse their space
        # in a worker, earlier blocks' temporaries are freed: keep memory flat
        if _in_worker() and next(_TRIM_COUNTER) % _TRIM_EVERY == 1:
            malloc_trim()
        base = self.loader or load_image

        def loader(entry: Mapping[str, Any]) -> np.ndarray:
            reads.append(1)
            return base(entry)
        loader.channel_order = getattr(base, "channel_order", "bgr")  # type: ignore
        if self.output_format == "torchvision":
            from lit_roidata.minibatch.torchvision_format import build_torchvision_batch

            images, targets = build_torchvision_batch(
                entries, self.cfg, rng, pixel_format=self.pixel_format, loader=loader,
                augment=self.augment, shared=_in_worker(),
                compact_masks=self.mask_format == "compact")
            return (images, targets), True, entries
        mb = build_minibatch(
            entries, self.cfg, rng, pixel_format=self.pixel_format, loader=loader,
            augment=self.augment, alloc=_shared_alloc if _in_worker() else None,
            compact_masks=self.mask_format == "compact", fix_rpn_quirks=self.fix_rpn_quirks,
            compact_targets=self.target_format == "compact")
        return mb, mb.valid, entries

    def __getitems__(self, block: Any) -> Any:
        """Build the partial minibatch of ``block`` (replacing what is unusable).

        Returns:
            ``output_format="detectron"``: dict blob name -> tensor in
            ``get_minibatch_blob_names`` order, plus ``"_meta"``;
            ``"torchvision"``: a :class:`TorchvisionBatch` ``(images, targets)``;
            with ``hand_back_bad_images``, a :class:`BadImageFound` for a stream block
            with an unreadable image.

        Raises:
            BadImageError: with ``on_bad_image="raise"``.
            RuntimeError: no usable block within ``max_attempts`` replacements.
        """
        prefetch_block(block, self.roidb)  # loader.read_ahead: the next blocks' images
        pool = getattr(self, "shm_pool", None)
        arena = _pool.begin_block(pool) if pool is not None and _in_worker() else None
        out = None
        try:
            out = self._attempts(block, (), self.hand_back_bad_images and _coords(block)[3] == 0)
        finally:
            if arena is not None:
                _pool.end_block()
                if out is not None and not isinstance(out, BadImageFound):  # a batch (packed)
                    out.shm_arena = arena  # sent with its slot tensors as descriptors
                else:  # failed, or a BadImageFound: nothing sent refers to the slot
                    arena.pool.give_back(arena)
        return out

    def _record(self, exc: BadImageError, block: Any, reads: list) -> dict[str, Any]:
        slot = max(0, len(reads) - 1)
        return {"reason": exc.reason, "path": exc.path, "image_id": exc.image_id,
                "dataset": exc.dataset, "message": str(exc),
                "index": int(block[slot]) if slot < len(block) else None, "slot": slot}

    def build_stream_block(self, block: Block, skipped: Sequence[Mapping[str, Any]] = ()) -> Any:
        """Build a stream block as it is, or return :class:`BadImageFound` at its first
        unreadable image (``skipped``: bad images found in it before). An invalid
        minibatch is still replaced whole (``replacement``)."""
        return self._attempts(block, skipped, True)

    def _attempts(self, block: Any, skipped: Sequence[Mapping[str, Any]], hand_back: bool) -> Any:
        """``block``, then whole-block replacements ``1, 2, ...`` (invalid minibatches; bad
        images unless ``hand_back``, which returns the first as :class:`BadImageFound`)."""
        skipped, invalid = [dict(r) for r in skipped], 0
        for attempt in range(self.max_attempts + 1):
            current = self._replacement(block, attempt) if attempt else block
            reads: list = []
            try:
                out, valid, entries = self._build_once(current, reads)
            except BadImageError as exc:
                if self.on_bad_image == "raise":
                    raise
                rec = self._record(exc, current, reads)
                if hand_back and attempt == 0:
                    return BadImageFound(block, rec["slot"], rec, skipped)
                skipped.append(rec)
                self.skip_counts[exc.reason] += 1
                log.warning("skipping block %s: %s", list(current), exc)
            else:
                if valid:
                    return self._package(out, entries, block, current, skipped, invalid)
                invalid += 1
                self.skip_counts["invalid_minibatch"] += 1
        seed, p, b, _ = _coords(block)
        raise RuntimeError(
            f"block {list(block)} (seed={seed}, pass={p}, block={b}): no usable minibatch after "
            f"{self.max_attempts} replacements ({invalid} invalid, {len(skipped)} with bad images: "
            f"{[s['message'] for s in skipped[:3]]}). Check the images, or lower "
            "KRCNN.MIN_KEYPOINT_COUNT_FOR_VALID_MINIBATCH for keypoint models")

    def _meta(self, entries: Sequence[Mapping[str, Any]], stream: Any, used: Any,
              skipped: list, invalid: int, scales: Sequence[float]) -> dict[str, Any]:
        seed, p, b, attempt = _coords(used)
        requested = getattr(stream, "requested", stream)
        return {"image_ids": torch.tensor([int(e["id"]) for e in entries], dtype=torch.int64),
                "flipped": torch.tensor([bool(e.get("flipped", False)) for e in entries]),
                "im_scales": torch.tensor([float(s) for s in scales], dtype=torch.float64),
                "datasets": [dataset_name(e) for e in entries],
                "images": [str(e.get("image")) for e in entries],
                "indices": [int(i) for i in used], "requested_indices": [int(i) for i in requested],
                "seed": seed, "pass_index": p, "block_index": b, "attempt": attempt,
                "skipped": skipped, "num_skipped": len(skipped), "num_invalid_replaced": invalid,
                "substitutes": [dict(x) for x in getattr(stream, "substitutes", ())],
                "pixel_format": self.pixel_format, "mask_format": self.mask_format,
                "target_format": self.target_format}

    def _package(self, out: Any, entries: list, stream: Any, used: Any, skipped: list,
                 invalid: int) -> Any:
        """The batch of ``used`` (built) for the stream block ``stream``."""
        if self.output_format == "torchvision":
            from lit_roidata.minibatch.torchvision_format import TorchvisionBatch

            return TorchvisionBatch(out, self._meta(entries, stream, used, skipped, invalid,
                                                    [t["scale"] for t in out[1]]))
        blobs = {name: _as_tensor(value) if isinstance(value, np.ndarray) else value
                 for name, value in out.blobs.items()}
        meta = self._meta(entries, stream, used, skipped, invalid, out.image.im_scales)
        blobs["_meta"] = dict(meta, image_sizes=torch.from_numpy(out.image.image_sizes),
                              im_info=torch.from_numpy(out.image.im_info))
        _SHARED.clear()
        # In a worker: one shared buffer for all small tensors instead of ~30 segments.
        return packed(blobs) if _in_worker() else blobs


def rebuild_block(roidb: Sequence[Mapping[str, Any]], cfg: Any, indices: Sequence[int], *,
                  seed: int, pass_index: int, block_index: int, attempt: int = 0,
                  **dataset_kwargs: Any) -> Any:
    """Rebuild one block exactly as a worker built it (``dump-blobs``, debugging, tests).

    Args:
        roidb, cfg: as :class:`RoIBlockDataset`.
        indices: the block's roidb indices; seed, pass_index, block_index, attempt: its
            stream coordinates (``"_meta"`` of the original batch has them all).
        **dataset_kwargs: the :class:`RoIBlockDataset` options used in training.
    """
    ds = RoIBlockDataset(roidb, cfg, **dataset_kwargs)
    return ds.__getitems__(Block(indices, seed=seed, pass_index=pass_index,
                                 block_index=block_index, attempt=attempt))


class EvalDataset(torch.utils.data.Dataset):
    """Evaluation batches: test-scale images, scaled proposals and what maps back to COCO.

    Detectron tests one unflipped image at ``TEST.SCALE`` / ``TEST.MAX_SIZE`` and feeds
    the first ``TEST.PROPOSAL_LIMIT`` proposals scaled to the input (its
    ``_get_rois_blob``). ``__getitems__(indices)`` returns ``data``, ``im_info``
    (``[round(H·s), round(W·s), s]``), ``rois`` (``(R, 5)``: batch index, scaled box;
    only with proposal files), FPN ``rois_fpn<l>`` / ``rois_idx_restore_int32`` when
    ``FPN.MULTILEVEL_ROIS`` is on, and ``_meta`` (``image_ids``, ``im_scales``,
    ``datasets``, ``heights``, ``widths``, ``image_sizes``, ``indices``).
    """

    def __init__(self, roidb: Any, cfg: DetectronConfig, *, pixel_format: str = "uint8",
                 with_rois: bool = False) -> None:
        self.roidb, self.pixel_format, self.with_rois = roidb, pixel_format, bool(with_rois)
        self.cfg = load_detectron_cfg(cfg, {"TRAIN.SCALES": (int(cfg.TEST.SCALE),),
                                            "TRAIN.MAX_SIZE": int(cfg.TEST.MAX_SIZE)})
        self.limit = int(cfg.TEST.PROPOSAL_LIMIT)

    def __len__(self) -> int:
        return len(self.roidb)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.__getitems__([index])

    def __getitems__(self, indices: Sequence[int]) -> dict[str, Any]:
        from lit_roidata.minibatch.image import build_image_blob

        entries = [self.roidb[int(i)] for i in indices]
        # One scale, so the generator draws nothing that matters.
        ib = build_image_blob(entries, self.cfg, np.random.default_rng(0),
                              pixel_format=self.pixel_format)
        out: dict[str, Any] = {"data": torch.from_numpy(ib.data),
                               "im_info": torch.from_numpy(ib.im_info)}
        rois = self._rois(entries, ib.im_scales)
        if rois is not None:
            blobs: dict[str, Any] = {"rois": rois}
            if self.cfg.FPN.FPN_ON and self.cfg.FPN.MULTILEVEL_ROIS:
                add_multilevel_rois(blobs, self.cfg, prefixes=("rois",))
            out.update({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in blobs.items()})
        out["_meta"] = {"image_ids": [int(e["id"]) for e in entries],
                        "im_scales": [float(s) for s in ib.im_scales],
                        "datasets": [self.roidb.dataset_of(int(i)) for i in indices],
                        "heights": [int(e["height"]) for e in entries],
                        "widths": [int(e["width"]) for e in entries],
                        "image_sizes": torch.from_numpy(ib.image_sizes),
                        "indices": [int(i) for i in indices]}
        return out

    def _rois(self, entries: Sequence[Mapping[str, Any]], scales: Sequence[float]
              ) -> np.ndarray | None:
        """Proposal rows (``gt_classes == 0``), first ``TEST.PROPOSAL_LIMIT``, scaled."""
        if not self.with_rois:
            return None
        parts = [np.zeros((0, 5), np.float32)]
        for b, (entry, s) in enumerate(zip(entries, scales)):
            props = np.asarray(entry["boxes"], np.float32)[np.asarray(entry["gt_classes"]) == 0]
            if self.limit > 0:
                props = props[: self.limit]
            parts.append(rois_blob(props * np.float32(s), b))
        return np.concatenate(parts)
