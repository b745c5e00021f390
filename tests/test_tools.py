"""Smoke and content tests of the data tools: inspect, dump-blobs, bench, make-demo-data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lit_roidata.cli import main

from datamodule_support import shared_root, tiny_config


@pytest.fixture(scope="module")
def config(tmp_path_factory: Any) -> Path:
    root = shared_root(tmp_path_factory)
    out = Path(tmp_path_factory.mktemp("tools")) / "tiny.yaml"
    return tiny_config(root, out)


def test_make_demo_data(tmp_path: Path, capsys: Any) -> None:
    size = '{"demo_train_a": 3, "demo_train_b": 2, "demo_val": 2}'
    assert main(["make-demo-data", "--root", str(tmp_path / "d"), "--size", size]) == 0
    ann = json.loads((tmp_path / "d" / "demo_train_a" / "annotations.json").read_text())
    assert len(ann["images"]) == 3
    assert (tmp_path / "d" / "demo_val" / "proposals.npz").is_file()
    assert "demo_train_b" in capsys.readouterr().out


def test_dump_blobs_identity_order_one_image(config: Path, tmp_path: Path) -> None:
    out = tmp_path / "dump"
    assert main(["dump-blobs", "--config", str(config), "--num", "3", "--out", str(out),
                 "--blobs", '["data", "rois", "labels_int32"]']) == 0
    index = json.loads((out / "index.json").read_text())
    assert [r["indices"] for r in index] == [[0], [1], [2]]  # shuffle=False, 1 image/batch
    for rec in index:
        blobs = np.load(out / rec["file"])
        assert sorted(blobs.files) == ["data", "labels_int32", "rois"]
        assert blobs["data"].dtype == np.float32 and blobs["data"].shape[0] == 1
        assert blobs["rois"].shape[1] == 5 and (blobs["rois"][:, 0] == 0).all()
    # A dump is reproducible: the same command writes identical arrays.
    again = tmp_path / "again"
    assert main(["dump-blobs", "--config", str(config), "--num", "1", "--out", str(again)]) == 0
    a, b = np.load(out / "minibatch_00000.npz"), np.load(again / "minibatch_00000.npz")
    assert np.array_equal(a["data"], b["data"]) and np.array_equal(a["rois"], b["rois"])


def test_dump_blobs_rejects_unknown_blob(config: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown blob"):
        main(["dump-blobs", "--config", str(config), "--out", str(tmp_path),
              "--blobs", '["rpn_labels_int32_wide"]'])


def test_inspect_writes_stats_and_pictures(config: Path, tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "inspect"
    assert main(["inspect", "--config", str(config), "--out", str(out),
                 "--num_batches", "2"]) == 0
    text = capsys.readouterr().out
    assert "demo_train_a" in text and "gt boxes per class" in text
    for name in ("histograms.png", "minibatch_0.png", "minibatch_1.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_bench_reports_throughput(config: Path, capsys: Any) -> None:
    assert main(["bench", "--config", str(config), "--num_batches", "4", "--warmup", "1"]) == 0
    text = capsys.readouterr().out
    assert "images/s" in text and "loader / floor" in text
