"""lit-roidata: --print_config of every config, the demo fit, checkpoint → resume."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from lit_roidata.cli import TOOLS, TRAINING, main

from conftest import LIGHTNING_NAMESPACES
from datamodule_support import REPO, index_recorder, read_records, run_cli, tiny_config

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


_PRINT = """
import contextlib, io, json, sys
from lit_roidata.cli import main
out = {}
for path in sys.argv[2:]:
    buf, code = io.StringIO(), None
    with contextlib.redirect_stdout(buf):
        try:
            main(["fit", "--config", path, "--print_config"], namespace=sys.argv[1])
        except SystemExit as exc:
            code = exc.code
    out[path] = [code, buf.getvalue()]
print("PRINTED " + json.dumps(out))
"""


@functools.cache
def _print_configs(namespace: str) -> dict[str, tuple[Any, str]]:
    """``fit --print_config`` of every shipped config, in one fresh process per namespace
    (as the commands run: parsing both namespaces' CLIs in one process is what Lightning
    2.4 gets wrong, docs/cli.md)."""
    import json
    import subprocess
    import sys

    from datamodule_support import cli_env

    res = subprocess.run([sys.executable, "-c", _PRINT, namespace, *map(str, CONFIGS)],
                         env=cli_env(), capture_output=True, text=True, timeout=600)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("PRINTED ")]
    assert line, res.stderr[-3000:]
    return {Path(k).name: tuple(v) for k, v in json.loads(line[-1][len("PRINTED "):]).items()}


@pytest.mark.parametrize("namespace", LIGHTNING_NAMESPACES)
@pytest.mark.parametrize("config", [c.name for c in CONFIGS
                                    if not c.name.startswith("exchange_")])
def test_print_config_parses_every_config(config: str, namespace: str) -> None:
    """Every shipped config parses with ``lit-roidata`` and, unchanged, with
    ``python -m lit_roidata.lightning`` (its class paths translated to lightning.pytorch)."""
    code, text = _print_configs(namespace)[config]
    assert code in (0, None), text[-2000:]
    printed = yaml.safe_load(text)
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
    # An int schedule stays an int (a float is a fraction of an epoch to Lightning).
    written = yaml.safe_load((REPO / "configs" / config).read_text())["trainer"]
    for key in ("val_check_interval", "limit_val_batches"):
        if isinstance(written.get(key), int):
            assert type(printed["trainer"][key]) is int, (key, printed["trainer"][key])
    # The data module accepts the Detectron keys of the config (instantiating checks them).
    dm = data_class(**printed["data"]["init_args"])
    assert dm.cfg.TRAIN.IMS_PER_BATCH >= 1


@pytest.mark.parametrize("subcommand", ["validate", "test", "predict"])
@pytest.mark.parametrize("namespace", LIGHTNING_NAMESPACES)
def test_evaluation_subcommands_run(root: Path, tmp_path: Path, subcommand: str,
                                    namespace: str) -> None:
    """`lit-roidata validate|test|predict` and `python -m lit_roidata.lightning ...`, each in
    a fresh process (with both namespaces imported, Lightning 2.4's second Trainer reads
    `val_check_interval: 4` as 4.0: typing's Union cache; docs/cli.md)."""
    cfg = tiny_config(root, tmp_path / "tiny.yaml", trainer={"limit_val_batches": 4,
                                                             "limit_test_batches": 4,
                                                             "limit_predict_batches": 4})
    res = run_cli(subcommand, "--config", str(cfg), namespace=namespace)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
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


def test_top_level_help_lists_every_subcommand_and_the_exit_status(capsys: Any) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in [*TOOLS, *TRAINING]) and "128+N" in out
    assert main([]) == 2 and "choose a subcommand" in capsys.readouterr().err


#: Commands that must start without torch or Lightning (issue 20 item 7), each run by
#: :func:`lit_roidata.cli.main` in a fresh interpreter; ``{cache}``/``{tmp}`` are filled in.
FAST_COMMANDS = [["--help"], ["cache", "--cache-dir", "{cache}", "ls"],
                 ["cache", "--cache-dir", "{cache}", "ls", "--json"],
                 ["cache", "--cache-dir", "{cache}", "verify"],
                 ["cache", "--cache-dir", "{cache}", "clean", "--all", "--dry-run"],
                 ["convert-proposals", "{tmp}/props.pkl", "{tmp}/props.npz"],
                 ["convert-proposals", "--help"]]
_PROBE = """
import json, sys
from lit_roidata.cli import main
try:
    code = main(json.loads(sys.argv[1]))
except SystemExit as exc:  # argparse's --help
    code = exc.code or 0
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "pytorch_lightning",
                                                              "lightning", "lightning_fabric"))
print("PROBE", json.dumps({"code": code, "heavy": heavy}))
"""


def test_fast_commands_import_neither_torch_nor_lightning(tmp_path: Path) -> None:
    """`lit-roidata --help`, `cache ...` and `convert-proposals ...` run in a fresh
    interpreter without importing torch or Lightning (benchmarks/cli_startup.py times them)."""
    import json
    import pickle
    import subprocess
    import sys

    import numpy as np

    from datamodule_support import cli_env

    from lit_roidata.catalog import Catalog
    from lit_roidata.config import get_cfg
    from lit_roidata.demo import register_demo_datasets
    from lit_roidata.roidb import combined_roidb_for_training

    cat, cache = Catalog(builtins=False), str(tmp_path / "cache")
    demo = register_demo_datasets(tmp_path / "demo", cat, num_images={
        "demo_train_a": 2, "demo_train_b": 2, "demo_val": 2})
    combined_roidb_for_training(list(demo.train_datasets), [], get_cfg(), cache_dir=cache,
                                catalog=cat)
    boxes = [np.array([[1, 1, 20, 20], [2, 2, 9, 9]], np.float32) for _ in range(3)]
    scores = [np.array([0.9, 0.1], np.float32) for _ in range(3)]
    with open(tmp_path / "props.pkl", "wb") as fh:
        pickle.dump({"boxes": boxes, "scores": scores, "ids": [1, 2, 3]}, fh)
    for argv in FAST_COMMANDS:
        argv = [a.format(cache=cache, tmp=tmp_path) for a in argv]
        res = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argv)], env=cli_env(),
                             capture_output=True, text=True, timeout=120)
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("PROBE ")]
        assert line, (argv, res.stdout[-2000:], res.stderr[-2000:])
        probe = json.loads(line[-1][len("PROBE "):])
        assert probe["code"] == 0, (argv, res.stdout[-2000:], res.stderr[-2000:])
        assert probe["heavy"] == [], (argv, probe["heavy"][:10])
    assert "roidb-" in subprocess.run(
        [sys.executable, "-m", "lit_roidata.cli", "cache", "--cache-dir", cache, "ls", "--json"],
        env=cli_env(), capture_output=True, text=True, timeout=120).stdout


def test_training_names_stay_importable_from_lit_roidata_cli() -> None:
    """The entry point and ``lit_roidata.cli.RoIDataCLI`` (loaded on first use)."""
    import lit_roidata.cli as cli
    from lit_roidata.trainer_cli import RoIDataCLI, cli_main, translate_class_path

    assert cli.RoIDataCLI is RoIDataCLI and cli.cli_main is cli_main
    assert cli.translate_class_path is translate_class_path
    with pytest.raises(AttributeError):
        cli.no_such_name  # noqa: B018


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
