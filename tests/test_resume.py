"""Exact stops and resumes through a real Trainer, in both Lightning namespaces.

Graceful stops: a SIGINT or SIGTERM (``os.kill`` of this process, or of the main process
from a DataLoader worker) lands at every point of training and validation: while a batch
is fetched, moved to the device, in the step, in a callback, during a validation, at an
epoch start. ``GracefulStop`` stops at the next clean step boundary and writes its
checkpoint; the run resumed from it gives, with the interrupted part, exactly the run
that was never interrupted: the batches trained (roidb indices per step), the learning
rate per step, the validations (at which step, how many batches, the COCO box AP and a
checksum of the weights they saw) and the step checkpoints of a ``ModelCheckpoint``.

Aborts (a second Ctrl-C) and exceptions write ``OnExceptionCheckpoint``'s file; the run
resumed from it trains exactly the batches, with exactly the learning rates, of the
uninterrupted run. (What Lightning's own counters do after such a resume, e.g. the
validation schedule, is Lightning's behaviour: docs/ddp_and_resume.md.)

The same tests run at the newest Lightning and at the lowest supported one (2.4).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
import torch.utils.data

from lit_roidata import DemoRoIDataModule
from lit_roidata.callbacks import GracefulStop
from lit_roidata.demo import DemoFastRCNN
from lit_roidata.evaluation import COCOEvaluator

from datamodule_support import TINY_MODEL, dm_kwargs

SIGINT, SIGTERM = signal.SIGINT, signal.SIGTERM


def _fire(plan: dict, where: str) -> None:
    """Deliver ``plan``'s signal(s) to this process, or raise its exception, once."""
    if plan["where"] != where or plan.get("fired"):
        return
    plan["fired"] = True
    if "exc" in plan:
        raise plan["exc"](f"simulated failure at {where}")
    for _ in range(plan.get("times", 1)):  # 2: the second signal aborts
        os.kill(os.getpid(), plan["sig"])


class _RecorderHooks:
    """Records what the run trained and validated; delivers the plan's signal."""

    def __init__(self, plan: Optional[dict] = None) -> None:
        self.plan = plan or {"where": None}
        self.trained: list[tuple[int, list[int]]] = []
        self.lrs: list[tuple[int, float]] = []
        self.vals: list[tuple[int, int, float, float]] = []
        self.positions: list[tuple[int, int]] = []
        self.epochs: list[int] = []
        self._nval = 0

    def _at(self, where: str, trainer: Any) -> None:
        if self.plan.get("step", trainer.global_step) == trainer.global_step:
            _fire(self.plan, where)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.plan["where"] == "fetch":
            _patch_fetch(trainer.train_dataloader.dataset, self.plan)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            _fire(self.plan, "epoch_start")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._at("step", trainer)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        meta = batch["_meta"]
        self.trained.append((trainer.global_step, list(meta["indices"])))
        self.positions.append((int(meta["pass_index"]), int(meta["block_index"])))
        self.epochs.append(trainer.current_epoch)
        self.lrs.append((trainer.global_step, trainer.optimizers[0].param_groups[0]["lr"]))
        self._at("callback", trainer)

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self._nval = 0

    def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                  batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx == 1 and not trainer.sanity_checking:
            self._at("validation", trainer)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._nval += 1

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.sanity_checking:
            return
        ap = float(trainer.callback_metrics["val/bbox_AP"])
        weights = float(sum(p.detach().double().sum() for p in pl_module.parameters()))
        self.vals.append((trainer.global_step, self._nval, ap, weights))


def _patch_fetch(dataset: Any, plan: dict) -> None:
    """Deliver the plan's signal (to the main process) or raise while block
    ``plan["block"]`` of pass 0 is built: in the main process without workers, in a worker
    otherwise (a file marks it done across processes)."""
    build, marker = dataset.__getitems__, plan["marker"]

    def getitems(block: Any) -> Any:
        if block.pass_index == 0 and block.block_index == plan["block"]:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return build(block)
            if "exc" in plan:
                raise plan["exc"]("simulated failure while fetching")
            worker = torch.utils.data.get_worker_info() is not None
            for k in range(plan.get("times", 1)):
                if k:  # signals sent back to back would merge into one
                    time.sleep(0.3)
                os.kill(os.getppid() if worker else os.getpid(), plan["sig"])
        return build(block)

    dataset.__getitems__ = getitems


