"""BroadcastParameters, COCOEvaluator and LVISEvaluator in a real 2-process
Trainer(strategy="ddp") (CPU).

The test runs this file as a script; Lightning's launcher starts rank 1 by running the
same command again. Every rank starts from different random weights; rank 0 loads a
Detectron-style pickle through a name-mapping hook; after ``setup`` all replicas must
be identical. Each rank validates a different shard of a tiny COCO set and returns
perfect detections: the evaluator must gather both shards (AP 1.0 over all images) and
log the same value on both ranks. The tiny set is also valid LVIS (category frequencies,
empty neg / not-exhaustive lists), so LVISEvaluator gathers the same way.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

try:
    from conftest import LIGHTNING_NAMESPACES
except ImportError:  # run as the DDP script (no pytest conftest on the path)
    LIGHTNING_NAMESPACES = []

from ports import ddp_rendezvous_env

pytestmark = pytest.mark.slow  # peer processes / DDP launches

REPO = Path(__file__).resolve().parents[1]
IMAGES = (3, 5, 8, 13, 21)


def _tiny_coco(out: Path) -> str:
    images = [{"id": i, "file_name": f"{i}.jpg", "width": 64, "height": 48,
               "neg_category_ids": [], "not_exhaustive_category_ids": []} for i in IMAGES]
    anns = [{"id": k + 1, "image_id": i, "category_id": 10 + k % 2,
             "bbox": [4.0 + k, 6.0, 20.0, 16.0 + k], "area": 320.0, "iscrowd": 0,
             "segmentation": [[4, 6, 24, 6, 24, 22, 4, 22]]} for k, i in enumerate(IMAGES)]
    cats = [{"id": 10, "name": "a", "frequency": "f"}, {"id": 11, "name": "b", "frequency": "r"}]
    path = out / "tiny.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return str(path)


def _main(out_dir: str, namespace: str = "pytorch_lightning") -> None:
    import importlib

    import torch

    from lit_roidata._lightning import bind
    from lit_roidata.callbacks import BroadcastParameters
    from lit_roidata.evaluation import COCOEvaluator
    from lit_roidata.lvis_evaluation import LVISEvaluator

    # pytorch_lightning with lit_roidata's classes, or lightning.pytorch with
    # lit_roidata.lightning's (the same classes bound to it).
    pl = importlib.import_module(namespace)
    BroadcastParameters = bind(BroadcastParameters, namespace)  # noqa: N806
    COCOEvaluator = bind(COCOEvaluator, namespace)  # noqa: N806
    LVISEvaluator = bind(LVISEvaluator, namespace)  # noqa: N806

    out = Path(out_dir)
    rank_env = int(os.environ.get("LOCAL_RANK", 0))
    coco = json.loads(Path(out, "tiny.json").read_text())

    class Model(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1000 + rank_env)  # a different init on every rank
            self.body = torch.nn.Linear(3, 4)
            self.head = torch.nn.Linear(4, 2)
            self.register_buffer("stat", torch.randn(4))

        def training_step(self, batch, batch_idx):
            return self.head(self.body(batch)).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.ones(4, 3), batch_size=2)

        def val_dataloader(self):
            # rank r validates images r, r+2, ...: uneven shards on purpose
            mine = list(range(len(IMAGES)))[self.trainer.global_rank::2]
            return torch.utils.data.DataLoader(torch.tensor(mine), batch_size=1)

        def validation_step(self, batch, batch_idx):
            a = coco["annotations"][int(batch[0])]
            x, y, w, h = a["bbox"]
            return {"detections": [{
                "image_id": a["image_id"], "dataset": "tiny",
                "boxes": np.array([[x, y, x + w - 1, y + h - 1]]), "scores": np.array([0.9]),
                "labels": np.array([a["category_id"] - 9])}]}

        def on_fit_start(self) -> None:
            torch.save(self.state_dict(), out / f"fit_start{self.global_rank}.pt")

        def on_train_end(self) -> None:
            ev = next(c for c in self.trainer.callbacks if type(c) is COCOEvaluator)
            lv = next(c for c in self.trainer.callbacks if isinstance(c, LVISEvaluator))
            Path(out, f"metrics{self.global_rank}.json").write_text(json.dumps(
                {"last": ev.last_metrics, "lvis_last": lv.last_metrics, "logged": {
                    k: float(v) for k, v in self.trainer.callback_metrics.items()
                    if k.startswith("val/")}}))

    def name_map(name: str):  # torch names -> Detectron blob names
        return {"body.weight": "body_w", "body.bias": "body_b"}.get(name)

    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the val loaders are sharded by hand
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[BroadcastParameters(str(out / "w.pkl"), name_map=name_map, trust_pickle=True),
                   COCOEvaluator(annotation_files={"tiny": str(out / "tiny.json")},
                                 output_dir=str(out / "results"), print_summary=False),
                   LVISEvaluator(annotation_files={"tiny": str(out / "tiny.json")},
                                 print_summary=False)])
    trainer.fit(Model())


@pytest.fixture(scope="module", params=LIGHTNING_NAMESPACES)
def ddp_run(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """The 2-process run, once per Lightning namespace."""
    out = tmp_path_factory.mktemp("ddp_cb")
    _tiny_coco(out)
    rng = np.random.default_rng(3)
    blobs = {"body_w": rng.normal(size=(4, 3)).astype(np.float32),
             "body_b": rng.normal(size=4).astype(np.float32)}
    with open(out / "w.pkl", "wb") as f:
        pickle.dump({"blobs": blobs}, f, protocol=2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
        env.pop(key, None)
    with ddp_rendezvous_env() as rendezvous:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(out),
                               request.param], cwd=out, env={**env, **rendezvous},
                              capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.timeout(300)
def test_ddp_replicas_equal_rank0_weights(ddp_run: Path) -> None:
    import torch

    s0, s1 = (torch.load(ddp_run / f"fit_start{r}.pt") for r in (0, 1))
    for k in s0:
        assert torch.equal(s0[k], s1[k]), k
    with open(ddp_run / "w.pkl", "rb") as f:
        blobs = pickle.load(f)["blobs"]
    np.testing.assert_array_equal(s1["body.weight"].numpy(), blobs["body_w"])
    # not in the file: rank 0's random init, broadcast (rank 1 drew another one)
    torch.manual_seed(1001)
    rank1_init = torch.nn.Linear(3, 4), torch.nn.Linear(4, 2), torch.randn(4)
    assert not torch.equal(s1["stat"], rank1_init[2])


@pytest.mark.timeout(300)
def test_ddp_evaluator_gathers_all_ranks(ddp_run: Path) -> None:
    m0, m1 = (json.loads((ddp_run / f"metrics{r}.json").read_text()) for r in (0, 1))
    assert m0["last"]["val/bbox_AP"] == pytest.approx(1.0)
    assert m0["last"] == m1["last"] and m0["logged"] == m1["logged"]
    assert m1["logged"]["val/bbox_AP50"] == pytest.approx(1.0)
    results = json.loads((ddp_run / "results" / "val_bbox_tiny_results.json").read_text())
    assert sorted(r["image_id"] for r in results) == list(IMAGES)  # both shards
    # LVISEvaluator: the same gathering (perfect boxes on both shards: every AP is 1)
    assert m0["lvis_last"] == m1["lvis_last"]
    for s in ("AP", "APr", "APf"):
        assert m0["lvis_last"][f"val/lvis_bbox_{s}"] == pytest.approx(1.0), s
        assert m1["logged"][f"val/lvis_bbox_{s}"] == pytest.approx(1.0), s
    assert m0["lvis_last"]["val/lvis_bbox_APc"] == -1  # no common category


if __name__ == "__main__":
    _main(*sys.argv[1:3])
