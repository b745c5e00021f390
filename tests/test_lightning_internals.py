"""Every Lightning internal lit_roidata touches, in both Lightning namespaces.

lit_roidata reads and writes some of Lightning's private state (loop progress counters,
restart patterns, the combined loader, ``_iterator``, warning texts, progress-bar
internals). The pinned range (``pytorch-lightning>=2.5,<3``, ``lightning>=2.5,<3``) is
what these tests pass on; a Lightning upgrade that changes one of them fails here with a
message naming the internal and the lit_roidata code that relies on it.
"""

from __future__ import annotations

import importlib
import inspect
import re
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lit_roidata import DemoRoIDataModule

from datamodule_support import TINY_MODEL, dm_kwargs, shared_root


@pytest.fixture(scope="module")
def root(tmp_path_factory: Any) -> Path:
    return shared_root(tmp_path_factory)


def need(ok: Any, internal: str, user: str, ns: Any) -> None:
    """Fail naming the Lightning ``internal`` and the lit_roidata code (``user``) on it."""
    version = getattr(ns.module, "__version__", "?")
    assert ok, (f"Lightning internal changed: {internal} ({ns.name} {version}); "
                f"{user} relies on it. Adapt it, or keep the Lightning pin below this version.")


def _fabric(ns: Any, sub: str) -> Any:
    fabric = "lightning_fabric" if ns.name == "pytorch_lightning" else "lightning.fabric"
    return importlib.import_module(f"{fabric}.{sub}")


class _ProbeHooks:
    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
        bp = trainer.fit_loop.epoch_loop.batch_progress
        self.seen.setdefault("start", (bp.total.ready, bp.total.processed,
                                       trainer.datamodule._train_loader.consumed_batches))
        self.seen.setdefault("state", (trainer.state.fn, trainer.state.stage,
                                       trainer.state.status))
        self.seen.setdefault("combined", getattr(trainer.fit_loop, "_combined_loader", None))
        self.seen.setdefault("loader", trainer.datamodule._train_loader)
        self.seen.setdefault("restarting", getattr(trainer.fit_loop, "restarting", None))

    def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
        bp = trainer.fit_loop.epoch_loop.batch_progress
        self.seen.setdefault("end", (bp.total.ready, bp.total.processed, bp.total.completed,
                                     trainer.fit_loop.epoch_loop._batches_that_stepped))


def _model(ns: Any) -> Any:
    from lit_roidata.demo import DemoFastRCNN

    return ns.lit(DemoFastRCNN)(**TINY_MODEL)