def _data_module(ns: Any, kw: dict, plan: Optional[dict], world: int = 1) -> Any:
    dm = ns.lit(DemoRoIDataModule)(**kw)
    if world > 1:  # rank 0 of `world` processes, in this one (what an elastic resume changes)
        dm._rank_world = lambda: (0, world)
    if plan and plan["where"] == "transfer":
        finish = dm.on_after_batch_transfer

        def transfer(batch: Any, dataloader_idx: int) -> Any:
            if dm.trainer.training and dm.trainer.global_step == plan["step"]:
                _fire(plan, "transfer")
            return finish(batch, dataloader_idx)

        dm.on_after_batch_transfer = transfer
    return dm


def _make_model(fail: Optional[dict] = None) -> Any:
    """The tiny demo model (``fail`` is unused; kept for tests that import it)."""
    return DemoFastRCNN(**TINY_MODEL)


class Run:
    """What one ``fit`` did: the recorder, the trainer, its GracefulStop, its folder."""

    def __init__(self, rec: Any, trainer: Any, stop: Any, folder: Path) -> None:
        self.rec, self.trainer, self.stop, self.folder = rec, trainer, stop, folder

    def saved_steps(self) -> list[str]:
        return sorted(p.name.split("-")[-1] for p in (self.folder / "steps").glob("*.ckpt"))


def _fit(ns: Any, folder: Path, kw: dict, steps: int, *, infinite: bool,
         plan: Optional[dict] = None, ckpt: Optional[str] = None, world: int = 1,
         **trainer_kw: Any) -> Run:
    rec = ns.callback(_RecorderHooks)(plan)
    stop = ns.lit(GracefulStop)()
    options = dict(check_val_every_n_epoch=None, val_check_interval=4) if infinite else dict(
        check_val_every_n_epoch=1, val_check_interval=3)
    if kw.get("sampling", {}).get("epoch_length"):  # validation at every epoch end
        options = dict(check_val_every_n_epoch=1)
    options["limit_val_batches"] = 3
    options.update(trainer_kw)
    callbacks = [rec, ns.lit(COCOEvaluator)(print_summary=False), stop,
                 ns.callbacks.OnExceptionCheckpoint(dirpath=str(folder / "exc")),
                 ns.callbacks.ModelCheckpoint(dirpath=str(folder / "steps"),
                                              every_n_train_steps=3, save_top_k=-1,
                                              save_weights_only=True)]
    trainer = ns.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(folder), num_sanity_val_steps=0,
                         callbacks=callbacks, **options)
    ns.seed_everything(0)
    handlers = {s: signal.getsignal(s) for s in (SIGINT, SIGTERM)}
    try:
        trainer.fit(ns.lit(DemoFastRCNN)(**TINY_MODEL),
                    datamodule=_data_module(ns, kw, plan, world), ckpt_path=ckpt)
    except SystemExit:  # Lightning's KeyboardInterrupt path exits with 1
        pass
    except RuntimeError as e:
        if "simulated" not in str(e):
            raise
    finally:
        for s, h in handlers.items():  # Lightning leaves SIGINT ignored after an abort
            signal.signal(s, h)
    return Run(rec, trainer, stop, folder)


def _epoch_length(root: Path) -> int:
    dm = DemoRoIDataModule(**dm_kwargs(root))
    dm.setup("fit")
    return len(dm.make_sampler())


_REFERENCE: dict[tuple, Run] = {}


def _reference(ns: Any, tmp_path_factory: Any, kw: dict, steps: int, infinite: bool,
               **trainer_kw: Any) -> Run:
    """The uninterrupted run (once per configuration and session)."""
    key = (ns.name, repr(sorted(kw.items())), steps, infinite, repr(sorted(trainer_kw.items())))
    if key not in _REFERENCE:
        _REFERENCE[key] = _fit(ns, tmp_path_factory.mktemp("reference"), kw, steps,
                               infinite=infinite, **trainer_kw)
    return _REFERENCE[key]


