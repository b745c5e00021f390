"""Exact resume through a real Trainer, wherever the interrupt lands (issue: resume defects).

Every test compares a run interrupted at some point (``KeyboardInterrupt`` as Ctrl-C
raises it, or an exception) and resumed from ``OnExceptionCheckpoint``'s file with the
uninterrupted run: the batches trained (roidb indices, step by step), the steps at
which validation ran and how many batches it evaluated, and the learning rate at every
step must be identical.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lit_roidata import DemoRoIDataModule

from datamodule_support import TINY_MODEL, dm_kwargs


class Interrupt(Exception):
    """Raised instead of KeyboardInterrupt where Lightning would sys.exit."""


def _make_model(fail: dict | None) -> pl.LightningModule:
    from lit_roidata.demo import DemoFastRCNN

    class M(DemoFastRCNN):
        def _maybe_fail(self, where: str) -> None:
            if fail and fail["where"] == where and self.trainer.global_step == fail["step"] \
                    and not fail.get("done"):
                if where.startswith("val") and fail.get("val_batches", 0) > 0:
                    fail["val_batches"] -= 1
                    return
                fail["done"] = True
                raise fail.get("exc", KeyboardInterrupt)("simulated interrupt at " + where)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            self._maybe_fail("step")
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch: Any, batch_idx: int) -> Any:
            self._maybe_fail("val")
            return super().validation_step(batch, batch_idx)

    return M(**TINY_MODEL)


class Recorder(pl.Callback):
    """Trained batches, learning rates, validation runs; can fail in on_train_batch_end."""

    def __init__(self, fail: dict | None = None) -> None:
        self.trained: list[tuple[int, list[int]]] = []
        self.lrs: list[tuple[int, float]] = []
        self.vals: list[tuple[int, int]] = []
        self._nval = 0
        self.fail = fail

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.trained.append((trainer.global_step, list(batch["_meta"]["indices"])))
        self.lrs.append((trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"]))
        f = self.fail
        if f and f["where"] == "callback" and trainer.global_step == f["step"] \
                and not f.get("done"):
            f["done"] = True
            raise f.get("exc", KeyboardInterrupt)("simulated interrupt in a callback")

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        f = self.fail
        if f and f["where"] == "epoch_start" and trainer.current_epoch == f["step"] \
                and not f.get("done"):
            f["done"] = True
            raise f.get("exc", KeyboardInterrupt)("simulated interrupt at an epoch start")

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._nval = 0

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._nval += 1

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.vals.append((trainer.global_step, self._nval))


class FailingData(DemoRoIDataModule):
    """Fails while the main process builds a block (``num_workers=0``: the fetch) or
    while the batch is finished on the device (the transfer)."""

    fail: dict | None = None

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        fail = self.fail
        if fail and fail["where"] == "transfer" and self.trainer.training \
                and self.trainer.global_step == fail["step"] and not fail.get("done"):
            fail["done"] = True
            raise fail.get("exc", KeyboardInterrupt)("simulated interrupt in the transfer")
        return super().on_after_batch_transfer(batch, dataloader_idx)

    def train_dataloader(self) -> Any:
        loader = super().train_dataloader()
        ds, fail = loader.dataset, self.fail
        get = ds.__getitems__

        def getitems(block: Any) -> Any:
            if fail and fail["where"] == "fetch" and self.trainer.global_step == fail["step"] \
                    and not fail.get("done"):
                fail["done"] = True
                raise fail.get("exc", KeyboardInterrupt)("simulated interrupt while fetching")
            return get(block)

        ds.__getitems__ = getitems
        return loader


def _fit(tmp: Path, kw: dict, steps: int, *, fail: dict | None = None, ckpt: str | None = None,
         val_every: int = 4, devices: int = 1, **trainer_kw: Any) -> Recorder:
    rec = Recorder(fail)
    dm = FailingData(**kw)
    dm.fail = fail
    on_exc = pl.callbacks.OnExceptionCheckpoint(dirpath=str(tmp / "exc"))
    every = pl.callbacks.ModelCheckpoint(dirpath=str(tmp / "steps"), every_n_train_steps=3,
                                         save_top_k=-1, save_weights_only=True)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp),
                         num_sanity_val_steps=0, check_val_every_n_epoch=None,
                         val_check_interval=val_every, callbacks=[rec, on_exc, every],
                         **trainer_kw)
    pl.seed_everything(0)
    old = signal.getsignal(signal.SIGINT)
    try:
        trainer.fit(_make_model(fail), datamodule=dm, ckpt_path=ckpt)
    except SystemExit:  # Lightning's KeyboardInterrupt path exits with 1
        pass
    except RuntimeError as e:
        assert "simulated" in str(e)
    finally:
        signal.signal(signal.SIGINT, old)
    return rec


def _check_resume(root: Path, tmp_path: Path, where: str, *, infinite: bool, workers: int = 0,
                  step: int = 4, exc: type = KeyboardInterrupt, steps: int = 9,
                  val_batches: int = 0, val_every: int = 4) -> None:
    kw = dm_kwargs(root, num_workers=workers, infinite=infinite)
    ref = _fit(tmp_path / "ref", kw, steps, val_every=val_every)
    fail = {"where": where, "step": step, "exc": exc, "val_batches": val_batches}
    first = _fit(tmp_path / "run", kw, steps, fail=fail, val_every=val_every)
    assert fail.get("done"), "the interrupt was not reached"
    ckpt = tmp_path / "run" / "exc" / "on_exception.ckpt"
    assert ckpt.is_file()
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    loader_state = state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    # The saved stream position is the batches the model trained on (its global step).
    assert loader_state["consumed_batches"] == state["global_step"] == len(first.trained)
    second = _fit(tmp_path / "run", kw, steps, ckpt=str(ckpt), val_every=val_every)
    assert first.trained + second.trained == ref.trained
    assert first.lrs + second.lrs == ref.lrs
    # Validation at the same steps, each one complete (an interrupted one is rerun).
    assert first.vals + second.vals == ref.vals, (first.vals, second.vals, ref.vals)
    # Checkpoints by step at the same steps (except one whose on_train_batch_end was
    # interrupted before ModelCheckpoint's turn: those hooks are not rerun).
    assert _saved(tmp_path / "ref")
    if where != "callback" or step % 3:
        assert _saved(tmp_path / "run") == _saved(tmp_path / "ref")


def _saved(run: Path) -> list[str]:
    return sorted(p.name.split("-")[-1] for p in (run / "steps").glob("*.ckpt"))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["fetch", "transfer", "step", "callback"])
@pytest.mark.parametrize("infinite", [True, False])
def test_ctrl_c_anywhere_in_a_training_step_resumes_exactly(root: Path, tmp_path: Path,
                                                             where: str, infinite: bool) -> None:
    _check_resume(root, tmp_path, where, infinite=infinite)


@pytest.mark.slow
@pytest.mark.parametrize("infinite", [False, True])
def test_ctrl_c_at_an_epoch_start_resumes_exactly(root: Path, tmp_path: Path,
                                                  infinite: bool) -> None:
    """Interrupted in ``on_train_epoch_start`` of epoch 1: the next epoch is not skipped."""
    kw = dm_kwargs(root, infinite=infinite)
    dm = DemoRoIDataModule(**kw)
    dm.prepare_data()
    dm.setup("fit")
    n = len(dm.train_dataloader())
    dm._train_loader = None
    _check_resume(root, tmp_path, "epoch_start", infinite=infinite, step=1, steps=n + 3,
                  val_every=10_000)


@pytest.mark.parametrize("step", [3, 4])
def test_exception_in_the_callback_of_a_validation_step_resumes_exactly(
        root: Path, tmp_path: Path, step: int) -> None:
    """Interrupted in ``on_train_batch_end`` of the batch after which validation is due
    (step 4) or not (3): validation still runs at 4 and 8, complete."""
    _check_resume(root, tmp_path, "callback", infinite=True, step=step, exc=RuntimeError)


@pytest.mark.parametrize("infinite,val_batches", [(True, 0), (True, 3), (False, 3)])
def test_interrupted_validation_is_rerun_in_full(root: Path, tmp_path: Path, infinite: bool,
                                                 val_batches: int) -> None:
    _check_resume(root, tmp_path, "val", infinite=infinite, step=4, val_batches=val_batches)


@pytest.mark.slow
def test_ctrl_c_in_the_transfer_with_two_workers(root: Path, tmp_path: Path) -> None:
    _check_resume(root, tmp_path, "transfer", infinite=False, workers=2, step=5)


@pytest.mark.slow
def test_reload_dataloaders_in_infinite_mode_continues_the_stream(root: Path,
                                                                  tmp_path: Path) -> None:
    """reload_dataloaders_every_n_epochs=1 builds a new loader each epoch; the stream must
    go on (not restart at pass 0, block 0)."""
    kw = dm_kwargs(root, infinite=True)
    dm = DemoRoIDataModule(**kw)
    dm.prepare_data()
    dm.setup("fit")
    n = len(dm.train_dataloader())
    dm._train_loader = None
    steps = n + 3
    ref = _fit(tmp_path / "ref", kw, steps, val_every=10_000)
    reloaded = _fit(tmp_path / "reload", kw, steps, val_every=10_000,
                    reload_dataloaders_every_n_epochs=1)
    assert reloaded.trained == ref.trained


def test_lightning_internals_we_rely_on(root: Path, tmp_path: Path) -> None:
    """The progress counters and restart patterns lit_roidata.resume reads and writes
    exist and mean what it assumes (fails loudly on a Lightning upgrade that changes them)."""
    from pytorch_lightning.loops.progress import _BatchProgress, _Progress

    kw = dm_kwargs(root, infinite=True)
    seen: dict[str, Any] = {}

    class Probe(pl.Callback):
        def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
            bp = trainer.fit_loop.epoch_loop.batch_progress
            seen.setdefault("start", (bp.total.ready, bp.total.processed,
                                      trainer.datamodule._train_loader.consumed_batches))

        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            bp = trainer.fit_loop.epoch_loop.batch_progress
            seen.setdefault("end", (bp.total.ready, bp.total.processed, bp.total.completed,
                                    trainer.fit_loop.epoch_loop._batches_that_stepped))

    trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path), limit_val_batches=0,
                         callbacks=[Probe()])
    trainer.fit(_make_model(None), datamodule=DemoRoIDataModule(**kw))
    ep = trainer.fit_loop.epoch_loop
    assert isinstance(ep.batch_progress, _BatchProgress)
    assert isinstance(ep.val_loop.batch_progress, _BatchProgress)
    assert isinstance(ep.batch_progress.total.processed, int)
    assert hasattr(ep, "_batches_that_stepped")
    # ready counted before the step, processed after it, loader counts at hand-out.
    assert seen["start"] == (1, 0, 1)
    assert seen["end"] == (1, 1, 0, 0)
    assert ep._batches_that_stepped == 2
    # The restart patterns resume.align_fit_loop produces.
    vl = ep.val_loop
    vl.restarting = True
    for name, v in (("ready", 3), ("started", 3), ("processed", 2), ("completed", 2)):
        setattr(vl.batch_progress.total, name, v)
    vl.update_restart_stage()
    assert vl.restarted_mid_evaluation
    ep.restarting = True
    for t in (ep.batch_progress.total, ep.batch_progress.current):
        for name in ("ready", "started", "processed", "completed"):
            setattr(t, name, 5)
    ep.update_restart_stage()
    assert ep.restarted_on_last
    assert isinstance(_Progress().total.ready, int)
    # The fit loop restores loader state after the loop counters, before reset().
    import inspect

    src = inspect.getsource(type(trainer.fit_loop).setup_data)
    assert "_load_combined_loader_states" in src
    # The CLI hides ModelCheckpoint's last.ckpt from Lightning's implicit "last" lookup.
    assert callable(getattr(pl.callbacks.ModelCheckpoint, "_find_last_checkpoints", None))


class FakeWorld(FailingData):
    """Rank 0 of ``world`` processes, in one process: the loader and Lightning's epoch
    length are those of that world size (what an elastic resume changes)."""

    world = 1

    def _rank_world(self) -> tuple[int, int]:
        return 0, self.world


class PosRecorder(Recorder):
    def __init__(self, fail: dict | None = None) -> None:
        super().__init__(fail)
        self.positions: list[tuple[int, int]] = []
        self.epochs: list[int] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        meta = batch["_meta"]
        self.positions.append((int(meta["pass_index"]), int(meta["block_index"])))
        self.epochs.append(trainer.current_epoch)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def _fit_world(tmp: Path, kw: dict, steps: int, world: int, *, fail: dict | None = None,
               ckpt: str | None = None, every: int | None = None) -> PosRecorder:
    rec = PosRecorder(fail)
    dm = FakeWorld(**kw)
    dm.world, dm.fail = world, fail
    cbs = [rec, pl.callbacks.OnExceptionCheckpoint(dirpath=str(tmp / "exc")),
           pl.callbacks.ModelCheckpoint(dirpath=str(tmp / "ckpt"), every_n_train_steps=every,
                                        save_top_k=-1)]
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp), limit_val_batches=0, callbacks=cbs)
    old = signal.getsignal(signal.SIGINT)
    try:
        trainer.fit(_make_model(fail), datamodule=dm, ckpt_path=ckpt)
    except SystemExit:
        pass
    finally:
        signal.signal(signal.SIGINT, old)
    return rec


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(1, 2), (2, 1)])
@pytest.mark.parametrize("how", ["interrupt", "checkpoint"])
def test_epoch_mode_elastic_resume_keeps_epochs_and_passes_together(
        root: Path, tmp_path: Path, before: int, after: int, how: str) -> None:
    """Epoch mode, resumed with another world size mid-pass: the rest of the pass is
    trained (every global block once, the tail shorter than a global minibatch left out)
    and Lightning's next epoch starts with the next pass, not earlier."""
    kw = dm_kwargs(root, infinite=False)
    dm = DemoRoIDataModule(**kw)
    dm.prepare_data()
    dm.setup("fit")
    bpp = dm.make_sampler().blocks_per_pass
    s1 = max(1, bpp // (3 * before))  # steps before the resume, early in the pass
    if how == "interrupt":
        fail = {"where": "step", "step": s1}
        first = _fit_world(tmp_path, kw, 10_000, before, fail=fail)
        ckpt = tmp_path / "exc" / "on_exception.ckpt"
    else:
        # A ModelCheckpoint written mid-epoch (on_train_batch_end of step s1).
        first = _fit_world(tmp_path, kw, s1 + 1, before, every=s1)
        ckpt = tmp_path / "ckpt" / f"epoch=0-step={s1}.ckpt"
        first.positions = first.positions[:s1]
    assert len(first.positions) == s1
    cursor = s1 * before
    left = (bpp - cursor) // after
    extra = 3
    second = _fit_world(tmp_path / "b", kw, s1 + left + extra, after, ckpt=str(ckpt))
    expected = ([(0, cursor + k * after) for k in range(left)]
                + [(1, k * after) for k in range(extra)])
    assert second.positions == expected
    assert second.epochs == [0] * left + [1] * extra


@pytest.mark.parametrize("infinite", [False, True])
def test_align_makes_epoch_length_and_progress_agree_at_every_resume_step(infinite: bool) -> None:
    """For every step of a pass and every 1/2/3 -> 1/2/3 world-size change, the restored
    in-epoch counter plus the batches the loader will still yield this pass is
    ``len(loader)``: Lightning ends the epoch exactly when the pass ends."""
    import numpy as np
    from pytorch_lightning.trainer.states import TrainerFn

    from lit_roidata.loader import StatefulRoIDataLoader
    from lit_roidata.resume import align_fit_loop
    from lit_roidata.sampler import RoIBatchSampler

    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    trainer.state.fn = TrainerFn.FITTING
    bp = trainer.fit_loop.epoch_loop.batch_progress
    w, h = np.full(23, 8), np.full(23, 6)  # 23 blocks of 1 image: odd, so tails exist
    for before in (1, 2, 3):
        old = RoIBatchSampler(w, h, 1, seed=1, world_size=before, infinite=infinite)
        for step in range(len(old) + 1):
            state = {"sampler": old.state_at(*old.advance(2, 0, step)),
                     "consumed_batches": 50 + step}
            for after in (1, 2, 3):
                new = RoIBatchSampler(w, h, 1, seed=1, world_size=after, infinite=infinite)
                loader = StatefulRoIDataLoader(_Plain(), new)
                for t in (bp.total, bp.current):
                    for name in ("ready", "started", "processed", "completed"):
                        setattr(t, name, (50 if t is bp.total else 0) + step)
                loader.load_state_dict(state)
                align_fit_loop(trainer, loader, {"fn": "fit", "stage": "train"})
                # blocks this rank still draws from the saved pass (the sampler rolls
                # into the next pass when fewer than `after` blocks are left)
                remaining = sum(1 for b in loader.batch_sampler if b.pass_index == 2) \
                    if not infinite else None
                if infinite:
                    assert bp.current.ready == min(step, len(loader))
                else:
                    assert bp.current.ready + remaining == len(loader), (before, after, step)
                    assert bp.total.ready == 50 + step  # the global step is untouched


class _Plain:
    def __getitems__(self, block: Any) -> Any:
        return list(block)