def test_loop_progress_and_restart_internals(root: Path, tmp_path: Path, lightning_ns: Any
                                             ) -> None:
    """What lit_roidata.resume and RoIDataModule read and write in the fit loop."""
    ns = lightning_ns
    probe = ns.callback(_ProbeHooks)()
    ckpt = ns.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True)
    trainer = ns.Trainer(accelerator="cpu", max_steps=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), limit_val_batches=0,
                         callbacks=[probe, ckpt])
    dm = ns.lit(DemoRoIDataModule)(**dm_kwargs(root, infinite=True))
    trainer.fit(_model(ns), datamodule=dm)
    seen, ep = probe.seen, trainer.fit_loop.epoch_loop
    progress = importlib.import_module(f"{ns.name}.loops.progress")
    resume = "lit_roidata.resume (batches_in_flight, align_fit_loop)"
    need(isinstance(ep.batch_progress, progress._BatchProgress),
         "fit_loop.epoch_loop.batch_progress is a _BatchProgress", resume, ns)
    need(isinstance(ep.val_loop.batch_progress, progress._BatchProgress),
         "fit_loop.epoch_loop.val_loop.batch_progress", resume, ns)
    for t in ("total", "current"):
        for name in ("ready", "started", "processed", "completed"):
            need(isinstance(getattr(getattr(ep.batch_progress, t), name, None), int),
                 f"batch_progress.{t}.{name} (int)", resume, ns)
    need(hasattr(ep.batch_progress, "is_last_batch"), "batch_progress.is_last_batch", resume, ns)
    need(hasattr(ep, "_batches_that_stepped"), "epoch_loop._batches_that_stepped", resume, ns)
    # ready counted before the step, processed after it; the loader counts at hand-out
    # (no prefetching from a sized loader).
    need(seen["start"] == (1, 0, 1), "batch_progress counts ready before the step, "
         "processed after it; no prefetch from a loader with a length (loops/fetchers.py)",
         "lit_roidata.resume.batches_in_flight / StatefulRoIDataLoader", ns)
    need(seen["end"] == (1, 1, 0, 0), "batch_progress.total.completed and "
         "_batches_that_stepped are updated after on_train_batch_end", resume, ns)
    need(ep._batches_that_stepped == 2, "epoch_loop._batches_that_stepped counts steps",
         resume, ns)
    fn, stage, status = seen["state"]
    need(str(getattr(fn, "value", fn)) == "fit" and str(getattr(stage, "value", stage)) == "train"
         and str(getattr(status, "value", status)) == "running",
         "trainer.state.fn/stage/status values 'fit'/'train'/'running'",
         "lit_roidata.resume.save_phase", ns)
    need(str(getattr(type(status), "INTERRUPTED", SimpleNamespace(value="")).value)
         == "interrupted", "TrainerStatus.INTERRUPTED == 'interrupted'",
         "lit_roidata.resume.save_phase", ns)
    combined = seen["combined"]
    need(combined is not None and any(dl is seen["loader"] for dl in combined.flattened),
         "fit_loop._combined_loader.flattened holds the train loader unchanged (not "
         "re-instantiated by _DataConnector._prepare_dataloader)",
         "RoIDataModule.train_dataloader (reload detection) / StatefulRoIDataLoader", ns)
    need(seen["restarting"] is False, "fit_loop.restarting (bool)",
         "RoIDataModule._align_loops", ns)
    # The restart patterns align_fit_loop produces mean what it assumes.
    vl = ep.val_loop
    vl.restarting = True
    for name, v in (("ready", 3), ("started", 3), ("processed", 2), ("completed", 2)):
        setattr(vl.batch_progress.total, name, v)
    need(callable(getattr(vl, "update_restart_stage", None)),
         "_EvaluationLoop.update_restart_stage", resume, ns)
    vl.update_restart_stage()
    need(vl.restarted_mid_evaluation, "val_loop.restarted_mid_evaluation after "
         "started == ready, processed == started - 1 (reruns the validation)", resume, ns)
    ep.restarting = True
    for t in (ep.batch_progress.total, ep.batch_progress.current):
        for name in ("ready", "started", "processed", "completed"):
            setattr(t, name, 5)
    ep.update_restart_stage()
    need(ep.restarted_on_last, "epoch_loop.restarted_on_last", resume, ns)
    # Loader state: saved under loops.fit_loop.state_dict.combined_loader and restored
    # after the loop counters, before the iterator is made.
    saved = torch.load(tmp_path / "ck" / "last.ckpt", map_location="cpu", weights_only=False)
    loader_state = saved.get("loops", {}).get("fit_loop", {}).get("state_dict", {}).get(
        "combined_loader")
    need(isinstance(loader_state, list) and loader_state and "pass" in str(loader_state[0]),
         "checkpoint['loops']['fit_loop']['state_dict']['combined_loader'] holds the "
         "train loader's state_dict", "StatefulRoIDataLoader (resume) / the CLI's "
         "interrupted-fit check (loops.fit_loop)", ns)
    src = inspect.getsource(type(trainer.fit_loop).setup_data)
    need("_load_combined_loader_states" in src, "_FitLoop.setup_data restores the loader "
         "states (_load_combined_loader_states)", "lit_roidata.resume.align_fit_loop", ns)


