"""Progress bars that count optimizer steps out of ``max_steps`` when training by steps.

Lightning's bars count batches of the current epoch. With Detectron's endless stream
(``infinite=True``, training stops at ``max_steps``) that shows ``Epoch 0/-2`` and, after
a resume, more batches than the epoch has (``300/241``). :class:`StepProgressBar` (Rich,
Lightning's default when ``rich`` is installed) and :class:`StepTQDMProgressBar` show
``step k/max_steps`` instead, continuing from the resumed step, whenever ``max_steps`` is
set and ``max_epochs`` is not; otherwise they behave as Lightning's own bars.
``lit-roidata`` uses :class:`StepProgressBar` unless the config names another bar.
"""

from __future__ import annotations

from typing import Any, Union

import pytorch_lightning as pl
from pytorch_lightning.callbacks import RichProgressBar, TQDMProgressBar

__all__ = ["StepProgressBar", "StepTQDMProgressBar"]


def _by_steps(trainer: Any) -> bool:
    return (trainer is not None and trainer.max_steps is not None and trainer.max_steps > 0
            and trainer.max_epochs in (None, -1))


class StepProgressBar(RichProgressBar):
    """Lightning's Rich progress bar, counting ``global_step`` out of ``max_steps`` when
    training by steps (one bar for the whole run, not one per epoch)."""

    @property
    def total_train_batches(self) -> Union[int, float]:
        """``max_steps`` when training by steps, else Lightning's batches per epoch."""
        if _by_steps(self.trainer):
            return int(self.trainer.max_steps)
        return super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        if not _by_steps(self.trainer):
            return super()._get_train_description(current_epoch)
        text = "Step"
        if len(self.validation_description) > len(text):
            text = f"{text:{len(self.validation_description)}}"
        return text

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if _by_steps(trainer):
            self._update(self.train_progress_bar_id, int(trainer.global_step))

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if not _by_steps(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, int(trainer.global_step))
        self._update_metrics(trainer, pl_module)
        self.refresh()


class StepTQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, counting ``global_step`` out of ``max_steps`` when training
    by steps."""

    @property
    def total_train_batches(self) -> Union[int, float]:
        """``max_steps`` when training by steps, else Lightning's batches per epoch."""
        if _by_steps(self.trainer):
            return int(self.trainer.max_steps)
        return super().total_train_batches

    def _to_step(self, trainer: "pl.Trainer") -> None:
        if _by_steps(trainer) and self._train_progress_bar is not None:
            bar = self.train_progress_bar
            bar.total = int(trainer.max_steps)
            bar.set_description("Step")
            bar.n = bar.initial = int(trainer.global_step)
            bar.refresh()

    def on_train_start(self, trainer: "pl.Trainer", *args: Any) -> None:
        super().on_train_start(trainer, *args)
        self._to_step(trainer)  # a mid-epoch resume gets no on_train_epoch_start

    def on_train_epoch_start(self, trainer: "pl.Trainer", *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self._to_step(trainer)

    def on_train_batch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule",
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if not _by_steps(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        bar = self.train_progress_bar
        n = int(trainer.global_step)
        if bar is not None and self._should_update(n, bar.total):
            if not bar.disable:
                bar.n = n
                bar.refresh()
            bar.set_postfix(self.get_metrics(trainer, pl_module))
