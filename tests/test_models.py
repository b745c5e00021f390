"""lit_roidata.models: TorchvisionDetector (no second resize, Detectron normalisation and
solver, original coordinates, weights) and every demo config family end to end (fit with
the loss going down, validate printing AP, predict writing COCO results)."""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from lit_roidata.config import get_cfg
from lit_roidata.minibatch.torchvision_format import to_continuous_boxes
from lit_roidata.models import ARCHS, TorchvisionDetector, detectron_solver_kwargs

from datamodule_support import REPO, SMALL_DEMO, TINY_OVERRIDES

SMALL_RCNN = {"rpn_pre_nms_top_n_train": 200, "rpn_post_nms_top_n_train": 100,
              "rpn_pre_nms_top_n_test": 200, "rpn_post_nms_top_n_test": 100,
              "box_batch_size_per_image": 64}


def _tiny(arch: str = "fasterrcnn_resnet50_fpn", **kw: Any) -> TorchvisionDetector:
    kw.setdefault("backbone", None if "mobilenet" in arch else "resnet18")
    kw.setdefault("num_classes", 5)
    if "retinanet" not in arch:
        kw.setdefault("detector_kwargs", dict(SMALL_RCNN))
    return TorchvisionDetector(arch, **kw)


# -- solver ----------------------------------------------------------------------------
def test_lr_multiplier_is_detectrons_warmup_and_steps() -> None:
    m = _tiny(lr=0.02, lr_steps=[0, 6, 9], gamma=0.1, warmup_iters=4, warmup_factor=1 / 3)
    # Detectron: linear warm-up factor*(1-a)+a with a = it/warm, then gamma^k after STEPS
    want = [1 / 3, 1 / 3 * 0.75 + 0.25, 1 / 3 * 0.5 + 0.5, 1 / 3 * 0.25 + 0.75, 1, 1,
            0.1, 0.1, 0.1, 0.01, 0.01]
    assert [m.lr_multiplier(i) for i in range(11)] == pytest.approx(want)
    c = _tiny(warmup_iters=3, warmup_factor=0.1, warmup_method="constant")
    assert [c.lr_multiplier(i) for i in range(5)] == pytest.approx([0.1, 0.1, 0.1, 1, 1])


def test_biases_get_double_lr_and_no_weight_decay() -> None:
    m = _tiny(lr=0.02, weight_decay=1e-4, bias_lr_factor=2.0)
    opt = m.configure_optimizers()["optimizer"]
    w, b = opt.param_groups
    assert (w["initial_lr"], w["weight_decay"]) == (0.02, 1e-4)
    assert (b["initial_lr"], b["weight_decay"]) == (0.04, 0.0)
    assert w["lr"] == pytest.approx(0.02 / 3)  # the warm-up's first factor is applied
    names = {id(p): n for n, p in m.named_parameters()}
    assert all(names[id(p)].endswith(".bias") for p in b["params"])
    assert not any(names[id(p)].endswith(".bias") for p in w["params"])


def test_detectron_solver_kwargs() -> None:
    cfg = get_cfg()
    cfg.merge_from_dict({"SOLVER.BASE_LR": 0.01, "SOLVER.STEPS": [0, 60000, 80000],
                         "SOLVER.LR_POLICY": "steps_with_decay", "SOLVER.WEIGHT_DECAY": 1e-4,
                         "SOLVER.WARM_UP_ITERS": 500, "MODEL.NUM_CLASSES": 81})
    kw = detectron_solver_kwargs(cfg)
    assert kw["lr"] == 0.01 and kw["lr_steps"] == [60000, 80000] and kw["num_classes"] == 81
    assert kw["bias_lr_factor"] == 2.0 and kw["bias_weight_decay"] is False
    m = _tiny(**{**kw, "num_classes": 5})
    assert m.lr_multiplier(60000) == pytest.approx(0.1)


# -- inputs and outputs ----------------------------------------------------------------
def test_transform_keeps_the_loader_size() -> None:
    m = _tiny().eval()
    ims = [torch.zeros(3, 70, 90), torch.zeros(3, 96, 64)]
    il, _ = m.net.transform(ims)
    assert il.image_sizes == [(70, 90), (96, 64)]  # torchvision would scale to 800
    assert il.tensors.shape[-2:] == (96, 96)  # padded to a multiple of 32 only


