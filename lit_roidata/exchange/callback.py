"""``BlobExchangeCallback``: exchange named ``training_step`` outputs between two runs.

After each training batch the named entries of ``training_step``'s dict are published on
channel ``publish``; before each batch the peer's message from ``subscribe`` is checked and
set as ``pl_module.peer_outputs`` / ``pl_module.peer_meta`` (docs/exchange.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import pytorch_lightning as pl
import torch

from lit_roidata.exchange import BlobExchange
from lit_roidata.exchange.alignment import to_plain

__all__ = ["BlobExchangeCallback", "batch_alignment_meta"]

log = logging.getLogger(__name__)
DEFAULT_ALIGN_FIELDS = ("image_ids", "flipped", "im_scales")


def batch_alignment_meta(batch: Any, fields: Sequence[str] = DEFAULT_ALIGN_FIELDS
                         ) -> dict[str, Any]:
    """The alignment fields of a batch's ``_meta`` as plain lists (absent fields skipped).

    Works for Detectron-format batches (``batch["_meta"]``) and torchvision-format ones
    (``batch.meta``).
    """
    meta = batch.get("_meta") if isinstance(batch, Mapping) else None
    meta = getattr(batch, "meta", None) if meta is None else meta
    if not isinstance(meta, Mapping):
        return {}
    return {f: to_plain(meta[f]) for f in fields if f in meta}


class BlobExchangeCallback(pl.Callback):
    """Publish ``training_step`` outputs to a peer run and receive the peer's.

    Args:
        run_id: shared by both runs (e.g. ``"distill-exp1"``).
        backend: ``"embedded"`` (one machine, no server) or ``"memcached"``.
        address: embedded: shared directory (optional); memcached: ``"host:port"``.
        publish: channel to send on, or ``None``.
        publish_keys: names in ``training_step``'s returned dict to send.
        subscribe: channel to receive from, or ``None``.
        lag: 1: step ``t`` sees the peer's step ``t-1``; 0: the peer's step ``t``
            (docs/exchange.md).
        align_fields: ``batch["_meta"]`` fields sent and checked; ``step`` and ``rank``
            are always included. Empty to check only the step.
        timeout: seconds to wait for the peer per step.
        capacity: messages this run may publish ahead of the peer's consumption.
        lease_ttl: dead-peer detection delay across machines (seconds).
        attribute: name of the module attribute that receives the peer's tensors.
        delivery: ``"at_most_once"`` (a message taken just before a crash is lost) or
            ``"exactly_once"`` (payloads kept until the next checkpoint: a restart from it
            resumes right after it).
        resume: continue this run id's streams; default: only when restored from a
            checkpoint.
        busy_timeout: the longest time a wait is extended while the peer is busy.
        secret: the runs' shared secret (default ``$LIT_ROIDATA_EXCHANGE_SECRET[_FILE]``).

    Raises:
        ValueError: neither ``publish`` nor ``subscribe`` given, or ``publish`` without
            ``publish_keys``.
    """

    def __init__(self, run_id: str, backend: Literal["embedded", "memcached"] = "embedded",
                 address: str | None = None, publish: str | None = None,
                 publish_keys: Sequence[str] = (), subscribe: str | None = None,
                 lag: Literal[0, 1] = 1, align_fields: Sequence[str] = DEFAULT_ALIGN_FIELDS,
                 timeout: float = 120.0, capacity: int = 1, lease_ttl: float = 10.0,
                 attribute: str = "peer_outputs",
                 delivery: Literal["at_most_once", "exactly_once"] = "at_most_once",
                 resume: bool | None = None, busy_timeout: float = 3600.0,
                 secret: str | bytes | None = None) -> None:
        if publish is None and subscribe is None:
            raise ValueError("BlobExchangeCallback needs publish=<channel>, "
                             "subscribe=<channel>, or both")
        if publish is not None and not publish_keys:
            raise ValueError(f"publish={publish!r} needs publish_keys: the names in "
                             "training_step's returned dict to send")
        if lag not in (0, 1):
            raise ValueError(f"lag must be 0 or 1, got {lag!r}")
        if delivery not in ("at_most_once", "exactly_once"):
            raise ValueError(f"delivery must be 'at_most_once' or 'exactly_once', got "
                             f"{delivery!r}")
        self.run_id, self.backend, self.address = run_id, backend, address
        self.publish, self.publish_keys = publish, list(publish_keys)
        self.subscribe, self.lag, self.align_fields = subscribe, lag, list(align_fields)
        self.timeout, self.capacity, self.lease_ttl = timeout, capacity, lease_ttl
        self.attribute, self.secret = attribute, secret
        self.delivery, self.resume, self.busy_timeout = delivery, resume, busy_timeout
        self.exchange: BlobExchange | None = None
        self._out = self._in = None
        # this step's own alignment, the previous step's, and the checkpoint's state
        self._pending_align = self._previous_align = self._restored = None
        # sequence numbers (saved in checkpoints; consumed at the previous state_dict())
        self._step = self._consumed = self._published = self._checkpointed_seq = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Callback state is restored before on_fit_start, so a resumed run knows its seqs.
        self._previous_align = self._pending_align = None
        setattr(pl_module, self.attribute, None)
        pl_module.peer_meta = None
        if self.exchange is not None:
            return
        restored = self._restored
        resume = self.resume if self.resume is not None else restored is not None
        self.exchange = BlobExchange(self.backend, self.address, run_id=self.run_id,
                                     rank=trainer.global_rank, timeout=self.timeout,
                                     capacity=self.capacity, lease_ttl=self.lease_ttl,
                                     resume=resume, busy_timeout=self.busy_timeout,
                                     secret=self.secret)
        if self.publish:
            self._out = self.exchange.channel(self.publish, "producer")
            self._published = int(restored.get("published_seq", 0)) if restored else 0
        if self.subscribe:
            start = (int(restored.get("consumed_seq", 0)) + 1 if restored is not None
                     and self.delivery == "exactly_once" else None)
            self._in = self.exchange.channel(self.subscribe, "consumer", start_seq=start,
                                             delivery=self.delivery)
            self._consumed = self._checkpointed_seq = self._in.next_seq - 1
        self._previous_align = (restored or {}).get("previous_align")
        log.info("blob exchange ready: %r publish=%s subscribe=%s", self.exchange,
                 self.publish, self.subscribe)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # global_step is restored after on_fit_start.
        self._step = trainer.global_step * max(1, trainer.accumulate_grad_batches)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.exchange is not None:
            self.exchange.set_activity("validation", busy=True)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.exchange is not None:
            self.exchange.set_activity(f"training (after validation at step {self._step})")

    def state_dict(self) -> dict[str, Any]:
        """Consumed/published sequence numbers (and the last alignment) for checkpoints.

        Saving a new checkpoint means the previous one was written, so payloads up to the
        previous checkpoint's consumed seq are released (``exactly_once``).
        """
        if self._in is not None and self.delivery == "exactly_once":
            self._in.commit(self._checkpointed_seq)
        self._checkpointed_seq = self._consumed
        return {"consumed_seq": self._consumed, "published_seq": self._published,
                "previous_align": self._previous_align, "run_id": self.run_id}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Remember the checkpoint's sequence numbers; the channels open in on_fit_start."""
        if state_dict.get("run_id", self.run_id) != self.run_id:
            log.warning("BlobExchangeCallback: the checkpoint was written with run id %r, "
                        "this run uses %r; its sequence numbers are ignored",
                        state_dict.get("run_id"), self.run_id)
            return
        self._restored = dict(state_dict)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._close(finished=False)  # keep the streams: the run may resume from a checkpoint

    def _close(self, finished: bool = True) -> None:
        if self.exchange is not None:
            self.exchange.close(finished)
        self.exchange = self._out = self._in = None

    def _alignment(self, trainer: pl.Trainer, batch: Any) -> dict[str, Any]:
        return {**batch_alignment_meta(batch, self.align_fields), "step": self._step,
                "rank": trainer.global_rank}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self._pending_align = own = self._alignment(trainer, batch)
        if self._in is None:
            return
        expected = own if self.lag == 0 else self._previous_align
        tensors = meta = None  # lag 1, first step: the peer has published nothing yet
        if expected is not None:
            tensors, meta = self._in.get(self.timeout, expect=expected, as_torch=True)
            self._consumed = self._in.next_seq - 1
            tensors = {k: v.to(pl_module.device, non_blocking=True) for k, v in tensors.items()}
        setattr(pl_module, self.attribute, tensors)
        pl_module.peer_meta = meta

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        own = self._pending_align or self._alignment(trainer, batch)
        if self._out is not None:
            if not isinstance(outputs, Mapping):
                raise TypeError(f"BlobExchangeCallback publishes {self.publish_keys} from "
                                "training_step's returned dict, but training_step returned "
                                f"{type(outputs).__name__}; return a dict with 'loss' and "
                                "those entries")
            if missing := [k for k in self.publish_keys if k not in outputs]:
                raise KeyError(f"training_step did not return {missing} (it returned "
                               f"{sorted(outputs)}); BlobExchangeCallback(publish_keys=...) "
                               "names what to send")
            self._published += 1
            if self._published >= self._out.next_seq:  # else: sent before a restart
                tensors = {k: outputs[k].detach() if isinstance(outputs[k], torch.Tensor)
                           else outputs[k] for k in self.publish_keys}
                self._out.put(tensors, meta=own, timeout=self.timeout)
        self._previous_align = own
        self._step += 1
