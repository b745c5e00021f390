"""`lit-roidata fit` of the (tiny) demo on 2 CPU processes with strategy=ddp (gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import LIGHTNING_NAMESPACES
from datamodule_support import index_recorder, read_records, run_cli, tiny_config


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