def test_normalisation_matches_the_detectron_blob() -> None:
    """uint8 RGB (torchvision format) and Detectron's float BGR-minus-means blob of the
    same image give the same network input; 'torchvision' gives ImageNet's."""
    rng = np.random.default_rng(0)
    bgr = rng.integers(0, 256, (3, 8, 9)).astype(np.uint8)
    means = np.array(get_cfg().PIXEL_MEANS, np.float32).reshape(3, 1, 1)
    m = _tiny()
    from_rgb = m._prepare(torch.from_numpy(bgr[::-1].copy()), rgb_uint8=True)
    from_blob = m._prepare(torch.from_numpy(bgr.astype(np.float32) - means), rgb_uint8=False)
    torch.testing.assert_close(from_rgb, torch.from_numpy(bgr.astype(np.float32) - means))
    torch.testing.assert_close(from_blob, from_rgb)
    t = _tiny(normalize="torchvision")
    rgb01 = bgr[::-1].astype(np.float32) / 255
    want = (rgb01 - np.array([0.485, 0.456, 0.406]).reshape(3, 1, 1)) / \
        np.array([0.229, 0.224, 0.225]).reshape(3, 1, 1)
    got = t._prepare(torch.from_numpy(bgr.astype(np.float32) - means), rgb_uint8=False)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


def test_detections_map_back_to_original_coordinates() -> None:
    """The loader's box and keypoint conventions, inverted: a gt box in the scaled frame
    comes back as the Detectron (inclusive) box; a keypoint as its pixel index."""
    m = _tiny()
    gt = np.array([[10, 20, 29, 39], [0, 0, 99, 49]], np.float32)
    s = 1.37
    raw = {"boxes": torch.from_numpy(to_continuous_boxes(gt, s)),
           "scores": torch.tensor([0.9, 0.8]), "labels": torch.tensor([1, 4]),
           "keypoints": torch.tensor([[[(12 + 0.5) * s, (30 + 0.5) * s, 1.0]]] * 2),
           "keypoints_scores": torch.tensor([[3.0], [2.0]])}
    meta = {"im_scales": [s], "heights": [50], "widths": [100], "image_ids": [7],
            "datasets": ["d"]}
    out = m._to_original(raw, meta, 0)
    np.testing.assert_allclose(out["boxes"], gt, atol=1e-4)
    np.testing.assert_allclose(out["keypoints"][0, 0], [12, 30, 3.0], atol=1e-4)
    assert out["image_id"] == 7 and out["labels"].tolist() == [1, 4]


def test_masks_are_pasted_at_original_size_as_rle() -> None:
    import pycocotools.mask as mask_util

    m = _tiny("maskrcnn_resnet50_fpn")
    raw = {"boxes": torch.tensor([[20.0, 10.0, 60.0, 30.0]]), "scores": torch.tensor([0.9]),
           "labels": torch.tensor([2]), "masks": torch.ones(1, 1, 28, 28)}
    meta = {"im_scales": [2.0], "heights": [40], "widths": [50], "image_ids": [1],
            "datasets": ["d"]}
    out = m._to_original(raw, meta, 0)
    full = mask_util.decode(out["masks"][0])
    assert full.shape == (40, 50)
    ys, xs = np.nonzero(full)  # box (10, 5)-(30, 15) in continuous original coordinates
    got = np.array([xs.min(), xs.max(), ys.min(), ys.max()])
    assert np.abs(got - [10, 29, 5, 14]).max() <= 1, got  # paste_masks' 1-pixel border


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="arch="):
        TorchvisionDetector("fasterrcnn_resnet18", num_classes=5)
    with pytest.raises(ValueError, match="backbone="):
        TorchvisionDetector("fasterrcnn_mobilenet_v3_large_fpn", 5, backbone="resnet18")
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        _tiny(weights="/nonexistent/nope.pth")
    with pytest.raises(TypeError, match="output_format"):
        _tiny().training_step({"data": torch.zeros(1, 3, 8, 8)}, 0)


