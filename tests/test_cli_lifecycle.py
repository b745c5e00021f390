"""The CLI lifecycle: which checkpoint a `fit` resumes from, and never from another
subcommand's crash; `--ckpt_path last`; tests and tools never overwrite a user's files;
progress bars count steps; log lines once under DDP."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import yaml

from lit_roidata.cli import main

from conftest import LIGHTNING_NAMESPACES
from datamodule_support import REPO, read_records, tiny_config

REC = "datamodule_support.IndexRecorder"


def _paths(node: Any) -> list[str]:
    out: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("save_dir", "dirpath", "default_root_dir", "cache_dir", "demo_root", "path"):
                out.append(str(v))
            out += _paths(v)
    elif isinstance(node, list):
        for v in node:
            out += _paths(v)
    return out


def test_test_configs_write_only_under_their_temp_dir(root: Path, tmp_path: Path) -> None:
    """Every folder a test config writes to (logs, checkpoints, caches) is a temp dir,
    so running the suite from the repository root leaves runs/demo alone."""
    cfg = yaml.safe_load(tiny_config(root, tmp_path / "t.yaml").read_text())
    paths = _paths(cfg)
    assert any("save_dir" in str(k) for k in [cfg["trainer"]["logger"]["init_args"]])
    for p in paths:
        assert Path(p).is_absolute() and not Path(p).resolve().is_relative_to(REPO), p


def _ckpt_dir(tmp_path: Path, run: str) -> Path:
    return tmp_path / run / "interrupted"


class Boom(pl.Callback):
    """Fails at the start of the given stage (here: predict)."""

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        raise RuntimeError("simulated crash in predict")


@pytest.mark.slow
def test_a_crash_in_predict_never_makes_fit_resume(root: Path, tmp_path: Path,
                                                   caplog: Any) -> None:
    cfg = tiny_config(root, tmp_path / "run.yaml", run="run",
                      trainer={"max_steps": 2, "limit_val_batches": 0},
                      callbacks=[{"class_path": "test_cli_lifecycle.Boom"},
                                 {"class_path": REC, "init_args": {"path": str(tmp_path / "rec")}}])
    with pytest.raises(RuntimeError, match="simulated crash in predict"):
        main(["predict", "--config", str(cfg), "--model.class_path",
              "datamodule_support.PredictingFastRCNN"])
    exc = _ckpt_dir(tmp_path, "run") / "on_exception.ckpt"
    assert not exc.exists(), "predict wrote an interrupted-run checkpoint"
    # One written by another subcommand (predict from Python with OnExceptionCheckpoint
    # configured: the data module's state says so) is not resumed either: it is moved aside.
    fake = {"DemoRoIDataModule": {"trainer_fn": "predict", "seed": 0}, "global_step": 0,
            "state_dict": {}}
    exc.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fake, exc)
    with caplog.at_level(logging.WARNING, logger="lit_roidata"):
        assert main(["fit", "--config", str(cfg)]) == 0
    assert [r["step"] for r in read_records(tmp_path / "rec")] == [1, 2]
    assert (exc.parent / "on_exception.ckpt.stale").is_file()
    assert "not written by an interrupted `fit`" in caplog.text


class StopAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, *a: Any) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("simulated failure")


def test_ckpt_path_last_resumes_from_the_newest_checkpoint(root: Path, tmp_path: Path,
                                                           caplog: Any) -> None:
    """The documented `--ckpt_path last` finds last.ckpt of the previous run (its logger
    version folder; Lightning looks only in the new one) and names the step."""
    rec = tmp_path / "rec"
    cbs = [{"class_path": REC, "init_args": {"path": str(rec)}}]
    cfg = tiny_config(root, tmp_path / "run.yaml", run="run", drop_callbacks=("ModelCheckpoint",),
                      trainer={"max_steps": 3, "limit_val_batches": 0},
                      callbacks=cbs + [{"class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
                                        "init_args": {"save_last": True,
                                                      "every_n_train_steps": 3}}])
    assert main(["fit", "--config", str(cfg)]) == 0
    lasts = list((tmp_path / "run" / "runs").rglob("last.ckpt"))
    assert lasts, "ModelCheckpoint(save_last=True) wrote no last.ckpt"
    cfg5 = yaml.safe_load(cfg.read_text())
    cfg5["trainer"]["max_steps"] = 5
    (tmp_path / "run5.yaml").write_text(yaml.safe_dump(cfg5))
    with caplog.at_level(logging.WARNING, logger="lit_roidata"):
        assert main(["fit", "--config", str(tmp_path / "run5.yaml"), "--ckpt_path", "last"]) == 0
    assert "global step 3" in caplog.text
    assert [r["step"] for r in read_records(rec)] == [1, 2, 3, 4, 5]


@pytest.mark.slow
def test_rerun_after_an_interrupted_fit_names_the_step_and_fresh_starts_over(
        root: Path, tmp_path: Path, caplog: Any, capsys: Any) -> None:
    rec = tmp_path / "rec"
    cfg = tiny_config(root, tmp_path / "run.yaml", run="run",
                      trainer={"max_steps": 4, "limit_val_batches": 0},
                      callbacks=[{"class_path": REC, "init_args": {"path": str(rec)}},
                                 {"class_path": "test_cli_lifecycle.StopAt",
                                  "init_args": {"step": 2}}])
    with pytest.raises(RuntimeError, match="simulated failure"):
        main(["fit", "--config", str(cfg)])
    exc = _ckpt_dir(tmp_path, "run") / "on_exception.ckpt"
    assert exc.is_file()
    plain = yaml.safe_load(cfg.read_text())
    plain["trainer"]["callbacks"] = [c for c in plain["trainer"]["callbacks"]
                                     if not c["class_path"].endswith("StopAt")]
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(plain))
    with caplog.at_level(logging.WARNING, logger="lit_roidata"):
        assert main(["fit", "--config", str(tmp_path / "plain.yaml"), "--ckpt_path", "fresh"]) == 0
    assert "fresh" in caplog.text and (exc.parent / "on_exception.ckpt.stale").is_file()
    assert [r["step"] for r in read_records(rec)] == [1, 2, 1, 2, 3, 4]
    # The finished run left last.ckpt in its fixed dirpath, which Lightning itself would
    # resume (OnExceptionCheckpoint is configured): the CLI asks which is meant.
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert last.is_file() and not exc.exists()
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        main(["fit", "--config", str(cfg)])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert str(last) in err and "--ckpt_path last" in err and "--ckpt_path fresh" in err
    # Fresh again (last.ckpt moved aside), interrupted, then the same command resumes.
    with pytest.raises(RuntimeError):
        main(["fit", "--config", str(cfg), "--ckpt_path", "fresh"])
    assert (last.parent / "last.ckpt.stale").is_file() and exc.is_file()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_roidata"):
        assert main(["fit", "--config", str(tmp_path / "plain.yaml")]) == 0
    assert "at global step 2" in caplog.text and "--ckpt_path fresh" in caplog.text
    assert [r["step"] for r in read_records(rec)][6:] == [1, 2, 3, 4]
    assert not exc.exists()  # a finished fit: Lightning's OnExceptionCheckpoint removed it


@pytest.mark.slow
def test_ddp_rerun_resumes_every_rank_from_the_checkpoint_rank_0_chose(root: Path,
                                                                       tmp_path: Path) -> None:
    """Under DDP the re-run's choice is made once (rank 0) and every rank resumes from it."""
    from datamodule_support import run_cli

    rec = tmp_path / "rec"
    trainer = {"max_steps": 4, "limit_val_batches": 0, "devices": 2, "strategy": "ddp"}
    cbs = [{"class_path": REC, "init_args": {"path": str(rec)}}]
    cfg = tiny_config(root, tmp_path / "run.yaml", run="run", trainer=trainer,
                      callbacks=cbs + [{"class_path": "test_cli_lifecycle.StopAt",
                                        "init_args": {"step": 2}}])
    res = run_cli("fit", "--config", str(cfg), timeout=400)
    assert res.returncode != 0 and "simulated failure" in res.stderr, res.stderr[-3000:]
    assert (_ckpt_dir(tmp_path, "run") / "on_exception.ckpt").is_file(), res.stderr[-3000:]
    plain = tiny_config(root, tmp_path / "plain.yaml", run="run", trainer=trainer, callbacks=cbs)
    res = run_cli("fit", "--config", str(plain), timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "at global step 2" in res.stderr
    for rank in (0, 1):
        assert [r["step"] for r in read_records(rec, rank)] == [1, 2, 3, 4], rank


def test_make_demo_data_refuses_to_replace_other_data_without_force(tmp_path: Path,
                                                                    capsys: Any) -> None:
    root = tmp_path / "demo_data"
    size = '{"demo_train_a": 2, "demo_train_b": 2, "demo_val": 2}'
    assert main(["make-demo-data", "--root", str(root), "--size", size]) == 0
    marker = root / "demo_train_a" / "annotations.json"
    before = marker.read_bytes()
    (root / "cache").mkdir()
    # The same data again: reused untouched.
    assert main(["make-demo-data", "--root", str(root), "--size", size]) == 0
    # Other sizes: refused, nothing changed.
    other = '{"demo_train_a": 3, "demo_train_b": 2, "demo_val": 2}'
    assert main(["make-demo-data", "--root", str(root), "--size", other]) == 2
    assert "--force" in capsys.readouterr().err
    assert marker.read_bytes() == before and (root / "cache").is_dir()
    # A folder with the user's own files: refused too.
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["make-demo-data", "--root", str(mine), "--size", size]) == 2
    assert (mine / "notes.txt").read_text() == "keep me"
    # --force replaces it and drops the stale caches.
    assert main(["make-demo-data", "--root", str(root), "--size", other, "--force"]) == 0
    assert marker.read_bytes() != before and not (root / "cache").exists()


