"""Training under the Lightning ``Trainer``: does the GPU ever wait for data?

Each configuration trains ``RoIDataModule`` + ``Trainer`` for ``--passes`` passes (at least
3, so that two pass boundaries are crossed) and prints, from a callback:

* the step time (median),
* the data wait: from one step's ``on_train_batch_end`` (after a device synchronize) to the
  next ``on_train_batch_start`` (the fetch, the copy to the device and
  ``on_after_batch_transfer``), as a median, a total (and its share of the steps' time)
  and the largest waits with their steps (a pass boundary is where a loader that restarts
  its workers shows),
* the loader alone (the train loader iterated without a model), in images/s,
* the peak GPU memory (CUDA).

On a GPU (default): Mask R-CNN R50-FPN (torchvision's, ``TorchvisionDetector``, random
init) on synthetic COCO-size JPEGs at Detectron's e2e settings (800x1333, flips, aspect
grouping), batch sizes ``--batch-sizes`` x workers ``--workers``, precision ``--precision``
(``32`` and ``bf16-mixed`` by default), infinite mode.

``--cpu-proxy``: no GPU needed. The model's step sleeps ``--step-ms`` (150 ms) on the CPU;
24 images, 4 per batch at 320 px, 2 workers, in epoch and infinite mode and with the skip
policy off and on (one truncated JPEG in the data). The acceptance check of the pass
boundaries: the largest wait at most ``--max-wait-ms`` (50 ms).

Run: ``python benchmarks/gpu_train.py --cpu-proxy`` or ``python benchmarks/gpu_train.py``
(CUDA). Every configuration runs in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


# --------------------------------------------------------------------------- data
def make_data(root: Path, n_images: int, corrupt: bool) -> tuple[str, str]:
    """COCO-style json + real JPEGs (``loader_vs_peers``'s generator); ``corrupt``: the
    JPEG of the third image is cut in half (a bad image for the skip policy)."""
    from loader_vs_peers import make_dataset

    ann, img_dir = make_dataset(root, n_images)
    if corrupt:
        with open(ann) as fh:
            name = json.load(fh)["images"][2]["file_name"]
        path = Path(img_dir) / name
        data = path.read_bytes()
        if len(data) > 1000:
            path.write_bytes(data[: len(data) // 2])
    return ann, img_dir


# --------------------------------------------------------------------------- one run
def run_one(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train one configuration; returns its figures."""
    import pytorch_lightning as pl
    import torch

    from lit_roidata import RoIDataModule
    from lit_roidata.callbacks import BadImageReport
    from lit_roidata.catalog import DatasetCatalog

    cuda = not cfg["cpu_proxy"]
    name = f"gpu_train_{os.getpid()}"
    DatasetCatalog.register(name, cfg["img_dir"], cfg["ann"], overwrite=True)
    mb = int(cfg["batch"])
    over = {"MODEL.NUM_CLASSES": 81, "TRAIN.SCALES": [cfg["scale"]],
            "TRAIN.MAX_SIZE": cfg["max_size"], "TRAIN.IMS_PER_BATCH": mb,
            "TRAIN.ASPECT_GROUPING": True, "TRAIN.USE_FLIPPED": True}
    skip = bool(cfg["skip"])

    def module() -> RoIDataModule:
        return RoIDataModule(
            model_type="mask_rcnn_fpn", overrides=over, datasets={"train": [name]},
            sources={"cache_dir": cfg["cache"], "on_bad_image": "skip" if skip else "raise"},
            loader={"num_workers": cfg["workers"], "pin_memory": cuda},
            output={"output_format": "torchvision"},
            sampling={"infinite": cfg["mode"] == "infinite"})

    # The loader alone: images/s over two passes after one warm-up batch.
    dm = module()
    dm.prepare_data()
    dm.setup("fit")
    loader = dm.train_dataloader()
    per_pass = len(loader)
    it = iter(loader)
    next(it)
    t0, n = time.perf_counter(), 0
    for _ in range(min(2 * per_pass, 200)):
        try:
            next(it)
        except StopIteration:
            it = iter(loader)
            next(it)
        n += mb
    loader_img_s = n / (time.perf_counter() - t0)
    del it
    loader.close()
    del dm, loader

    class DataWait(pl.Callback):
        def __init__(self) -> None:
            self.last: float | None = None
            self.start = 0.0
            self.waits: list[tuple[int, float]] = []
            self.steps: list[float] = []

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                 batch_idx: int) -> None:
            now = time.perf_counter()
            if self.last is not None:
                self.waits.append((trainer.global_step, now - self.last))
            self.start = now

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            self.steps.append(now - self.start)
            self.last = now

    if cfg["cpu_proxy"]:
        class SleepStep(pl.LightningModule):
            """A model whose step takes ``step_ms`` and touches the batch lightly."""

            def __init__(self) -> None:
                super().__init__()
                self.w = torch.nn.Parameter(torch.zeros(1))

            def training_step(self, batch: Any, batch_idx: int) -> Any:
                time.sleep(cfg["step_ms"] / 1000)
                return self.w.sum() * 0.0 + float(len(batch[0])) * 0.0

            def configure_optimizers(self) -> Any:
                return torch.optim.SGD(self.parameters(), lr=0.0)

        model: Any = SleepStep()
    else:
        from lit_roidata.models import TorchvisionDetector

        model = TorchvisionDetector(arch="maskrcnn_resnet50_fpn", num_classes=81, weights=None,
                                    lr=0.02 * mb / 16, warmup_iters=20)
    waits = DataWait()
    callbacks: list[Any] = [waits] + ([BadImageReport()] if skip else [])
    dm = module()
    steps_total = int(cfg["passes"]) * per_pass
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=1, precision=cfg["precision"],
        max_epochs=int(cfg["passes"]) if cfg["mode"] == "epoch" else -1,
        max_steps=steps_total if cfg["mode"] == "infinite" else -1,
        limit_val_batches=0, num_sanity_val_steps=0, enable_checkpointing=False,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    wall = time.perf_counter() - t0
    w = [x for _, x in waits.waits]
    top = sorted(waits.waits, key=lambda sw: -sw[1])[:3]
    return {**{k: cfg[k] for k in ("mode", "skip", "batch", "workers", "precision")},
            "steps": len(waits.steps), "per_pass": per_pass,
            "step_ms": 1000 * statistics.median(waits.steps),
            "wait_median_ms": 1000 * statistics.median(w) if w else 0.0,
            "wait_total_s": sum(w), "wait_share": sum(w) / max(sum(waits.steps), 1e-9),
            "largest": [(s, round(1000 * x, 1)) for s, x in top],
            "train_img_s": len(waits.steps) * mb / wall, "loader_img_s": loader_img_s,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


# --------------------------------------------------------------------------- driver
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-proxy", action="store_true",
                    help="sleep-step model on the CPU (no GPU needed)")
    ap.add_argument("--batch-sizes", default=None, help="comma list (GPU: 2,8,16; proxy: 4)")
    ap.add_argument("--workers", default=None, help="comma list (GPU: 4,14; proxy: 2)")
    ap.add_argument("--precision", default=None, help="comma list (GPU: 32,bf16-mixed)")
    ap.add_argument("--modes", default=None, help="epoch,infinite (GPU: infinite)")
    ap.add_argument("--skip", default=None, help="off,on (GPU: off)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--images", type=int, default=None, help="GPU: 16 x 49; proxy: 24")
    ap.add_argument("--step-ms", type=float, default=150.0)
    ap.add_argument("--max-wait-ms", type=float, default=50.0)
    ap.add_argument("--root", default=None, help="data folder (default: a temp folder)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(run_one(json.loads(args.one))), flush=True)
        return 0
    proxy = args.cpu_proxy
    if not proxy:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: run with --cpu-proxy")
            return 0

    def lst(value: str | None, default: str) -> list[str]:
        return (value or default).split(",")

    batches = [int(b) for b in lst(args.batch_sizes, "4" if proxy else "2,8,16")]
    workers = [int(w) for w in lst(args.workers, "2" if proxy else "4,14")]
    precisions = lst(args.precision, "32" if proxy else "32,bf16-mixed")
    modes = lst(args.modes, "epoch,infinite" if proxy else "infinite")
    skips = lst(args.skip, "off,on" if proxy else "off")
    n_images = args.images or (24 if proxy else 16 * 49)
    tmp = tempfile.mkdtemp(prefix="gpu_train_")
    root = Path(args.root or tmp)
    results, failed = [], []
    for skip in skips:
        ann, img_dir = make_data(root / f"data_{n_images}_{skip}", n_images, skip == "on")
        for mode in modes:
            for mb in batches:
                for nw in workers:
                    for prec in precisions:
                        cfg = {"cpu_proxy": proxy, "ann": ann, "img_dir": img_dir,
                               "cache": str(root / f"cache_{skip}"), "batch": mb,
                               "workers": nw, "precision": prec, "mode": mode,
                               "skip": skip == "on", "passes": max(3, args.passes),
                               "step_ms": args.step_ms, "scale": 320 if proxy else 800,
                               "max_size": 533 if proxy else 1333}
                        out = subprocess.run([sys.executable, __file__, "--one",
                                              json.dumps(cfg)], capture_output=True, text=True)
                        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                        if out.returncode or not line:
                            print(out.stdout[-2000:], out.stderr[-4000:], file=sys.stderr)
                            failed.append(cfg)
                            continue
                        res = json.loads(line[0][7:])
                        results.append(res)
                        print(f"{res['mode']:8s} skip={'on ' if res['skip'] else 'off'} "
                              f"{res['batch']:2d} x {res['workers']:2d} {res['precision']:>10s}"
                              f" | steps {res['steps']} ({res['per_pass']}/pass) step "
                              f"{res['step_ms']:.1f} ms | wait median "
                              f"{res['wait_median_ms']:.1f} ms, total {res['wait_total_s']:.2f}"
                              f" s ({100 * res['wait_share']:.1f}% of the steps), largest "
                              f"{res['largest']} | train {res['train_img_s']:.1f} img/s, "
                              f"loader alone {res['loader_img_s']:.0f} img/s"
                              + (f" | peak {res['peak_gib']:.2f} GiB" if res['peak_gib']
                                 else ""), flush=True)
    if proxy and results:
        worst = max(w for r in results for _, w in r["largest"])
        verdict = "PASS" if worst <= args.max_wait_ms else "FAIL"
        print(f"largest data wait over all runs: {worst:.1f} ms (bound {args.max_wait_ms:.0f}"
              f" ms): {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
