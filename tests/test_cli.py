"""lit-roidata: --print_config of every config, the demo fit, checkpoint → resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lit_roidata.cli import TOOLS, main

from conftest import LIGHTNING_NAMESPACES
from datamodule_support import REPO, index_recorder, read_records, run_cli, tiny_config

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("namespace", LIGHTNING_NAMESPACES)
@pytest.mark.parametrize("config", [c.name for c in CONFIGS if not c.name.startswith("exchange_")])
def test_print_config_parses_every_config(config: str, namespace: str, capsys: Any) -> None:
    """Every shipped config parses with ``lit-roidata`` and, unchanged, with
    ``python -m lit_roidata.lightning`` (its class paths translated to lightning.pytorch)."""
    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(REPO / "configs" / config), "--print_config"],
             namespace=namespace)
    assert exc.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    import lit_roidata
    from lit_roidata._lightning import bind

    demo = config.startswith("demo") or config.startswith("exchange_")
    name = "DemoRoIDataModule" if demo else "RoIDataModule"
    data_class = bind(getattr(lit_roidata, name), namespace)
    assert printed["data"]["class_path"] == {"pytorch_lightning": f"lit_roidata.{name}",
                                             "lightning.pytorch": "lit_roidata.lightning."
                                             f"{name}"}[namespace]
    assert printed["model"]["class_path"]
    other = "lightning.pytorch" if namespace == "pytorch_lightning" else "pytorch_lightning"
    assert other + "." not in yaml.safe_dump(printed)
    # The data module accepts the Detectron keys of the config (instantiating checks them).
    dm = data_class(**printed["data"]["init_args"])
    assert dm.cfg.TRAIN.IMS_PER_BATCH >= 1


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
def test_evaluation_subcommands_run(root: Path, tmp_path: Path, subcommand: str,
                                    capsys: Any, lightning_ns: Any) -> None:
    cfg = tiny_config(root, tmp_path / "tiny.yaml", trainer={"limit_val_batches": 4,
                                                             "limit_test_batches": 4,
                                                             "limit_predict_batches": 4})
    args = [subcommand, "--config", str(cfg)]
    assert main(args, namespace=lightning_ns.name) == 0
    out = capsys.readouterr().out
    if subcommand != "predict":
        assert "COCO evaluation" in out
    else:  # the shipped demo model predicts; the CLI writes COCO results and says where
        written = yaml.safe_load(cfg.read_text())["trainer"]["default_root_dir"]
        path = Path(written) / "predictions" / "demo_val.json"
        assert f"predictions (demo_val): {path}" in out
        from pycocotools.coco import COCO

        gt = COCO(str(root / "data" / "demo_val" / "annotations.json"))
        dt = gt.loadRes(str(path))  # pycocotools accepts the file
        assert len(dt.getAnnIds()) > 0 and set(dt.getImgIds()) <= set(gt.getImgIds())


def test_top_level_help_lists_the_tools(capsys: Any) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in TOOLS) and "fit" in out


@pytest.mark.slow
@pytest.mark.parametrize("namespace", LIGHTNING_NAMESPACES)
def test_fit_demo_then_resume_continues_the_data_stream_exactly(root: Path, tmp_path: Path,
                                                                namespace: str) -> None:
    """configs/demo.yaml (tiny) trains, validates with COCO AP, checkpoints; a resume
    from the step-3 checkpoint trains exactly the batches an uninterrupted run trains.
    With ``lit-roidata`` and with ``python -m lit_roidata.lightning`` (same YAML)."""
    rec = index_recorder(namespace)
    full = tmp_path / "full"
    cfg = tiny_config(root, tmp_path / "full.yaml", trainer={"max_steps": 6},
                      callbacks=[{"class_path": rec, "init_args": {"path": str(full)}}],
                      data={"num_workers": 1})
    res = run_cli("fit", "--config", str(cfg), namespace=namespace)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "COCO evaluation" in res.stdout + res.stderr
    ckpts = sorted((tmp_path / "full" / "checkpoints").glob("*.ckpt"))
    assert ckpts, res.stderr[-2000:]
    ref = [r["indices"] for r in read_records(full)]
    assert len(ref) == 6

    # Resume via the CLI from the step-3 checkpoint (ModelCheckpoint every 3 steps), with
    # another num_workers: the remaining steps train exactly the reference batches.
    step3 = tmp_path / "full" / "checkpoints" / "epoch=0-step=3.ckpt"
    assert torch.load(step3, weights_only=False)["global_step"] == 3
    part = tmp_path / "part"
    cfg6 = tiny_config(root, tmp_path / "resume.yaml", trainer={"max_steps": 6},
                       callbacks=[{"class_path": rec, "init_args": {"path": str(part)}}],
                       data={"num_workers": 2})
    res = run_cli("fit", "--config", str(cfg6), "--ckpt_path", str(step3), namespace=namespace)
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["indices"] for r in read_records(part)] == ref[3:]


def _exchange_teacher_config(root: Path, out: Path) -> Path:
    """configs/exchange_teacher.yaml on the tiny demo, alone (no peer: the exchange
    callback is dropped), checkpointing into ``out``'s folder."""
    from datamodule_support import SMALL_DEMO

    cfg = yaml.safe_load((REPO / "configs" / "exchange_teacher.yaml").read_text())
    run = out.parent / "teacher"
    cfg["trainer"].update({"max_steps": 3, "enable_checkpointing": True,
                           "default_root_dir": str(run), "limit_predict_batches": 3,
                           "enable_model_summary": False, "callbacks": [
                               {"class_path": "pytorch_lightning.callbacks.ModelCheckpoint",
                                "init_args": {"dirpath": str(run / "checkpoints")}}]})
    d = cfg["data"]["init_args"]
    d.update({"demo_root": str(root / "data"), "demo_size": dict(SMALL_DEMO)})
    d["sources"] = dict(d.get("sources") or {}, cache_dir=str(root / "cache"))
    d["loader"] = dict(d.get("loader") or {}, num_workers=0)
    out.write_text(yaml.safe_dump(cfg))
    return out