def test_progress_bar_counts_steps_out_of_max_steps_and_after_a_resume(
        root: Path, tmp_path: Path) -> None:
    from lit_roidata import DemoRoIDataModule
    from lit_roidata.demo import DemoFastRCNN
    from lit_roidata.progress import StepTQDMProgressBar

    from datamodule_support import TINY_MODEL, dm_kwargs

    seen: list[tuple[Any, Any, str]] = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
            b = trainer.progress_bar_callback.train_progress_bar
            seen.append((b.n, b.total, str(b.desc)))

    def fit(steps: int, ckpt: str | None) -> None:
        ck = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True)
        trainer = pl.Trainer(accelerator="cpu", max_steps=steps, logger=False,
                             enable_model_summary=False, default_root_dir=str(tmp_path),
                             limit_val_batches=0, callbacks=[StepTQDMProgressBar(), Probe(), ck])
        dm = DemoRoIDataModule(**dm_kwargs(root, infinite=True))
        trainer.fit(DemoFastRCNN(**TINY_MODEL), datamodule=dm, ckpt_path=ckpt)

    fit(3, None)
    fit(5, str(tmp_path / "ck" / "last.ckpt"))
    assert [(c, t) for c, t, _ in seen] == [(1, 3), (2, 3), (3, 3), (4, 5), (5, 5)], seen
    assert all(d.startswith("Step") for _, _, d in seen), seen