def test_local_weights_load_and_skip_other_class_counts(tmp_path: Path) -> None:
    a = _tiny(num_classes=5)
    path = tmp_path / "w.pth"
    torch.save(a.net.state_dict(), path)
    b = _tiny(num_classes=5, weights=str(path))
    for (k, v), w in zip(a.net.state_dict().items(), b.net.state_dict().values()):
        assert torch.equal(v, w), k
    c = _tiny(num_classes=3, weights=str(path))  # predictor re-initialised, rest loaded
    assert torch.equal(c.net.backbone.body.conv1.weight, a.net.backbone.body.conv1.weight)
    assert c.net.roi_heads.box_predictor.cls_score.out_features == 3
    # Only tensors are unpickled: a file holding other objects is refused, no fallback.
    torch.save({"state_dict": a.net.state_dict(), "odd": Path("x")}, tmp_path / "odd.ckpt")
    with pytest.raises(ValueError, match=r"odd\.ckpt: torch\.load\(weights_only=True\) "
                       r"refused.*torch\.save"):
        _tiny(num_classes=5, weights=str(tmp_path / "odd.ckpt"))


def test_every_arch_builds_without_download() -> None:
    for arch in ARCHS:
        m = TorchvisionDetector(arch, num_classes=3, backbone=None if "mobilenet" in arch
                                else "resnet18")
        assert m.hparams.weights is None and m.normalize_mode == "detectron"
        assert (getattr(m.net, "rpn", 0) is None) == (arch == "fastrcnn_resnet50_fpn")


def test_full_configs_name_a_real_detector() -> None:
    """The COCO baseline configs build their model (weights_backbone off: no download)."""
    for name in ("e2e_faster_rcnn_R-50-FPN_1x", "e2e_mask_rcnn_R-50-FPN_1x",
                 "e2e_keypoint_rcnn_R-50-FPN_1x", "retinanet_R-50-FPN_1x",
                 "fast_rcnn_R-50-FPN_1x"):
        cfg = yaml.safe_load((REPO / "configs" / f"{name}.yaml").read_text())
        assert cfg["model"]["class_path"] == "lit_roidata.models.TorchvisionDetector"
        assert cfg["data"]["init_args"]["output"]["output_format"] == "torchvision"
        args = {**cfg["model"]["init_args"], "weights_backbone": None}
        m = TorchvisionDetector(**args)
        assert m.hparams.num_classes == cfg["data"]["init_args"]["overrides"]["MODEL"][
            "NUM_CLASSES"]


# -- end to end, per family ------------------------------------------------------------
FAMILIES = ["faster_rcnn", "mask_rcnn", "keypoint_rcnn", "retinanet", "fast_rcnn"]


def _small_config(root: Path, family: str, tmp: Path, steps: int) -> Path:
    """configs/demo_<family>.yaml on the tiny demo, a few steps, everything under ``tmp``."""
    cfg = copy.deepcopy(yaml.safe_load((REPO / "configs" / f"demo_{family}.yaml").read_text()))
    t = cfg["trainer"]
    t.update({"max_steps": steps, "val_check_interval": steps, "log_every_n_steps": 1,
              "default_root_dir": str(tmp / "runs"), "enable_model_summary": False,
              "enable_progress_bar": False})
    t["logger"]["init_args"]["save_dir"] = str(tmp / "runs")
    for cb in t["callbacks"]:
        if "dirpath" in cb.get("init_args", {}):
            cb["init_args"]["dirpath"] = str(tmp / cb["class_path"].rsplit(".", 1)[-1])
    d = cfg["data"]["init_args"]
    d.update({"demo_root": str(root / "data"), "demo_size": dict(SMALL_DEMO)})
    d["sources"] = dict(d.get("sources") or {}, cache_dir=str(root / "cache"))
    d["loader"] = dict(d.get("loader") or {}, num_workers=0)
    d["overrides"].update({k: v for k, v in TINY_OVERRIDES.items()
                           if k.startswith(("TRAIN.SCALES", "TRAIN.MAX", "TEST."))})
    mi = cfg["model"]["init_args"]
    # Fast R-CNN on these tiny batches is at the edge of stability at 0.01 (0.02 diverges;
    # whether 10 steps at 0.01 end below the start depends on float noise): half of it.
    mi.update({"warmup_iters": 2, "lr": 0.005 if family == "fast_rcnn" else 0.01})
    if "detector_kwargs" in mi and family != "fast_rcnn":
        mi["detector_kwargs"] = dict(SMALL_RCNN)
    out = tmp / f"demo_{family}.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def _losses(run_dir: Path) -> list[float]:
    rows = []
    for f in sorted(run_dir.rglob("metrics.csv")):
        with open(f) as fh:
            rows += [float(r["train/loss"]) for r in csv.DictReader(fh) if r.get("train/loss")]
    return rows