def _expected_stop(seen: int, ref: Run, n: int) -> int:
    """The step a signal first seen at the end of step ``seen`` stops after: the first
    boundary that is not right after a validation nor an epoch's first fetch."""
    validated = {v[0] for v in ref.rec.vals}
    return seen + 1 if seen in validated or seen % n == 0 else seen


# Where the signal lands: (point, trainer.global_step when it lands, step whose end sees it).
# Infinite mode validates after steps 4, 8, ...; epoch mode after batches 3, 6, ... of an
# epoch: each point is placed so that a validation is due right after the step that sees it.
_POINTS = {
    True: {"fetch": 3, "transfer": 3, "step": 3, "callback": 4, "validation": 4},
    False: {"fetch": 2, "transfer": 2, "step": 2, "callback": 3, "validation": 3},
}


def _check_graceful(ns: Any, root: Path, tmp_path: Path, tmp_path_factory: Any, where: str,
                    sig: int, *, infinite: bool, workers: int) -> None:
    n = _epoch_length(root)
    steps = n + 6  # every run crosses an epoch boundary
    kw = dm_kwargs(root, num_workers=workers, infinite=infinite)
    ref = _reference(ns, tmp_path_factory, kw, steps, infinite)
    at = _POINTS[infinite].get(where, n)
    plan = {"where": where, "step": at, "sig": sig, "block": at,
            "marker": str(tmp_path / "fired")}
    first = _fit(ns, tmp_path / "run", kw, steps, infinite=infinite, plan=plan)
    assert plan.get("fired") or os.path.exists(plan["marker"]), "the signal was not sent"
    stop, trainer = first.stop, first.trainer
    assert stop.stopped_by_signal == sig, "fit was not stopped by the signal"
    assert trainer.global_step == len(first.rec.trained) < steps
    seen = {"callback": at, "validation": at + 1, "epoch_start": n + 1}.get(where, at + 1)
    if not (where == "fetch" and workers):  # a worker's fetch runs ahead of training
        assert trainer.global_step == _expected_stop(seen, ref, n)
    ckpt = Path(stop.stopped_at)
    assert ckpt.name == "interrupted.ckpt" and ckpt.parent == tmp_path / "run" / "exc"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    loader_state = state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    assert loader_state["consumed_batches"] == state["global_step"] == trainer.global_step
    assert next(v["trainer_fn"] for v in state.values()
                if isinstance(v, dict) and "trainer_fn" in v) == "fit"

    second = _fit(ns, tmp_path / "run", kw, steps, infinite=infinite, ckpt=str(ckpt))
    assert second.stop.stopped_by_signal is None
    assert not ckpt.exists()  # a fit that ended by itself removes the stale stop checkpoint
    assert first.rec.trained + second.rec.trained == ref.rec.trained
    assert first.rec.lrs + second.rec.lrs == ref.rec.lrs
    assert first.rec.vals + second.rec.vals == ref.rec.vals, (first.rec.vals,
                                                               second.rec.vals)
    assert first.saved_steps() == ref.saved_steps()


@pytest.mark.parametrize("where,sig,infinite", [
    ("step", SIGINT, True),
    ("validation", SIGTERM, False),
])
def test_graceful_stop_resumes_exactly(root: Path, tmp_path: Path, tmp_path_factory: Any,
                                       lightning_ns: Any, where: str, sig: int,
                                       infinite: bool) -> None:
    _check_graceful(lightning_ns, root, tmp_path, tmp_path_factory, where, sig,
                    infinite=infinite, workers=0)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["fetch", "transfer", "step", "callback", "validation",
                                   "epoch_start"])
