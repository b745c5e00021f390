"""Two nodes × one process on this machine (Lightning's DDP across nodes, gloo on
127.0.0.1), each node with its own demo data and roidb cache (node-local disks): every
block of a pass is trained exactly once across the nodes, and a resume from a
checkpoint continues exactly, on 2 nodes or on 1 process (elastic)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lit_roidata import DemoRoIDataModule

from ports import ddp_rendezvous_env
from datamodule_support import REPO, cli_env, dm_kwargs, read_records, tiny_config

REC = "datamodule_support.IndexRecorder"
SIZE = {"demo_train_a": 8, "demo_train_b": 4, "demo_val": 2}


def _fit_nodes(cfg: Path, tmp: Path, nodes: int, *extra: str) -> list[str]:
    with ddp_rendezvous_env() as rendezvous:
        return _launch_nodes(cfg, tmp, nodes, rendezvous, *extra)


def _launch_nodes(cfg: Path, tmp: Path, nodes: int, rendezvous: dict[str, str],
                  *extra: str) -> list[str]:
    procs = []
    for node in range(nodes):
        env = cli_env()
        env.update(rendezvous, NODE_RANK=str(node))
        env.pop("LOCAL_RANK", None)
        args = [sys.executable, "-m", "lit_roidata.cli", "fit", "--config", str(cfg),
                "--trainer.num_nodes", str(nodes), "--trainer.devices", "1",
                # node-local disks: each node generates its data and builds its cache
                "--data.init_args.demo_root", str(tmp / f"node{node}" / "data"),
                "--data.init_args.sources.cache_dir", str(tmp / f"node{node}" / "cache"), *extra]
        if nodes > 1:
            args += ["--trainer.strategy", "ddp"]
        procs.append(subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=400)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


@pytest.mark.slow
def test_two_nodes_train_each_block_once_per_pass_and_resume_exactly(tmp_path: Path) -> None:
    kw = dm_kwargs(tmp_path / "probe", demo_size=dict(SIZE))
    probe = DemoRoIDataModule(**kw)
    probe.prepare_data()
    probe.setup("fit")
    bpp = probe.make_sampler().blocks_per_pass
    per_pass = bpp // 2
    steps = per_pass + 2  # into the second pass
    rec = tmp_path / "ref"
    cfg = tiny_config(tmp_path, tmp_path / "ref.yaml",
                      trainer={"max_steps": steps, "limit_val_batches": 0},
                      callbacks=[{"class_path": REC, "init_args": {"path": str(rec)}}],
                      data={"num_workers": 0, "infinite": False, "demo_size": dict(SIZE)})
    _fit_nodes(cfg, tmp_path, 2)
    for node in (0, 1):  # node-local caches, built on each node
        assert list((tmp_path / f"node{node}" / "cache").iterdir())
    r0, r1 = read_records(rec, 0), read_records(rec, 1)
    assert len(r0) == len(r1) == steps
    # Exactly once per pass across the nodes: rank r takes global blocks 2k + r.
    first = [(a["pass"], a["block"]) for a in r0] + [(b["pass"], b["block"]) for b in r1]
    pass0 = sorted(b for p, b in first if p == 0)
    assert pass0 == list(range(2 * per_pass))
    images = [i for r in (r0, r1) for x in r if x["pass"] == 0 for i in x["indices"]]
    assert len(images) == len(set(images))
    assert [x["pass"] for x in r0] == [0] * per_pass + [1] * (steps - per_pass)

    # Resume on 2 nodes from the step-3 checkpoint: the same batches on every rank.
    ckpt = tmp_path / "ref" / "checkpoints" / "epoch=0-step=3.ckpt"
    assert ckpt.is_file()
    rec2 = tmp_path / "resumed"
    cfg2 = tiny_config(tmp_path, tmp_path / "resumed.yaml",
                       trainer={"max_steps": steps, "limit_val_batches": 0},
                       callbacks=[{"class_path": REC, "init_args": {"path": str(rec2)}}],
                       data={"num_workers": 0, "infinite": False, "demo_size": dict(SIZE)})
    _fit_nodes(cfg2, tmp_path, 2, "--ckpt_path", str(ckpt))
    for rank, ref in ((0, r0), (1, r1)):
        assert [x["indices"] for x in read_records(rec2, rank)] == [x["indices"] for x in ref[3:]]

    # Elastic: the same checkpoint on one process continues the same global stream.
    rec3 = tmp_path / "single"
    cfg3 = tiny_config(tmp_path, tmp_path / "single.yaml",
                       trainer={"max_steps": 3 + 2 * (per_pass - 3), "limit_val_batches": 0},
                       callbacks=[{"class_path": REC, "init_args": {"path": str(rec3)}}],
                       data={"num_workers": 0, "infinite": False, "demo_size": dict(SIZE)})
    _fit_nodes(cfg3, tmp_path, 1, "--ckpt_path", str(ckpt))
    single = [(x["pass"], x["block"]) for x in read_records(rec3, 0)]
    expected = [(0, b) for b in range(6, 2 * per_pass)]
    assert single == expected
