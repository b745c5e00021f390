"""A real 2-process DDP run (CPU, gloo) through Trainer(strategy="ddp").

The test launches this file as a script; Lightning's subprocess launcher then starts
rank 1 by running the same command again. Each rank writes the blocks it trained on, and
the test checks they are disjoint, cover the pass and have equal counts, with
``use_distributed_sampler`` on and off (Lightning must neither replace nor wrap the
loader).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ports import ddp_rendezvous_env

pytestmark = pytest.mark.slow  # peer processes / DDP launches

REPO = Path(__file__).resolve().parents[1]
NUM_IMAGES, MB, EPOCHS = 29, 2, 2


def _sizes() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    w = rng.integers(200, 800, NUM_IMAGES)
    return w, rng.integers(200, 800, NUM_IMAGES)


def _main(out_dir: str) -> None:
    import pytorch_lightning as pl
    import torch

    from lit_roidata.loader import StatefulRoIDataLoader
    from lit_roidata.sampler import RoIBatchSampler

    class Blocks(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return NUM_IMAGES

        def __getitems__(self, block):
            return {"inds": torch.tensor(list(block)),
                    "coords": torch.tensor([block.pass_index, block.block_index])}

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.seen: list = []
            self.loader = None

        def train_dataloader(self):
            w, h = _sizes()
            sampler = RoIBatchSampler(w, h, MB, seed=5, rank=self.trainer.global_rank,
                                      world_size=self.trainer.world_size)
            self.loader = StatefulRoIDataLoader(Blocks(), sampler)
            return self.loader

        def training_step(self, batch, batch_idx):
            self.seen.append([*batch["coords"].tolist(), batch["inds"].tolist()])
            return self.layer(batch["inds"].float()[:, None]).sum() * 0.0

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def on_train_end(self) -> None:
            rank = self.trainer.global_rank
            untouched = self.trainer.train_dataloader is self.loader
            flag = int(self.trainer._accelerator_connector.use_distributed_sampler)
            Path(out_dir, f"uds{flag}-rank{rank}.json").write_text(json.dumps(
                {"seen": self.seen, "untouched": untouched, "len": len(self.loader),
                 "world_size": self.trainer.world_size}))

    # Both settings in one launch: Lightning starts rank 1 once (the second Trainer finds
    # LOCAL_RANK set and reuses the process group), which halves the start-up cost.
    for use_distributed_sampler in (True, False):
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS,
                             use_distributed_sampler=use_distributed_sampler, logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False)
        trainer.fit(Model())


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ddp")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    with ddp_rendezvous_env() as rendezvous:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), str(out)],
            cwd=out, env={**env, **rendezvous}, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("use_distributed_sampler", [True, False])
def test_ddp_two_ranks_disjoint_cover_equal(ddp_run, use_distributed_sampler):
    from lit_roidata.sampler import RoIBatchSampler

    flag = int(use_distributed_sampler)
    ranks = [json.loads((ddp_run / f"uds{flag}-rank{r}.json").read_text()) for r in range(2)]
    assert all(r["untouched"] and r["world_size"] == 2 for r in ranks)
    w, h = _sizes()
    ref = RoIBatchSampler(w, h, MB, seed=5)
    per_rank = len(RoIBatchSampler(w, h, MB, seed=5, world_size=2))
    assert [len(r["seen"]) for r in ranks] == [EPOCHS * per_rank] * 2  # equal counts
    for epoch in range(EPOCHS):
        got = {}
        for r, rank in enumerate(ranks):
            for p, b, inds in rank["seen"][epoch * per_rank:(epoch + 1) * per_rank]:
                assert p == epoch and b % 2 == r  # rank r takes blocks k*2 + r
                assert (p, b) not in got  # disjoint
                got[(p, b)] = inds
        assert sorted(got) == [(epoch, b) for b in range(2 * per_rank)]  # cover the pass
        assert all(got[(epoch, b)] == ref.block(epoch, b) for b in range(2 * per_rank))


if __name__ == "__main__":
    _main(sys.argv[1])