@torch.no_grad()
def _fixed_batch_loss(model: TorchvisionDetector, batches: list) -> float:
    """Mean training loss of ``model`` on ``batches`` (train mode, no update). The RNG is
    reset first, so the heads' random fg/bg sampling is the same for every model compared."""
    model.train()
    torch.manual_seed(0)
    return float(np.mean([sum(model.forward_losses(*model._train_inputs(b)).values()).item()
                          for b in batches]))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_family_fits_validates_and_predicts(root: Path, tmp_path: Path, family: str,
                                            capsys: Any) -> None:
    from pycocotools.coco import COCO

    from lit_roidata.cli import main

    steps = 10
    cfg = _small_config(root, family, tmp_path, steps)
    assert main(["fit", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "COCO evaluation (val)" in out
    losses = _losses(tmp_path / "runs")
    assert len(losses) == steps and all(np.isfinite(losses))
    ckpt = tmp_path / "ModelCheckpoint" / "last.ckpt"
    assert ckpt.is_file()
    # The loss goes down: the first training batches (the data module's own stream) have a
    # lower loss under the trained weights than under the initial ones. Per-step losses
    # of 2-image batches are too noisy to compare over a few steps.
    import lit_roidata

    spec = yaml.safe_load(cfg.read_text())
    cls = getattr(lit_roidata, spec["data"]["class_path"].rsplit(".", 1)[1])
    dm = cls(**spec["data"]["init_args"])
    dm.prepare_data()
    dm.setup("fit")
    loader = iter(dm.train_dataloader())
    batches = [next(loader) for _ in range(4)]
    torch.manual_seed(0)
    before = _fixed_batch_loss(TorchvisionDetector(**spec["model"]["init_args"]), batches)
    after = _fixed_batch_loss(TorchvisionDetector.load_from_checkpoint(str(ckpt)), batches)
    assert after < before, (before, after, losses)
    assert main(["validate", "--config", str(cfg), "--ckpt_path", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "COCO evaluation (val)" in out and "bbox" in out
    if family == "mask_rcnn":
        assert "segm" in out
    if family == "keypoint_rcnn":
        assert "keypoints" in out

    assert main(["predict", "--config", str(cfg), "--ckpt_path", str(ckpt)]) == 0
    path = tmp_path / "runs" / "predictions" / "demo_val.json"
    assert f"predictions (demo_val): {path}" in capsys.readouterr().out
    results = json.loads(path.read_text())
    gt = COCO(str(root / "data" / "demo_val" / "annotations.json"))
    if results:  # a few steps from scratch may leave every score under the threshold
        dt = gt.loadRes(str(path))
        assert set(dt.getImgIds()) <= set(gt.getImgIds())
        assert {r["category_id"] for r in results} <= set(gt.getCatIds())
        if family == "mask_rcnn":
            assert all("segmentation" in r for r in results)
        if family == "keypoint_rcnn":
            assert all(len(r["keypoints"]) == 3 * 17 for r in results)


def _readme_example() -> str:
    text = (REPO / "README.md").read_text()
    start = text.index("## Using your own COCO data")
    block = text[text.index("```python", start) + len("```python"):]
    return block[: block.index("```")]


@pytest.mark.slow
def test_readme_example_runs_as_written(root: Path, tmp_path: Path, monkeypatch: Any) -> None:
    """The README's Python example, on a COCO-layout copy of the demo data, with only the
    sizes shrunk (no download, CPU, 2 steps, small scales)."""
    from lit_roidata.demo import register_demo_datasets
    from lit_roidata.catalog import Catalog

    demo = register_demo_datasets(str(root / "data"), Catalog(), num_images=dict(SMALL_DEMO))
    assert demo.train_datasets  # the demo exists under root/data
    coco = tmp_path / "data" / "coco"
    (coco / "annotations").mkdir(parents=True)
    (coco / "coco_train2014").symlink_to(root / "data" / "demo_train_a" / "images")
    (coco / "coco_val2014").symlink_to(root / "data" / "demo_val" / "images")
    for name, src in (("instances_train2014", "demo_train_a"),
                      ("instances_valminusminival2014", "demo_val"),
                      ("instances_minival2014", "demo_val")):
        (coco / "annotations" / f"{name}.json").write_text(
            (root / "data" / src / "annotations.json").read_text())
    # The Detectron YAML the example names, at CPU-test sizes.
    det = yaml.safe_load((REPO / "configs/detectron/e2e_mask_rcnn_R-50-FPN_1x.yaml").read_text())
    det["TRAIN"].update({"SCALES": [96], "MAX_SIZE": 128, "BATCH_SIZE_PER_IM": 64})
    det["TEST"].update({"SCALE": 96, "MAX_SIZE": 128})
    small = tmp_path / "e2e_mask_rcnn_R-50-FPN_1x.yaml"
    small.write_text(yaml.safe_dump(det))

    code = _readme_example()
    for old, new in (('"configs/detectron/e2e_mask_rcnn_R-50-FPN_1x.yaml"', repr(str(small))),
                     ('"/data"', repr(str(tmp_path / "data"))),
                     ("{\"num_workers\": 4}", "{\"num_workers\": 0}"),
                     ('weights_backbone="IMAGENET1K_V1"',
                      'weights_backbone=None, backbone="resnet18", cpu_threads=1'),
                     ('strategy="ddp", devices=8', 'accelerator="cpu", devices=1, logger=False, '
                                                  'enable_checkpointing=False'),
                     ("max_steps=dm.cfg.SOLVER.MAX_ITER", "max_steps=2")):
        assert old in code, old
        code = code.replace(old, new)
    monkeypatch.setenv("LIT_ROIDATA_CACHE", str(tmp_path / "cache"))
    scope: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["trainer"].global_step == 2
    assert scope["model"].hparams.lr == 0.02 and scope["model"].hparams.num_classes == 81


# -- mixed precision -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("precision,accelerator", [
    ("bf16-mixed", "cpu"),
    pytest.param("16-mixed", "cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="16-mixed needs CUDA"))])
def test_mask_rcnn_trains_in_mixed_precision(root: Path, precision: str, accelerator: str
                                             ) -> None:
    """Mask R-CNN from the data module's torchvision batches (compact masks pasted on the
    device) under mixed precision: finite losses, every parameter updated, and a
    validation batch detects under autocast."""
    import pytorch_lightning as pl

    from lit_roidata import DemoRoIDataModule

    from datamodule_support import dm_kwargs

    dm = DemoRoIDataModule(**dm_kwargs(root, output_format="torchvision",
                                       model_type="mask_rcnn_fpn"))
    model = _tiny("maskrcnn_resnet50_fpn", warmup_iters=0, lr=0.01)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses: list[float] = []

    class Record(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            assert batch[1][0]["masks"].dtype == torch.uint8 and "mask_crops" not in batch[1][0]
            losses.append(float(outputs["loss"]))

    trainer = pl.Trainer(precision=precision, accelerator=accelerator, devices=1, max_steps=2,
                         limit_val_batches=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Record()])
    trainer.fit(model, datamodule=dm)
    assert len(losses) == 2 and all(np.isfinite(losses)), losses
    changed = [n for n, p in model.named_parameters() if not torch.equal(p.cpu(), before[n])]
    assert len(changed) == len(before), sorted(set(before) - set(changed))[:5]