@pytest.mark.parametrize("sig", [SIGINT, SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("infinite", [True, False], ids=["infinite", "epochs"])
def test_graceful_stop_anywhere_resumes_exactly(root: Path, tmp_path: Path,
                                                tmp_path_factory: Any, lightning_ns: Any,
                                                where: str, sig: int, infinite: bool) -> None:
    _check_graceful(lightning_ns, root, tmp_path, tmp_path_factory, where, sig,
                    infinite=infinite, workers=0)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["fetch", "step", "validation", "epoch_start"])
@pytest.mark.parametrize("infinite", [True, False], ids=["infinite", "epochs"])
def test_graceful_stop_with_two_workers_resumes_exactly(root: Path, tmp_path: Path,
                                                        tmp_path_factory: Any,
                                                        lightning_ns: Any, where: str,
                                                        infinite: bool) -> None:
    """Workers ignore the signal (a terminal's Ctrl-C reaches them too); with "fetch" a
    worker sends it to the main process while it builds a block."""
    _check_graceful(lightning_ns, root, tmp_path, tmp_path_factory, where, SIGINT,
                    infinite=infinite, workers=2)


def test_graceful_stop_waits_for_the_end_of_an_accumulation_window(
        root: Path, tmp_path: Path, tmp_path_factory: Any, lightning_ns: Any) -> None:
    """``accumulate_grad_batches=2``: a signal after the first batch of a window stops
    after the second (never with half-accumulated gradients), and resumes exactly."""
    ns = lightning_ns
    kw = dm_kwargs(root, infinite=True)
    ref = _reference(ns, tmp_path_factory, kw, 8, True, accumulate_grad_batches=2)
    plan = {"where": "callback", "step": 2, "sig": SIGINT}
    first = _fit(ns, tmp_path, kw, 8, infinite=True, plan=plan, accumulate_grad_batches=2)
    # the signal at the end of batch 5 (global step 2): the window of batches 5-6 completes
    assert first.stop.stopped_by_signal == SIGINT and len(first.rec.trained) == 6
    assert first.trainer.global_step == 3
    second = _fit(ns, tmp_path, kw, 8, infinite=True, ckpt=first.stop.stopped_at,
                  accumulate_grad_batches=2)
    assert first.rec.trained + second.rec.trained == ref.rec.trained
    assert first.rec.lrs + second.rec.lrs == ref.rec.lrs
    assert first.rec.vals + second.rec.vals == ref.rec.vals


# ------------------------------------------------------------------ aborts and exceptions
def _check_abort(ns: Any, root: Path, tmp_path: Path, tmp_path_factory: Any, plan: dict, *,
                 infinite: bool, workers: int = 0, vals: bool = True, **changes: Any) -> None:
    n = _epoch_length(root)
    steps = n + 6
    kw = dm_kwargs(root, num_workers=workers, infinite=infinite, **changes)
    ref = _reference(ns, tmp_path_factory, kw, steps, infinite)
    plan.setdefault("marker", str(tmp_path / "fired"))
    first = _fit(ns, tmp_path, kw, steps, infinite=infinite, plan=plan)
    assert plan.get("fired") or os.path.exists(plan["marker"])
    assert first.stop.stopped_by_signal is None  # aborted, not stopped
    ckpt = tmp_path / "exc" / "on_exception.ckpt"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    loader_state = state["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]
    # The saved position is after the batches trained (own accounting), whatever
    # Lightning's counters say.
    assert loader_state["consumed_batches"] == state["global_step"] == len(first.rec.trained)
    second = _fit(ns, tmp_path, kw, steps, infinite=infinite, ckpt=str(ckpt))
    assert first.rec.trained + second.rec.trained == ref.rec.trained
    assert first.rec.lrs + second.rec.lrs == ref.rec.lrs
    if vals:  # the same validation steps, batches, AP and weights
        assert first.rec.vals + second.rec.vals == ref.rec.vals, (first.rec.vals,
                                                                  second.rec.vals)


@pytest.mark.parametrize("where", ["step", "validation"])
def test_second_ctrl_c_aborts_and_the_stream_resumes_exactly(
        root: Path, tmp_path: Path, tmp_path_factory: Any, lightning_ns: Any,
        where: str) -> None:
    """Two Ctrl-C in a row: the second aborts before the next batch is handed out
    (Lightning's KeyboardInterrupt path, OnExceptionCheckpoint), so the re-run validates at
    the same steps as an uninterrupted run; a running validation completes first."""
    plan = {"where": where, "step": 4, "sig": SIGINT, "times": 2}
    _check_abort(lightning_ns, root, tmp_path, tmp_path_factory, plan, infinite=True)


@pytest.mark.parametrize("where,infinite", [
    ("fetch", False), ("transfer", True), ("step", False), ("callback", True),
    ("validation", False)])
def test_exception_resumes_the_stream_exactly(root: Path, tmp_path: Path,
                                              tmp_path_factory: Any, where: str,
                                              infinite: bool) -> None:
    from conftest import LightningNamespace

    plan = {"where": where, "step": 3, "exc": RuntimeError, "block": 3}
    # An exception inside a validation: Lightning does not run that validation again
    # (docs/ddp_and_resume.md); the stream and learning rates are still exact.
    _check_abort(LightningNamespace("pytorch_lightning"), root, tmp_path, tmp_path_factory,
                 plan, infinite=infinite, vals=where != "validation")


@pytest.mark.parametrize("where", ["step", "transfer", "callback"])
def test_exception_with_epoch_length_validates_at_the_same_steps(
        root: Path, tmp_path: Path, tmp_path_factory: Any, where: str) -> None:
    """Infinite mode with ``sampling.epoch_length`` and validation at every epoch end: an
    exception inside a step (where Lightning's total batch count runs one ahead) still
    resumes with the same validation steps, AP and weights."""
    from conftest import LightningNamespace

    plan = {"where": where, "step": 5, "exc": RuntimeError}
    _check_abort(LightningNamespace("pytorch_lightning"), root, tmp_path, tmp_path_factory,
                 plan, infinite=True, epoch_length=4)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["fetch", "transfer", "step", "callback", "validation",
                                   "epoch_start"])
@pytest.mark.parametrize("workers", [0, 2])
def test_abort_anywhere_resumes_the_stream_exactly(root: Path, tmp_path: Path,
                                                   tmp_path_factory: Any, lightning_ns: Any,
                                                   where: str, workers: int) -> None:
    """KeyboardInterrupt at every point (with workers, "fetch" is a double Ctrl-C that a
    worker sends to the main process waiting for its block); infinite mode without
    workers, epoch mode with them."""
    infinite = workers == 0
    at = _POINTS[infinite].get(where, 0)
    plan = {"where": where, "step": at, "exc": KeyboardInterrupt, "block": at}
    if where == "fetch" and workers:  # while the main process waits for the first batch
        plan = {"where": where, "sig": SIGINT, "times": 2, "block": 0}
    # A KeyboardInterrupt raised in place (not a signal: GracefulStop would move that
    # abort between two steps) inside a step, a callback or a validation leaves Lightning's
    # schedule Lightning's (docs/ddp_and_resume.md); the stream and LRs are exact anyway.
    _check_abort(lightning_ns, root, tmp_path, tmp_path_factory, plan, infinite=infinite,
                 workers=workers, vals=where in ("fetch", "transfer", "epoch_start"))


# --------------------------------------------------------------- reload and elastic resume
@pytest.mark.slow
def test_reload_dataloaders_continues_the_stream(root: Path, tmp_path: Path,
                                                 tmp_path_factory: Any,
                                                 lightning_ns: Any) -> None:
    """``reload_dataloaders_every_n_epochs=1``: each epoch's new loader continues the
    stream (in infinite mode a new loader would otherwise restart at pass 0)."""
    steps = _epoch_length(root) + 3
    kw = dm_kwargs(root, infinite=True)
    ref = _reference(lightning_ns, tmp_path_factory, kw, steps, True)
    reloaded = _fit(lightning_ns, tmp_path, kw, steps, infinite=True,
                    reload_dataloaders_every_n_epochs=1)
    assert reloaded.rec.trained == ref.rec.trained


@pytest.mark.slow
def test_graceful_stop_reaches_a_reloaded_loader(root: Path, tmp_path: Path,
                                                 tmp_path_factory: Any) -> None:
    """A signal at the last batch of an epoch with ``reload_dataloaders_every_n_epochs``:
    the next epoch's new loader stops after its first batch; the resume is exact."""
    from conftest import LightningNamespace

    ns = LightningNamespace("pytorch_lightning")
    n = _epoch_length(root)
    kw = dm_kwargs(root, infinite=True)
    ref = _reference(ns, tmp_path_factory, kw, n + 6, True, reload_dataloaders_every_n_epochs=1)
    plan = {"where": "callback", "step": n, "sig": SIGINT}
    first = _fit(ns, tmp_path, kw, n + 6, infinite=True, plan=plan,
                 reload_dataloaders_every_n_epochs=1)
    assert first.stop.stopped_by_signal == SIGINT and first.trainer.global_step == n + 1
    second = _fit(ns, tmp_path, kw, n + 6, infinite=True, ckpt=first.stop.stopped_at,
                  reload_dataloaders_every_n_epochs=1)
    assert first.rec.trained + second.rec.trained == ref.rec.trained
    assert first.rec.vals + second.rec.vals == ref.rec.vals


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(1, 2), (2, 1)])
@pytest.mark.parametrize("how", ["stop", "abort"])
@pytest.mark.parametrize("workers", [0, 2])
def test_elastic_resume_in_epoch_mode_is_exactly_once(root: Path, tmp_path: Path,
                                                      before: int, after: int,
                                                      how: str, workers: int) -> None:
    """Resumed with another world size mid-pass: the rest of the pass is trained in the
    same epoch (every global block once, the tail shorter than a global minibatch left
    out), and the next epoch is the next pass from its start. Rank 0 of the world, in
    this process."""
    from conftest import LightningNamespace

    ns = LightningNamespace("pytorch_lightning")
    kw = dm_kwargs(root, infinite=False, num_workers=workers)
    bpp = _epoch_length(root)
    s1 = max(1, bpp // (3 * before))
    plan = ({"where": "callback", "step": s1, "sig": SIGINT} if how == "stop" else
            {"where": "step", "step": s1, "exc": RuntimeError})
    first = _fit(ns, tmp_path / "a", kw, 10_000, infinite=False, plan=plan, world=before,
                 limit_val_batches=0)
    done = len(first.rec.trained)
    ckpt = first.stop.stopped_at if how == "stop" else str(tmp_path / "a" / "exc" /
                                                         "on_exception.ckpt")
    cursor = done * before
    left = (bpp - cursor) // after
    second = _fit(ns, tmp_path / "b", kw, done + left + 3, infinite=False, ckpt=ckpt,
                  world=after, limit_val_batches=0)
    assert second.rec.positions == ([(0, cursor + k * after) for k in range(left)]
                                    + [(1, k * after) for k in range(3)])
    assert second.rec.epochs == [0] * left + [1] * 3  # Lightning's epoch ends with the pass


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(1, 2), (2, 1)])
@pytest.mark.parametrize("workers", [0, 2])
def test_elastic_resume_in_infinite_mode_is_exactly_once(root: Path, tmp_path: Path,
                                                         before: int, after: int,
                                                         workers: int) -> None:
    """Infinite mode, resumed with another world size: the global block stream goes on
    from where it stopped, across the pass end (rank 0's blocks, in this process)."""
    from conftest import LightningNamespace

    ns = LightningNamespace("pytorch_lightning")
    kw = dm_kwargs(root, infinite=True, num_workers=workers)
    dm = DemoRoIDataModule(**kw)
    dm.setup("fit")
    bpp = dm.make_sampler().blocks_per_pass
    s1 = max(1, bpp // (3 * before))
    plan = {"where": "callback", "step": s1, "sig": SIGINT}
    first = _fit(ns, tmp_path / "a", kw, 10_000, infinite=True, plan=plan, world=before,
                 limit_val_batches=0)
    done = len(first.rec.trained)
    steps = bpp // after + 2  # crosses the end of pass 0
    second = _fit(ns, tmp_path / "b", kw, done + steps, infinite=True,
                  ckpt=first.stop.stopped_at, world=after, limit_val_batches=0)
    cursor = done * before
    assert second.rec.positions == [divmod(cursor + k * after, bpp) for k in range(steps)]
