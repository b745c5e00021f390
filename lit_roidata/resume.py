"""Make Lightning's loop progress agree with the restored data-stream position.

:class:`~lit_roidata.loader.StatefulRoIDataLoader` saves the position after the batches
the model has *trained on*. Lightning's own progress counters do not always say the
same thing in a checkpoint written while something was interrupted (Ctrl-C, an
exception, ``OnExceptionCheckpoint``):

* interrupted between handing a batch out and counting it ``ready`` (moving it to the
  device, ``on_after_batch_transfer``) the batch is neither counted nor trained;
* interrupted inside the step, ``total.ready`` stays one ahead of the batches trained
  (a restart only rewinds the ``current`` counters), so everything Lightning schedules
  from ``total`` (validation with ``check_val_every_n_epoch=None``) moves one step;
* interrupted during validation, Lightning resumes the validation from the batch it
  reached, so callbacks that accumulate over the whole validation (COCO AP) see only
  the rest of it;
* resumed with another world size in epoch mode, the in-epoch counter was counted at
  the old size and the epoch ends at the wrong batch.

:func:`batches_in_flight` tells the loader, when a checkpoint is written, how many of
the batches it handed out were not trained on; :func:`align_fit_loop` rewrites the
restored counters (before the fit loop computes its restart stage) so that the resumed
run sees exactly the state of an uninterrupted run after ``T`` trained batches, and
reruns a validation that was interrupted (or not yet run) in full.

Lightning internals used (Lightning 2.5+, either namespace; covered by
``tests/test_lightning_internals.py``):
``fit_loop.epoch_loop.batch_progress`` (``total``/``current`` ready, started,
processed, completed; ``is_last_batch``), ``epoch_loop._batches_that_stepped``,
``epoch_loop.val_loop.batch_progress`` and its *mid-evaluation* restart pattern
(``started == ready``, ``processed == started - 1``, ``completed == processed``), and
``trainer.state.stage``/``status`` at save time.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

log = logging.getLogger(__name__)

__all__ = ["batches_in_flight", "save_phase", "align_fit_loop"]


def _fitting(trainer: Any) -> bool:
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    return fn is not None and str(getattr(fn, "value", fn)) == "fit"


def batches_in_flight(trainer: Any, consumed: int) -> int:
    """Batches handed to the training loop (``consumed``, counted by the loader over the
    run) but not trained on: ``consumed - batch_progress.total.processed``.

    0 outside ``fit``. 1 when the interrupt hit after the loader handed a batch out
    (fetch, device transfer, ``on_*_batch_transfer``, ``on_train_batch_start``, the step)
    and before Lightning counted it processed; 0 once the optimizer step is done
    (``on_train_batch_end`` callbacks, validation, logging).
    """
    if trainer is None or not _fitting(trainer):
        return 0
    processed = int(trainer.fit_loop.epoch_loop.batch_progress.total.processed)
    return max(0, int(consumed) - processed)


def save_phase(trainer: Any) -> dict[str, Any]:
    """What the trainer was doing when a checkpoint is written (stored with the data
    module's state; :func:`align_fit_loop` reads it back)."""
    if trainer is None:
        return {}
    state = trainer.state
    status = getattr(state.status, "value", state.status)
    stage = getattr(state.stage, "value", state.stage)
    return {"fn": getattr(state.fn, "value", state.fn), "stage": stage,
            "interrupted": str(status) == "interrupted"}


def _set(tracker: Any, value: int) -> None:
    for name in ("ready", "started", "processed", "completed"):
        if hasattr(tracker, name):
            setattr(tracker, name, int(value))


def _val_due(trainer: Any, total: int, current: int, n_batches: int) -> bool:
    """Would the fit loop validate after training batch ``total`` (``current`` in its
    epoch)? Lightning's ``_should_check_val_fx`` for batch-count schedules."""
    if not trainer.enable_validation:
        return False
    every = trainer.check_val_every_n_epoch
    if every is not None and (trainer.current_epoch + 1) % every != 0:
        return False
    interval = trainer.val_check_interval
    if every is None:
        return isinstance(interval, int) and interval > 0 and total % interval == 0
    if current >= n_batches:
        return True
    step = interval if isinstance(interval, int) else max(1, int(n_batches * float(interval)))
    return current > 0 and current % step == 0


def align_fit_loop(trainer: Any, loader: Any, phase: Optional[Mapping[str, Any]]) -> None:
    """Rewrite the restored fit-loop counters to agree with ``loader``'s position.

    Called from :meth:`StatefulRoIDataLoader.load_state_dict` (Lightning restores the
    loader after the loop progress and before the fit loop computes its restart stage).

    * every checkpoint: the in-epoch counter (``current``) is recomputed for this world
      size from the stream position (epoch mode: batches of the pass already trained at
      the new ``len(loader)``), so the epoch ends when the pass does;
    * a checkpoint written on an interruption (``phase["interrupted"]``): all batch
      counters are set to the ``T`` batches trained, ``_batches_that_stepped`` to ``T``,
      and a validation that was due after batch ``T`` but interrupted (or not yet run)
      is marked so Lightning reruns it from its first batch.
    """
    if trainer is None or not _fitting(trainer):
        return
    ep = trainer.fit_loop.epoch_loop
    bp = ep.batch_progress
    tot, cur = bp.total, bp.current
    n_new = len(loader)
    sampler = loader.batch_sampler
    trained = int(loader.consumed_batches)
    phase = dict(phase or {})
    offset = int(tot.processed) - int(cur.processed)  # batches of earlier epochs
    if trainer.limit_train_batches not in (1.0, None):
        c_new = None  # a user limit: leave Lightning's epoch length alone
    elif sampler.infinite:
        c_new = min(max(0, trained - offset), n_new)
    else:
        p, c = loader.position
        q, c2 = sampler.normalize(p, c)
        left = 0 if q != p else (sampler.blocks_per_pass - c2) // sampler.world_size
        c_new = max(0, n_new - left)
    if not phase.get("interrupted"):
        if c_new is not None:
            delta = c_new - (trained - offset)
            if delta:
                for name in ("ready", "started", "processed", "completed"):
                    setattr(cur, name, int(getattr(cur, name)) + delta)
                log.info("resume: in-epoch batch counter moved by %+d to match the data "
                         "stream at world size %d", delta, sampler.world_size)
        return
    c_new = trained - offset if c_new is None else c_new
    saved_bts = int(ep._batches_that_stepped)
    in_validation = phase.get("stage") in ("validate", "validating")
    # Interrupted between batch T's step and the end of its loop iteration
    # (on_train_batch_end callbacks, or before its validation ran).
    ended_iteration = saved_bts >= trained and not in_validation
    pending = _val_due(trainer, trained, c_new, n_new) and (
        in_validation or (trainer.accumulate_grad_batches == 1 and not ended_iteration))
    _set(tot, trained)
    _set(cur, c_new)
    bp.is_last_batch = bool(c_new >= n_new and not sampler.infinite)
    vp = ep.val_loop.batch_progress
    k = int(vp.total.completed)
    _set(vp.total, k)
    _set(vp.current, 0)
    if pending:
        # Lightning's "restarted mid-evaluation" pattern with nothing evaluated: the
        # resumed fit loop runs this validation again from its first batch.
        vp.total.ready = vp.total.started = k + 1
        ep._batches_that_stepped = trained - 1
    else:
        ep._batches_that_stepped = trained
    log.info("resume: %d batches trained; %s", trained,
             "the interrupted validation runs again in full" if pending
             else "training continues with the next batch")

