"""The Lightning callbacks that drive lit_roidata's train loader (also
``lit_roidata.callbacks.X``): :class:`GracefulStop` (Ctrl-C / SIGTERM stop at a clean step
boundary) and :class:`BadImageReport` (``on_bad_image="skip"``'s epoch-end exchange).
Both use only Lightning's public API.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Optional, Sequence, Union

import pytorch_lightning as pl

__all__ = ["GracefulStop", "BadImageReport", "check_trainer_for_loader", "fit_epochs_to_passes"]

log = logging.getLogger(__name__)


class GracefulStop(pl.Callback):
    """Stop ``fit`` at a clean step boundary on the first Ctrl-C or SIGTERM.

    At the next clean boundary after the first signal the train loader
    (:meth:`~lit_roidata.loader.StatefulRoIDataLoader.request_stop`) ends the epoch on
    every rank at the same step; the trainer writes a checkpoint that resumes exactly and
    ``trainer.should_stop`` ends ``fit``. A second signal aborts before the next batch
    (:meth:`~lit_roidata.loader.StatefulRoIDataLoader.request_abort`, Lightning's
    ``KeyboardInterrupt`` path), a third at once. The boundary rule and why:
    docs/ddp_and_resume.md, "Stops".

    Args:
        ckpt_path: the checkpoint to write. ``None``: ``interrupted.ckpt`` in the
            folder of the first ``OnExceptionCheckpoint`` in ``trainer.callbacks``,
            else in ``trainer.default_root_dir`` (:meth:`resolve_ckpt_path`). It is
            removed when a later ``fit`` ends without a stop, as ``OnExceptionCheckpoint``
            does with its own.
        signals: the signals that stop gracefully, by name or number (default SIGINT and
            SIGTERM).

    Attributes:
        stopped_by_signal: the signal that stopped ``fit`` (``None``: it was not
            stopped); a command line exits with ``128 + stopped_by_signal``.
        stopped_at: the checkpoint written at the stop.
    """

    def __init__(self, ckpt_path: Optional[str] = None,
                 signals: Sequence[Union[str, int]] = ("SIGINT", "SIGTERM")) -> None:
        self.ckpt_path = None if ckpt_path is None else str(ckpt_path)
        try:
            self.signals = tuple(signal.Signals[s] if isinstance(s, str) else signal.Signals(s)
                                 for s in signals)
        except (KeyError, ValueError) as exc:
            raise ValueError(f"GracefulStop(signals={list(signals)!r}): {exc} is not a signal; "
                             "use names such as SIGINT, SIGTERM, SIGUSR1") from None
        self._reset()

    def _reset(self, trainer: Any = None) -> None:
        self.stopped_by_signal: Optional[int] = None
        self.stopped_at: Optional[str] = None
        self._trainer, self._received, self._previous = trainer, None, {}
        self._signum = self._refused = 0
        self._validated = self._aborting = False

    # ------------------------------------------------------------------ signals
    def _handle(self, signum: int, frame: Any) -> None:
        name, trainer = signal.Signals(signum).name, self._trainer
        if self._received is None:  # the first: stop at the next clean boundary
            self._received = signum
            what = "validation" if trainer is not None and trainer.validating else "step"
            again = "Ctrl-C" if signum == signal.SIGINT else name
            self._say(f"{name}: stopping after this {what}; {again} again to abort")
            return
        loader = None if trainer is None else trainer.train_dataloader
        if not self._aborting and callable(getattr(loader, "request_abort", None)):
            self._aborting = True  # the second: abort between steps
            loader.request_abort()
            self._say(f"{name}: aborting before the next batch (again to abort at once)")
            return
        self._restore_handlers()  # the third one (or no lit_roidata loader): at once
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        previous = signal.getsignal(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _say(self, message: str) -> None:
        bar = getattr(self._trainer, "progress_bar_callback", None)
        if bar is not None and getattr(bar, "is_enabled", False):
            bar.print(message)
        else:
            log.warning("%s", message)

    def _restore_handlers(self, *_hook_args: Any) -> None:
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:  # else someone replaced ours
                signal.signal(signum, previous)
        self._previous = {}

    #: Lightning hooks (``trainer, pl_module[, exception]``): the handlers go back.
    on_train_end = on_exception = _restore_handlers

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._reset(trainer)
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.signals}

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self._validated = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._validated = False
        signum = self._received or 0
        if trainer.world_size > 1:  # every rank stops at the same step, for the same signal
            import torch

            mine = torch.tensor(signum, device=trainer.strategy.root_device)
            signum = int(trainer.strategy.reduce(mine, reduce_op="max"))
        if not signum or self.stopped_at is not None:
            return
        self._signum = signum
        loader = trainer.train_dataloader  # (again every step: a reloaded loader is new)
        if callable(getattr(loader, "request_stop", None)):
            loader.request_stop(ready=self._ready, on_stop=lambda: self._stop(trainer))
        else:
            self._stop(trainer)

    def _ready(self) -> bool:
        # Not right after a validation: Lightning 2.4 would run it again on the resume.
        # A run that validates after every step stops at its second boundary anyway.
        refuse = self._validated and self._refused == 0
        self._refused += refuse
        return not refuse

    def _stop(self, trainer: Any) -> None:
        trainer.should_stop = True
        path = self.resolve_ckpt_path(trainer)
        trainer.save_checkpoint(path)
        self.stopped_by_signal, self.stopped_at = self._signum, path
        if trainer.is_global_zero:
            log.warning("stopped at global step %d; the same command resumes (checkpoint %s)",
                        trainer.global_step, path)

    def resolve_ckpt_path(self, trainer: Any) -> str:
        """The checkpoint a stop writes (and a resume reads) for ``trainer``."""
        if self.ckpt_path is not None:
            return self.ckpt_path
        for cb in trainer.callbacks:
            if any(k.__name__ == "OnExceptionCheckpoint" for k in type(cb).__mro__):
                return os.path.join(str(cb.dirpath), "interrupted" + cb.FILE_EXTENSION)
        return os.path.join(str(trainer.default_root_dir), "interrupted.ckpt")

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._restore_handlers()
        self._trainer = None
        if stage == "fit" and self.stopped_by_signal is None:
            # A fit that ended by itself: an earlier stop's checkpoint is stale.
            trainer.strategy.remove_checkpoint(self.resolve_ckpt_path(trainer))


class BadImageReport(pl.Callback):
    """``on_bad_image="skip"``: exchange bad images between ranks and report skips.

    ``on_train_epoch_end`` (every rank, same step) runs the skip policy's only collective
    (:meth:`lit_roidata.skip.SkipPolicy.exchange`) and rank 0 logs the epoch's skips;
    ``on_train_end`` logs the run's total. A plain callback, so Lightning runs it before
    the checkpoint callbacks and an epoch-end checkpoint holds the state after the exchange.
    """

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        loader = trainer.train_dataloader
        if getattr(loader, "skip_policy", None) is not None:
            loader.skip_policy.exchange(loader.position)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        policy = getattr(trainer.train_dataloader, "skip_policy", None)
        if policy is not None:
            policy.run_report(log_it=trainer.is_global_zero)


def check_trainer_for_loader(trainer: Any, plan: Any, skip: bool) -> None:
    """Refuse a trainer the train loader cannot work with, naming the fix.

    Raises:
        RuntimeError: ``on_bad_image="skip"`` without :class:`BadImageReport`.
        ValueError: repeat factors in epoch mode without a new loader every epoch
            (Lightning reads an epoch's length once per loader, and pass lengths vary).
    """
    if trainer is None:
        return
    from lit_roidata._lightning import isinstance_any

    if skip and not any(isinstance_any(cb, BadImageReport) for cb in trainer.callbacks):
        raise RuntimeError("sources.on_bad_image='skip' needs the BadImageReport callback "
                           "(the epoch-end exchange and report of bad images): add "
                           "lit_roidata.callbacks.BadImageReport to trainer.callbacks "
                           "(lit-roidata adds it when the config names none)")
    if (plan.infinite or plan.repeat_digest is None
            or getattr(trainer, "reload_dataloaders_every_n_epochs", 1) == 1):
        return
    raise ValueError(
        "sampling.repeat_factor_threshold (DATALOADER.SAMPLER_TRAIN: RepeatFactorTrainingSampler) "
        "with epochs: each pass has its own number of batches, and Lightning keeps the first "
        "epoch's length unless it reloads the train loader every epoch (a longer pass would be "
        "cut, a shorter one would skip its epoch-end validation). Set trainer "
        "reload_dataloaders_every_n_epochs=1, or train by steps with sampling.infinite=true and "
        "max_steps (as Detectron2 trains LVIS)")


def fit_epochs_to_passes(trainer: Any, loader: Any) -> None:
    """After a resume in epoch mode whose epoch has another length than the next ones (mid-
    pass, with another world size): have Lightning ask for a new loader every epoch
    (``trainer.reload_dataloaders_every_n_epochs = 1``), since it reads an epoch's length
    once per loader and each epoch must end with its pass."""
    plan = loader.batch_sampler
    natural = plan.length_at(*loader.position)
    if (trainer is None or plan.infinite or len(loader) == natural
            or trainer.reload_dataloaders_every_n_epochs):
        return
    log.info("data: the resumed epoch has %d batches, the next ones %d: the train loader is "
             "reloaded every epoch (reload_dataloaders_every_n_epochs=1)", len(loader), natural)
    trainer.reload_dataloaders_every_n_epochs = 1
