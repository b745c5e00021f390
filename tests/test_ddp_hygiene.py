"""Distributed hygiene: worker seeds differ by rank (the data stream does not), the eval
loader leaves the global RNG alone, COCO detections are gathered to rank 0 only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lit_roidata import DemoRoIDataModule
from lit_roidata.loader import EvalLoader
from lit_roidata.loader import StatefulRoIDataLoader
from lit_roidata.sampler import RoIBatchSampler

from ports import ddp_rendezvous_env
from datamodule_support import dm_kwargs


class _WorkerDraw:
    """A dataset whose 'augmentation' uses the global RNGs inside the worker."""

    def __getitems__(self, block: Any) -> Any:
        return {"block": (block.pass_index, block.block_index), "indices": list(block),
                "torch": float(torch.rand(())), "numpy": float(np.random.rand())}


def _draws(rank: int, world: int) -> list[dict]:
    s = RoIBatchSampler(np.full(40, 8), np.full(40, 6), 2, seed=5, rank=rank, world_size=world)
    return list(StatefulRoIDataLoader(_WorkerDraw(), s, num_workers=1))


def test_worker_global_rng_differs_by_rank_but_the_stream_does_not() -> None:
    r0, r1 = _draws(0, 2), _draws(1, 2)
    assert [d["block"][1] for d in r0] == [2 * k for k in range(len(r0))]
    assert [d["block"][1] for d in r1] == [2 * k + 1 for k in range(len(r1))]
    # A user's augmentation drawing from the global RNGs in a worker: not the same numbers
    # on every rank.
    assert [d["torch"] for d in r0] != [d["torch"] for d in r1]
    assert [d["numpy"] for d in r0] != [d["numpy"] for d in r1]
    # ... and still reproducible (a resume gives the same draws).
    assert [d["torch"] for d in _draws(0, 2)] == [d["torch"] for d in r0]


def test_eval_loader_leaves_the_global_torch_rng_alone(root: Path) -> None:
    dm = DemoRoIDataModule(**dm_kwargs(root))
    dm.prepare_data()
    dm.setup("validate")
    loader = EvalLoader(dm.val_roidb, dm.cfg, ims_per_batch=4)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    for _ in loader:
        pass
    assert torch.equal(torch.get_rng_state(), before)


class _Trainer:
    def __init__(self, rank: int) -> None:
        self.global_rank = rank
        self.sanity_checking = False


class _Module:
    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log(self, key: str, value: float, **kw: Any) -> None:
        self.logged[key] = value


def _gather_worker(rank: int, env: dict[str, str], out: str) -> None:
    os.environ.update(env)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        from lit_roidata.evaluation import COCOEvaluator

        def no_all_gather(*a: Any, **k: Any) -> None:
            raise AssertionError("all_gather_object copies every detection to every rank")

        dist.all_gather_object = no_all_gather  # type: ignore[assignment]
        ev = COCOEvaluator()
        ev._dets = [{"image_id": 10 * rank + i} for i in range(rank + 1)]
        seen: list[int] = []

        def evaluate(dets: Any, **kw: Any) -> dict[str, float]:
            seen.extend(d["image_id"] for d in dets)
            return {"val/n": float(len(dets))}

        ev.evaluate = evaluate  # type: ignore[method-assign]
        module = _Module()
        ev._finish(_Trainer(rank), module, "val")  # type: ignore[arg-type]
        Path(f"{out}.{rank}").write_text(f"{sorted(seen)};{module.logged}")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_coco_detections_are_gathered_to_rank_0_only(tmp_path: Path) -> None:
    out = str(tmp_path / "res")
    with ddp_rendezvous_env() as env:
        mp.start_processes(_gather_worker, args=(env, out), nprocs=2, join=True,
                           start_method="fork")
    assert Path(f"{out}.0").read_text() == "[0, 10, 11];{'val/n': 3.0}"
    assert Path(f"{out}.1").read_text() == "[];{'val/n': 3.0}"