@pytest.mark.slow
def test_predict_exchange_config_writes_class_agnostic_proposals(root: Path, tmp_path: Path,
                                                                 capsys: Any) -> None:
    """The RPN-only exchange demo predicts its proposals: COCO results with
    ``category_id`` 1 (COCO's proposal format), boxes inside the original images."""
    cfg = _exchange_teacher_config(root, tmp_path / "teacher.yaml")
    assert main(["fit", "--config", str(cfg)]) == 0
    ckpt = max((tmp_path / "teacher" / "checkpoints").glob("*.ckpt"))
    capsys.readouterr()
    assert main(["predict", "--config", str(cfg), "--ckpt_path", str(ckpt)]) == 0
    path = tmp_path / "teacher" / "predictions" / "demo_val.json"
    assert f"predictions (demo_val): {path}" in capsys.readouterr().out
    from pycocotools.coco import COCO

    gt = COCO(str(root / "data" / "demo_val" / "annotations.json"))
    dt = gt.loadRes(str(path))
    anns = dt.loadAnns(dt.getAnnIds())
    assert anns and {a["category_id"] for a in anns} == {1}
    assert set(dt.getImgIds()) <= set(gt.getImgIds())
    for a in anns:
        img = gt.imgs[a["image_id"]]
        x, y, w, h = a["bbox"]
        assert x >= 0 and y >= 0 and w >= 1 and h >= 1
        assert x + w <= img["width"] + 1e-3 and y + h <= img["height"] + 1e-3
    per_image = {i: len(dt.getAnnIds(imgIds=[i])) for i in dt.getImgIds()}
    assert max(per_image.values()) <= 1000  # TEST.RPN_POST_NMS_TOP_N
