"""`lit-roidata fit` of the (tiny) demo on 2 CPU processes with strategy=ddp (gloo), and a
graceful stop there."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from conftest import LIGHTNING_NAMESPACES
from datamodule_support import IndexRecorder, index_recorder, read_records, run_cli, tiny_config


@pytest.mark.slow
@pytest.mark.parametrize("namespace", LIGHTNING_NAMESPACES)
def test_ddp_two_processes_fit_the_demo(root: Path, tmp_path: Path, namespace: str) -> None:
    """Two DDP ranks (CLI, gloo) under ``lit-roidata`` (pytorch_lightning) and
    ``python -m lit_roidata.lightning`` (lightning.pytorch), same YAML."""
    rec = tmp_path / "rec"
    cfg = tiny_config(root, tmp_path / "ddp.yaml",
                      trainer={"max_steps": 4, "devices": 2, "strategy": "ddp"},
                      callbacks=[{"class_path": index_recorder(namespace),
                                  "init_args": {"path": str(rec)}}],
                      data={"num_workers": 1})
    res = run_cli("fit", "--config", str(cfg), timeout=400, namespace=namespace)
    assert res.returncode == 0, res.stderr[-4000:]
    r0, r1 = read_records(rec, 0), read_records(rec, 1)
    assert len(r0) == len(r1) == 4
    for a, b in zip(r0, r1):
        # One global minibatch = 2 consecutive blocks of the stream, one per rank.
        assert a["pass"] == b["pass"] and b["block"] == a["block"] + 1
        assert not set(a["indices"]) & set(b["indices"])
    assert "COCO evaluation" in res.stdout + res.stderr  # validation at step 4, both ranks
    assert list((tmp_path / "ddp" / "checkpoints").glob("*.ckpt"))


class SignalAt(IndexRecorder):
    """Records like IndexRecorder; rank ``rank`` sends itself ``sig`` at ``step``."""

    def __init__(self, path: str, step: int, rank: int = 0,
                 sig: int = int(signal.SIGTERM)) -> None:
        super().__init__(path)
        self.step, self.rank, self.sig = int(step), int(rank), int(sig)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.sig)


@pytest.mark.slow
def test_ddp_graceful_stop_on_one_rank_stops_both_and_resumes_exactly(root: Path,
                                                                      tmp_path: Path) -> None:
    """SIGTERM to rank 1 only (as a scheduler may send it): both ranks stop at the same
    step boundary, one checkpoint, and the resumed run trains on each rank exactly the
    batches of an uninterrupted run."""
    def config(name: str, callback: dict) -> Path:
        return tiny_config(root, tmp_path / f"{name}.yaml", run=name,
                           trainer={"max_steps": 8, "devices": 2, "strategy": "ddp",
                                    "limit_val_batches": 0},
                           callbacks=[callback], data={"num_workers": 1})

    ref_rec, rec = tmp_path / "ref", tmp_path / "run"
    res = run_cli("fit", "--config", str(config("ref", {
        "class_path": index_recorder(), "init_args": {"path": str(ref_rec)}})), timeout=400)
    assert res.returncode == 0, res.stderr[-4000:]
    cfg = config("run", {"class_path": "test_datamodule_ddp.SignalAt",
                         "init_args": {"path": str(rec), "step": 3, "rank": 1}})
    res = run_cli("fit", "--config", str(cfg), timeout=400)
    out = res.stdout + res.stderr
    assert "stopped at global step 4" in out, out[-4000:]  # seen at the end of step 4
    ckpt = tmp_path / "run" / "interrupted" / "interrupted.ckpt"
    assert ckpt.is_file()
    assert [len(read_records(rec, r)) for r in (0, 1)] == [4, 4]
    res = run_cli("fit", "--config", str(cfg), "--ckpt_path", str(ckpt), timeout=400)
    assert res.returncode == 0, res.stderr[-4000:]
    for r in (0, 1):
        assert ([x["indices"] for x in read_records(rec, r)]
                == [x["indices"] for x in read_records(ref_rec, r)])