def test_log_lines_once_under_ddp_unless_rank_specific(capsys: Any) -> None:
    from pytorch_lightning.utilities.rank_zero import rank_zero_only

    from lit_roidata.cli import _RankZeroFilter

    log = logging.getLogger("lit_roidata.test_rank")
    handler = logging.StreamHandler()
    handler.addFilter(_RankZeroFilter())
    log.addHandler(handler)
    old = getattr(rank_zero_only, "rank", 0)
    try:
        for rank in (0, 1):
            rank_zero_only.rank = rank
            log.warning("shared message")
            log.warning("my shard", extra={"rank_specific": True})
    finally:
        rank_zero_only.rank = old
        log.removeHandler(handler)
    err = capsys.readouterr().err
    assert err.count("shared message") == 1
    assert "[rank 0] my shard" in err and "[rank 1] my shard" in err


BARS: list[tuple[str, Any, str]] = []


class BarProbe(pl.Callback):
    def on_train_end(self, trainer: Any, *a: Any) -> None:
        pb = trainer.progress_bar_callback
        bar = pb.train_progress_bar
        BARS.append((type(pb).__name__, (bar.n, bar.total), str(bar.desc)))


def test_cli_fit_shows_steps_out_of_max_steps_in_infinite_mode(root: Path, tmp_path: Path) -> None:
    """configs/demo.yaml trains by max_steps on the endless stream: the bar the CLI adds
    counts steps out of max_steps (Lightning's own said `Epoch 0/-2`)."""
    BARS.clear()
    cfg = tiny_config(root, tmp_path / "run.yaml", run="run",
                      trainer={"max_steps": 2, "limit_val_batches": 0, "enable_progress_bar": True},
                      callbacks=[{"class_path": "test_cli_lifecycle.BarProbe"}])
    assert main(["fit", "--config", str(cfg)]) == 0
    assert [b[1] for b in BARS] == [(2, 2)] and BARS[0][0] == "StepTQDMProgressBar"
    assert all(b[2].startswith("Step") for b in BARS), BARS


_DEFAULTS = """
import json, sys
from lit_roidata._lightning import import_namespace, isinstance_any, lightning_attr
import_namespace(sys.argv[1])  # first, as the command does (Lightning 2.4, docs/cli.md)
from lit_roidata.progress import StepTQDMProgressBar
from lit_roidata.loader_callbacks import BadImageReport as report
from lit_roidata.trainer_cli import cli_main

ns, cfg = sys.argv[1], sys.argv[2]
bar = lightning_attr(ns, "callbacks.ProgressBar")
out = {}
for name, extra in {"default": [], "no_bar": ["--trainer.enable_progress_bar=false"],
                    "configured": ["--trainer.callbacks+=" + ns + ".callbacks.TQDMProgressBar",
                                   "--trainer.callbacks.refresh_rate=3"],
                    "skip": ["--data.init_args.sources.on_bad_image=skip"]}.items():
    cbs = cli_main(["--config", cfg, *extra], run=False, namespace=ns).trainer.callbacks
    out[name] = {"bars": [type(cb).__name__ for cb in cbs if isinstance(cb, bar)],
                 "step_bar": [isinstance_any(cb, StepTQDMProgressBar) for cb in cbs
                              if isinstance(cb, bar)],
                 "reports": sum(isinstance_any(cb, report) for cb in cbs)}
print("DEFAULTS " + json.dumps(out))
"""


