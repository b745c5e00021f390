"""Shared helpers for the data-module, CLI, tool and SIGINT tests (no tests here).

Everything runs on a tiny demo (44 images, 64-96 px, a very small model) so that the
Trainer, DDP and CLI tests fit CI on 2 cores. The demo data and the roidb caches live in
one folder per pytest session, shared by all these test files (both are built once,
under file locks, and reused).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import yaml

from ports import ddp_rendezvous_env

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent

SMALL_DEMO = {"demo_train_a": 24, "demo_train_b": 12, "demo_val": 8}
TINY_OVERRIDES = {
    "MODEL.NUM_CLASSES": 5,
    "TRAIN.SCALES": [64, 80, 96],
    "TRAIN.MAX_SIZE": 128,
    "TRAIN.BATCH_SIZE_PER_IM": 16,
    "TEST.SCALE": 80,
    "TEST.MAX_SIZE": 128,
    "TEST.PROPOSAL_LIMIT": 40,
}
TINY_MODEL = {"num_classes": 5, "backbone_width": 8, "head_dim": 32, "warmup_iters": 2,
              "lr": 0.01}


def shared_root(tmp_path_factory: Any) -> Path:
    """One folder per pytest session holding the demo data and roidb caches."""
    root = Path(tmp_path_factory.getbasetemp()) / "lit_roidata_tiny_demo"
    root.mkdir(parents=True, exist_ok=True)
    return root


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Short option names (``num_workers=0``) as the data module's nested groups
    (``loader={"num_workers": 0}``); other keys stay as they are."""
    from lit_roidata.options import MOVED_OPTIONS

    out: dict[str, Any] = {}
    for k, v in flat.items():
        if k in MOVED_OPTIONS:
            group, key = MOVED_OPTIONS[k]
            out.setdefault(group, {})[key] = v
        elif isinstance(v, dict) and isinstance(out.get(k), dict) and k != "overrides":
            out[k].update(v)
        else:
            out[k] = v
    return out


def dm_kwargs(root: Path, **changes: Any) -> dict[str, Any]:
    """``DemoRoIDataModule`` arguments for the tiny demo under ``root``; ``changes`` may
    use the short option names (``num_workers=1``), nested here."""
    kw: dict[str, Any] = dict(demo_root=str(root / "data"), demo_size=dict(SMALL_DEMO),
                              cache_dir=str(root / "cache"), model_type="fast_rcnn",
                              overrides=dict(TINY_OVERRIDES), num_workers=0)
    kw.update(changes)
    return nest(kw)


def merge_data(init_args: dict[str, Any], changes: dict[str, Any]) -> None:
    """Merge nested data-module arguments into ``init_args`` (groups merged key-wise)."""
    for k, v in changes.items():
        if isinstance(v, dict) and isinstance(init_args.get(k), dict) and k != "overrides":
            init_args[k].update(v)
        else:
            init_args[k] = v


def tiny_config(root: Path, out: Path, *, trainer: dict | None = None, data: dict | None = None,
                model: dict | None = None, callbacks: list | None = None,
                drop_callbacks: tuple[str, ...] = (), run: str | None = None) -> Path:
    """configs/demo.yaml shrunk to the tiny demo, written to ``out`` (returns its path).

    Checkpoints go to ``<out dir>/<run>/checkpoints`` and ``<run>/interrupted`` (``run``
    defaults to the file's stem): Lightning auto-resumes from what it finds there.
    """
    run_dir = out.parent / (run or out.stem)
    cfg = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    cfg = copy.deepcopy(cfg)
    t = cfg["trainer"]
    t.update({"max_steps": 4, "val_check_interval": 4, "log_every_n_steps": 1,
              "default_root_dir": str(run_dir / "runs"), "enable_model_summary": False})
    if isinstance(t.get("logger"), dict):
        # Logs go under the test's folder, never into the repository's runs/demo.
        t["logger"].setdefault("init_args", {})["save_dir"] = str(run_dir / "runs")
    kept = []
    for cb in t.get("callbacks", []):
        name = cb["class_path"].rsplit(".", 1)[-1]
        if name in drop_callbacks:
            continue
        if name == "OnExceptionCheckpoint":
            cb["init_args"]["dirpath"] = str(run_dir / "interrupted")
        if name == "ModelCheckpoint":
            cb["init_args"]["dirpath"] = str(run_dir / "checkpoints")
            cb["init_args"]["every_n_train_steps"] = 3
            cb["init_args"]["save_top_k"] = -1
        kept.append(cb)
    t["callbacks"] = kept + list(callbacks or [])
    t.update(trainer or {})
    d = cfg["data"]["init_args"]
    merge_data(d, dm_kwargs(root))
    merge_data(d, nest(dict(data or {})))
    cfg["model"]["init_args"].update(TINY_MODEL)
    cfg["model"]["init_args"].update(model or {})
    out.write_text(yaml.safe_dump(cfg))
    return out


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_cli(*args: str, timeout: float = 300, cwd: Path | None = None,
            namespace: str = "pytorch_lightning") -> subprocess.CompletedProcess:
    """``lit-roidata ARGS`` in a subprocess (``python -m lit_roidata.cli``; with
    ``namespace="lightning.pytorch"``: ``python -m lit_roidata.lightning``).

    A DDP run's rendezvous store is hosted here (``ports.ddp_rendezvous_env``), so the
    ranks never race other processes for a free ``MASTER_PORT``.
    """
    module = "lit_roidata.cli" if namespace == "pytorch_lightning" else "lit_roidata.lightning"
    with ddp_rendezvous_env() as rendezvous:
        return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd or REPO,
                              env={**cli_env(), **rendezvous}, capture_output=True, text=True,
                              timeout=timeout)


def index_recorder(namespace: str = "pytorch_lightning") -> str:
    """Class path of :class:`IndexRecorder` for ``namespace``."""
    name = "IndexRecorder" if namespace == "pytorch_lightning" else "LightningIndexRecorder"
    return f"datamodule_support.{name}"


class _IndexRecorderHooks:
    """Append the roidb indices of every *trained* batch to ``<path>.rank<r>`` (jsonl).

    ``delay`` (seconds) is slept after each record: a test that interrupts a run after
    its first records keeps the rest of the run long enough that the interrupt lands
    in training, not in the teardown of a run that already finished.
    """

    def __init__(self, path: str, delay: float = 0.0) -> None:
        self.path = path
        self.delay = float(delay)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        meta = batch["_meta"]
        rec = {"step": int(trainer.global_step), "indices": [int(i) for i in meta["indices"]],
               "pass": int(meta["pass_index"]), "block": int(meta["block_index"])}
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        if self.delay:
            time.sleep(self.delay)


class IndexRecorder(_IndexRecorderHooks, pl.Callback):
    __doc__ = _IndexRecorderHooks.__doc__


def __getattr__(name: str) -> Any:
    if name == "LightningIndexRecorder":  # only with `lightning` installed
        import lightning.pytorch as lp

        cls = type(name, (_IndexRecorderHooks, lp.Callback), {"__module__": __name__})
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def read_records(path: Path, rank: int = 0) -> list[dict]:
    p = Path(f"{path}.rank{rank}")
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def _demo_fast_rcnn() -> type:
    from lit_roidata.demo import DemoFastRCNN

    return DemoFastRCNN


class PredictingFastRCNN(_demo_fast_rcnn()):  # type: ignore[misc]
    """The demo model with a ``predict_step`` (its detections), for ``lit-roidata predict``."""

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self.detect(batch)