def test_data_loader_hooks(lightning_ns: Any) -> None:
    """_set_sampler_epoch calls loader.sampler.set_epoch; CombinedLoader.reset() resets
    ``_iterator``; a non-DataLoader is left alone by the data connector."""
    ns = lightning_ns
    data = _fabric(ns, "utilities.data")
    calls: list[int] = []
    loader = SimpleNamespace(sampler=SimpleNamespace(set_epoch=calls.append))
    data._set_sampler_epoch(loader, 5)
    need(calls == [5], "lightning fabric utilities.data._set_sampler_epoch calls "
         "loader.sampler.set_epoch", "StatefulRoIDataLoader.sampler (_EpochHook)", ns)
    cl = importlib.import_module(f"{ns.name}.utilities.combined_loader")
    holder = SimpleNamespace(_iterator="running")
    cl._shutdown_workers_and_reset_iterator(holder)
    need(holder._iterator is None, "utilities.combined_loader."
         "_shutdown_workers_and_reset_iterator sets loader._iterator = None",
         "StatefulRoIDataLoader._iterator", ns)
    need(hasattr(torch.utils.data.DataLoader(range(2)), "_iterator"),
         "torch DataLoader._iterator", "StatefulRoIDataLoader._iterator", ns)
    dc = importlib.import_module(f"{ns.name}.trainer.connectors.data_connector")
    src = inspect.getsource(dc._DataConnector._prepare_dataloader)
    need(re.search(r"if not isinstance\(dataloader, DataLoader\):\s*return dataloader", src),
         "_DataConnector._prepare_dataloader returns a non-DataLoader unchanged (no "
         "DistributedSampler)", "StatefulRoIDataLoader / EvalLoader (wrap, not subclass)", ns)


class _TinyBody:
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return (self.w - batch.float().mean()).pow(2).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(torch.arange(8), batch_size=2)


def _tiny(ns: Any) -> Any:
    return type("Tiny", (_TinyBody, ns.LightningModule), {})()