@pytest.mark.parametrize("namespace", LIGHTNING_NAMESPACES)
def test_cli_adds_default_callbacks_only_where_the_config_has_none(
        root: Path, tmp_path: Path, namespace: str) -> None:
    """The step bar when bars are on and none is configured (a configured bar is kept as it
    is); BadImageReport when the data module skips bad images and none is configured. The
    Trainers are built (nothing runs) in a fresh process, as the command does."""
    import json
    import subprocess
    import sys

    from datamodule_support import cli_env

    cfg = tiny_config(root, tmp_path / "run.yaml", run="run")
    res = subprocess.run([sys.executable, "-c", _DEFAULTS, namespace, str(cfg)], env=cli_env(),
                         capture_output=True, text=True, timeout=600)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("DEFAULTS ")]
    assert line, res.stderr[-3000:]
    out = json.loads(line[-1][len("DEFAULTS "):])
    assert out["default"] == {"bars": ["StepTQDMProgressBar"], "step_bar": [True], "reports": 0}
    assert out["no_bar"]["bars"] == []
    # The configured bar, as it is. (A plain TQDMProgressBar: LightningCLI 2.4 cannot parse
    # RichProgressBar's theme with jsonargparse >= 4.39, docs/install.md.)
    assert out["configured"] == {"bars": ["TQDMProgressBar"], "step_bar": [False],
                                 "reports": 0}
    assert out["skip"]["reports"] == 1


class SignalStop(pl.Callback):
    """Stands for GracefulStop: stops after step 1 as if on SIGTERM."""

    stopped_by_signal = None

    def on_train_batch_end(self, trainer: Any, *a: Any) -> None:
        self.stopped_by_signal = 15
        trainer.should_stop = True


def test_fit_stopped_by_a_signal_exits_with_128_plus_signum(root: Path, tmp_path: Path) -> None:
    cfg = tiny_config(root, tmp_path / "run.yaml", run="run",
                      trainer={"max_steps": 3, "limit_val_batches": 0},
                      callbacks=[{"class_path": "test_cli_lifecycle.SignalStop"}])
    assert main(["fit", "--config", str(cfg)]) == 143


RAN: list[str] = []


class Loud:
    """Records it was rebuilt: reading a checkpoint's metadata must never do that."""

    def __setstate__(self, state: Any) -> None:
        RAN.append("setstate")

    def __reduce__(self) -> Any:
        return (RAN.append, ("reduce",))


def test_checkpoint_metadata_is_read_without_running_pickled_code(tmp_path: Path) -> None:
    from lit_roidata.resume import checkpoint_meta, checkpoint_step, is_interrupted_fit

    def save(name: str, obj: dict) -> str:
        torch.save(obj, tmp_path / name)
        return str(tmp_path / name)

    fit = save("fit.ckpt", {"global_step": 7, "epoch": 0, "state_dict": {"w": torch.ones(3)},
                            "hyper_parameters": {"x": Loud(),
                                                 "fn": pl.trainer.states.TrainerFn.FITTING},
                            "DemoRoIDataModule": {"trainer_fn": "fit", "seed": 0},
                            "loops": {"fit_loop": {}, "predict_loop": {}}})
    meta = checkpoint_meta(fit)
    assert meta["global_step"] == 7
    assert meta["DemoRoIDataModule"] == {"trainer_fn": "fit", "seed": 0}
    assert RAN == [] and checkpoint_step(fit) == 7 and is_interrupted_fit(fit)
    other = save("other.ckpt", {"global_step": 1, "M": {"trainer_fn": "predict"},
                                "loops": {"fit_loop": {}}})
    assert not is_interrupted_fit(other)  # the data module says which subcommand wrote it
    plain = save("plain.ckpt", {"global_step": 2, "loops": {}})
    assert is_interrupted_fit(plain)  # another data module: only fit writes these files
    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint")
    for path in (str(tmp_path / "bad.ckpt"), str(tmp_path / "missing.ckpt")):
        assert checkpoint_meta(path) == {} and checkpoint_step(path) is None
        assert not is_interrupted_fit(path)
