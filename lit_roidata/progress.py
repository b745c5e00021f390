"""A progress bar that counts optimizer steps out of ``max_steps`` when training by steps.

With Detectron's endless stream (``infinite=True``, stop at ``max_steps``) Lightning's
per-epoch bar shows ``Epoch 0/-2`` and, after a resume, more batches than the epoch has.
:class:`StepTQDMProgressBar` shows ``Step k/max_steps`` instead (docs/callbacks.md), using
only ``TQDMProgressBar``'s public overrides.
"""

from __future__ import annotations

from typing import Any, Union

import pytorch_lightning as pl
from pytorch_lightning.callbacks import TQDMProgressBar

__all__ = ["StepTQDMProgressBar"]


def _by_steps(trainer: Any) -> bool:
    return (trainer is not None and trainer.max_steps is not None and trainer.max_steps > 0
            and trainer.max_epochs in (None, -1))


def _show_step(bar: Any, trainer: "pl.Trainer") -> None:
    """Set the tqdm ``bar`` to ``Step global_step/max_steps`` (continues a resumed run)."""
    bar.total = int(trainer.max_steps)
    bar.set_description("Step", refresh=False)
    bar.n = bar.initial = int(trainer.global_step)
    bar.refresh()


class StepTQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, counting ``global_step`` out of ``max_steps`` when training
    by steps (one bar for the whole run, not one per epoch)."""

    @property
    def total_train_batches(self) -> Union[int, float]:
        """``max_steps`` when training by steps, else Lightning's batches per epoch."""
        if _by_steps(self.trainer):
            return int(self.trainer.max_steps)
        return super().total_train_batches

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """Lightning's bar; by steps it starts at the (resumed) global step."""
        super().on_train_start(trainer, pl_module)
        if _by_steps(trainer):
            _show_step(self.train_progress_bar, trainer)

    def on_train_epoch_start(self, trainer: "pl.Trainer", *args: Any) -> None:
        """Lightning's per-epoch bar; by steps the one bar of the run goes on."""
        if not _by_steps(trainer):
            return super().on_train_epoch_start(trainer, *args)
        _show_step(self.train_progress_bar, trainer)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        """By steps: the bar shows ``global_step`` (every ``refresh_rate`` steps)."""
        if not _by_steps(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar, n = self.train_progress_bar, int(trainer.global_step)
        if self.is_enabled and (n % self.refresh_rate == 0 or n == bar.total):
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        """By steps the bar stays open across epochs (closed at the end of training)."""
        if not _by_steps(trainer):
            return super().on_train_epoch_end(trainer, pl_module)
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