def test_warning_texts_and_last_checkpoint_lookup(tmp_path: Path, lightning_ns: Any) -> None:
    """The CLI silences two Lightning warnings by their text and hides ModelCheckpoint's
    ``last.ckpt`` from the implicit "last" lookup through ``_find_last_checkpoints``."""
    from lit_roidata.cli import _SILENCED_WARNINGS, _none_found

    ns = lightning_ns
    kw = dict(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=str(tmp_path))
    on_exc = ns.callbacks.OnExceptionCheckpoint(dirpath=str(tmp_path / "exc"))
    need(isinstance(getattr(on_exc, "ckpt_path", None), str), "OnExceptionCheckpoint.ckpt_path",
         "lit_roidata.cli.RoIDataCLI.before_fit", ns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns.Trainer(callbacks=[on_exc], **kw).fit(_tiny(ns), ckpt_path=None)
    texts = [str(w.message) for w in caught]
    for pattern in _SILENCED_WARNINGS:
        need(any(re.search(pattern, t) for t in texts), f"the warning text matched by "
             f"{pattern!r} (fit(ckpt_path=None) with OnExceptionCheckpoint)",
             "lit_roidata.cli.RoIDataCLI.before_fit (warnings.filterwarnings)", ns)
    mc = ns.callbacks.ModelCheckpoint
    need(callable(getattr(mc, "_find_last_checkpoints", None))
         and mc.CHECKPOINT_NAME_LAST == "last" and mc.FILE_EXTENSION == ".ckpt",
         "ModelCheckpoint._find_last_checkpoints / CHECKPOINT_NAME_LAST / FILE_EXTENSION",
         "lit_roidata.cli (_no_implicit_last, _last_patterns)", ns)
    ck = tmp_path / "ck"
    ns.Trainer(callbacks=[mc(dirpath=str(ck), save_last=True)], **kw).fit(_tiny(ns))
    found = ns.Trainer(callbacks=[mc(dirpath=str(ck), save_last=True)], **kw)
    found.fit(_tiny(ns), ckpt_path="last")
    need(found.ckpt_path and Path(found.ckpt_path).name == "last.ckpt",
         'fit(ckpt_path="last") finds ModelCheckpoint\'s last.ckpt', "lit_roidata.cli", ns)
    hidden_cb = mc(dirpath=str(ck), save_last=True)
    hidden_cb._find_last_checkpoints = _none_found
    hidden = ns.Trainer(callbacks=[hidden_cb], **{**kw, "max_steps": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hidden.fit(_tiny(ns), ckpt_path="last")
    need(hidden.ckpt_path is None, "the 'last' lookup goes through "
         "ModelCheckpoint._find_last_checkpoints", "lit_roidata.cli._no_implicit_last", ns)


_RICH = ("total_train_batches", "_get_train_description", "_update", "train_progress_bar_id",
         "_initialize_train_progress_bar_id", "_update_metrics", "refresh",
         "validation_description", "is_disabled")
_TQDM = ("total_train_batches", "_train_progress_bar", "train_progress_bar", "_should_update",
         "get_metrics")


@pytest.mark.parametrize("bar", ["StepProgressBar", "StepTQDMProgressBar"])
def test_progress_bar_internals(tmp_path: Path, lightning_ns: Any, bar: str) -> None:
    """The step-counting bars override/use these progress-bar internals."""
    import lit_roidata.progress as progress

    ns = lightning_ns
    cls = ns.lit(getattr(progress, bar))
    base = cls.__mro__[1]
    cb = cls()
    for name in (_RICH if bar == "StepProgressBar" else _TQDM):
        need(name in dir(cb), f"{base.__name__}.{name}", f"lit_roidata.progress.{bar}", ns)
    trainer = ns.Trainer(accelerator="cpu", max_steps=3, max_epochs=-1, logger=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[cb], enable_checkpointing=False)
    trainer.fit(_tiny(ns))
    need(cb.total_train_batches == 3 and trainer.global_step == 3,
         f"{base.__name__} hooks (a fit by steps runs the overridden ones)",
         f"lit_roidata.progress.{bar}", ns)


def test_rank_zero_and_cli_hooks(lightning_ns: Any) -> None:
    """``rank_zero_only.rank`` (the CLI's log filter) and the LightningCLI hooks the CLI
    overrides."""
    ns = lightning_ns
    rz = importlib.import_module(f"{ns.name}.utilities.rank_zero")
    need(isinstance(getattr(rz.rank_zero_only, "rank", None), int),
         "utilities.rank_zero.rank_zero_only.rank", "lit_roidata.cli._RankZeroFilter", ns)
    cli = importlib.import_module(f"{ns.name}.cli").LightningCLI
    params = list(inspect.signature(cli.setup_parser).parameters)
    need(params == ["self", "add_subcommands", "main_kwargs", "subparser_kwargs"],
         "LightningCLI.setup_parser(add_subcommands, main_kwargs, subparser_kwargs)",
         "lit_roidata.cli.RoIDataCLI.setup_parser", ns)
    need(callable(getattr(cli, "_get", None)), "LightningCLI._get",
         "lit_roidata.cli.RoIDataCLI.before_fit", ns)
    src = inspect.getsource(cli._run_subcommand)
    need('f"before_{subcommand}"' in src and 'f"after_{subcommand}"' in src,
         "LightningCLI._run_subcommand calls before_<subcommand>/after_<subcommand>",
         "lit_roidata.cli.RoIDataCLI (before_fit, after_fit, before_validate, ...)", ns)


def test_mixing_namespaces_is_what_the_bindings_avoid(lightning_ns: Any) -> None:
    """Why two bindings: Lightning's is_overridden finds no parent for a data module of
    the other namespace (the error ``L.Trainer().fit(..., datamodule=lit_roidata.RoIDataModule())``
    gave before lit_roidata.lightning existed)."""
    from lit_roidata._lightning import LIGHTNING, PL, bind

    pytest.importorskip("lightning")
    ns = lightning_ns
    mod = importlib.import_module(f"{ns.name}.utilities.model_helpers")
    other = bind(DemoRoIDataModule, LIGHTNING if ns.name == PL else PL)
    with pytest.raises(ValueError, match="Expected a parent"):
        mod.is_overridden("prepare_data", other(**dm_kwargs(Path("/nonexistent"))))
    assert mod.is_overridden("prepare_data", ns.lit(DemoRoIDataModule)(
        **dm_kwargs(Path("/nonexistent"))))
