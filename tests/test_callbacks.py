"""Weights loading (Detectron pkl, Lightning/PyTorch checkpoints) and the rank-0 broadcast
with its replica check, on 2 CPU processes (gloo, torch.multiprocessing spawn)."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lit_roidata.broadcast import (
    BroadcastParameters,
    ReplicaMismatchError,
    broadcast_module,
    verify_replicas,
)
from lit_roidata.weights import WeightsShapeError, load_weights_file, load_weights_into


class Net(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.mask_fcn = nn.Linear(4, 2)  # Detectron: '_[mask]_fcn1' shares 'fcn1'
        if extra:
            self.more = nn.Linear(2, 2)


def detectron_name(name: str) -> Optional[str]:
    """Hook: torch names -> Detectron blob names (conv1_w, conv1_b, _[mask]_fcn1_w, ...)."""
    table = {"conv1.weight": "conv1_w", "conv1.bias": "conv1_b", "bn.weight": "bn_s",
             "bn.bias": "bn_b", "mask_fcn.weight": "_[mask]_fcn1_w",
             "mask_fcn.bias": "_[mask]_fcn1_b"}
    return table.get(name)  # running stats etc.: not in the file, skipped


def _detectron_blobs(seed: int = 7) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"conv1_w": rng.normal(size=(4, 3, 3, 3)).astype(np.float32),
            "conv1_b": rng.normal(size=4).astype(np.float32),
            "bn_s": rng.normal(size=4).astype(np.float32),
            "bn_b": rng.normal(size=4).astype(np.float32),
            "fcn1_w": rng.normal(size=(2, 4)).astype(np.float32),  # via the _[mask]_ rule
            "fcn1_b": rng.normal(size=2).astype(np.float32),
            "conv1_w_momentum": np.zeros((4, 3, 3, 3), np.float32)}


def _write_pkl(path: Path, blobs: dict, bare: bool = False) -> Path:
    with open(path, "wb") as f:
        pickle.dump(blobs if bare else {"blobs": blobs, "cfg": "MODEL: {}"}, f, protocol=2)
    return path


@pytest.mark.parametrize("bare", [False, True])
def test_detectron_pkl_with_mapping_hook(tmp_path: Path, bare: bool,
                                         caplog: pytest.LogCaptureFixture) -> None:
    blobs = _detectron_blobs()
    path = _write_pkl(tmp_path / "model_final.pkl", blobs, bare=bare)
    net = Net()
    with caplog.at_level(logging.WARNING, logger="lit_roidata.weights"):
        report = load_weights_into(net, load_weights_file(path, trust_pickle=True),
                                   name_map=detectron_name,
                                   source=str(path))
    np.testing.assert_array_equal(net.conv1.weight.detach().numpy(), blobs["conv1_w"])
    np.testing.assert_array_equal(net.mask_fcn.weight.detach().numpy(), blobs["fcn1_w"])
    assert report.loaded["mask_fcn.bias"] == "fcn1_b"
    assert report.unused == ["conv1_w_momentum"]
    assert report.missing == []  # running stats mapped to None: skipped, not missing


def test_missing_logged_and_strict(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blobs = {k: v for k, v in _detectron_blobs().items() if k != "bn_s"}
    net = Net()
    before = net.bn.weight.detach().clone()
    with caplog.at_level(logging.WARNING, logger="lit_roidata.weights"):
        report = load_weights_into(net, blobs, name_map=detectron_name)
    assert report.missing == ["bn.weight"] and "bn.weight" in caplog.text
    assert torch.equal(net.bn.weight, before)
    with pytest.raises(KeyError, match="bn.weight"):
        load_weights_into(Net(), blobs, name_map=detectron_name, strict=True)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path: Path) -> None:
    blobs = _detectron_blobs()
    blobs["fcn1_w"] = np.zeros((3, 4), np.float32)
    with pytest.raises(WeightsShapeError) as e:
        load_weights_into(Net(), blobs, name_map=detectron_name, source="x.pkl")
    msg = str(e.value)
    assert "mask_fcn.weight" in msg and "fcn1_w" in msg and "(3, 4)" in msg and "(2, 4)" in msg


def test_lightning_checkpoint_and_state_dict(tmp_path: Path) -> None:
    src = Net()
    torch.save({"state_dict": src.state_dict(), "epoch": 3, "hyper_parameters": {"a": (1, 2)}},
               tmp_path / "last.ckpt")
    torch.save(src.state_dict(), tmp_path / "w.pth")
    for name in ("last.ckpt", "w.pth"):
        dst = Net()
        report = load_weights_into(dst, load_weights_file(tmp_path / name))
        assert not report.missing
        for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
            assert torch.equal(a, b), k
    with pytest.raises(FileNotFoundError, match="nope.pkl"):
        load_weights_file(tmp_path / "nope.pkl")
    torch.save([1, 2], tmp_path / "list.pth")
    with pytest.raises(ValueError, match="not a dict"):
        load_weights_file(tmp_path / "list.pth")


class _RunsCode:
    """Unpickling this object opens (creates) a marker file: code from the file runs."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickled_weights_need_trust(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A .pkl (or a checkpoint ``weights_only`` refuses) is refused without trust_pickle,
    before any of its code runs; trusted, it loads with one warning line; .pth needs none."""
    from lit_roidata._pickle_trust import UntrustedPickleError

    marker = tmp_path / "code_ran"
    pkl = tmp_path / "w.pkl"
    with open(pkl, "wb") as f:
        pickle.dump({"blobs": _detectron_blobs(), "cfg": _RunsCode(str(marker))}, f, protocol=2)
    with pytest.raises(UntrustedPickleError, match=r"w\.pkl: the weights file is a pickle.*"
                       r"trust_pickle=True.*torch\.save"):
        load_weights_file(pkl)
    cb = BroadcastParameters(str(pkl), name_map=detectron_name)
    with pytest.raises(UntrustedPickleError, match="trust_pickle"):
        cb.setup(SimpleNamespace(global_rank=0, world_size=1), Net(), "fit")
    assert not marker.exists()
    with caplog.at_level(logging.WARNING, logger="lit_roidata"):
        assert "conv1_w" in load_weights_file(pkl, trust_pickle=True)
    assert marker.exists()
    assert sum("trust_pickle=True" in r.getMessage() for r in caplog.records) == 1
    # A checkpoint holding an arbitrary object: weights_only refuses it, no silent fallback.
    marker.unlink()
    ckpt = tmp_path / "odd.ckpt"
    torch.save({"state_dict": Net().state_dict(), "extra": _RunsCode(str(marker))}, ckpt)
    with pytest.raises(UntrustedPickleError, match=r"odd\.ckpt.*weights_only=True"):
        load_weights_file(ckpt)
    assert not marker.exists()
    assert "conv1.weight" in load_weights_file(ckpt, trust_pickle=True) and marker.exists()
    torch.save(Net().state_dict(), tmp_path / "w.pth")
    assert "conv1.weight" in load_weights_file(tmp_path / "w.pth")  # plain tensors: no trust


def test_single_process_is_noop(tmp_path: Path) -> None:
    net = Net()
    assert broadcast_module(net) == 0 and verify_replicas(net) == 0
    cb = BroadcastParameters(str(_write_pkl(tmp_path / "w.pkl", _detectron_blobs())),
                             name_map=detectron_name, trust_pickle=True)
    cb.setup(SimpleNamespace(global_rank=0, world_size=1), net, "fit")
    np.testing.assert_array_equal(net.bn.bias.detach().numpy(), _detectron_blobs()["bn_b"])


# ------------------------------------------------------------------ 2 processes (gloo)
def _worker(rank: int, world: int, init_file: str, out: str, weights: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    try:
        fake_trainer = SimpleNamespace(global_rank=rank, world_size=world)
        torch.manual_seed(100 + rank)  # different random init on every rank
        net = Net()
        torch.save(net.state_dict(), f"{out}/init{rank}.pt")
        cb = BroadcastParameters(weights, name_map=detectron_name, trust_pickle=True)
        cb.setup(fake_trainer, net, "fit")
        torch.save(net.state_dict(), f"{out}/after{rank}.pt")

        # a replica that drifts by one bit is reported with its name and rank
        if rank == 1:
            with torch.no_grad():
                v = net.bn.running_var.view(torch.int32)
                v[2] ^= 1
        try:
            verify_replicas(net)
            msg = "no error"
        except ReplicaMismatchError as e:
            msg = str(e)
        Path(f"{out}/drift{rank}.txt").write_text(msg)

        # ranks with different models fail with a message instead of hanging
        try:
            broadcast_module(Net(extra=rank == 1))
            msg = "no error"
        except ReplicaMismatchError as e:
            msg = str(e)
        Path(f"{out}/structure{rank}.txt").write_text(msg)

        # a weights file that does not fit fails on rank 0 and, told by rank 0, on rank 1
        bad = BroadcastParameters(weights, name_map=lambda n: "conv1_w", trust_pickle=True)
        try:
            bad.setup(fake_trainer, Net(), "fit")
            msg = "no error"
        except (WeightsShapeError, RuntimeError) as e:
            msg = f"{type(e).__name__}: {e}"
        Path(f"{out}/bad{rank}.txt").write_text(msg)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_broadcast_two_processes_gloo(tmp_path: Path) -> None:
    weights = _write_pkl(tmp_path / "model.pkl", _detectron_blobs())
    # fork: the children need no fresh interpreter (no re-import of torch/Lightning)
    mp.start_processes(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), str(weights)),
                       nprocs=2, join=True, start_method="fork")
    init0, init1 = (torch.load(tmp_path / f"init{r}.pt") for r in (0, 1))
    assert not torch.equal(init0["conv1.weight"], init1["conv1.weight"])
    after0, after1 = (torch.load(tmp_path / f"after{r}.pt") for r in (0, 1))
    blobs = _detectron_blobs()
    for k in after0:
        assert torch.equal(after0[k], after1[k]), k  # bit-identical, buffers included
    np.testing.assert_array_equal(after1["mask_fcn.weight"].numpy(), blobs["fcn1_w"])
    # tensors absent from the file come from rank 0's init, not rank 1's
    assert torch.equal(after1["bn.running_mean"], init0["bn.running_mean"])
    for r in (0, 1):
        drift = (tmp_path / f"drift{r}.txt").read_text()
        assert "'bn.running_var'" in drift and "rank(s) [1]" in drift
        structure = (tmp_path / f"structure{r}.txt").read_text()
        assert "rank 1" in structure and "more.weight" in structure
    assert (tmp_path / "bad0.txt").read_text().startswith("WeightsShapeError")
    bad1 = (tmp_path / "bad1.txt").read_text()
    assert bad1.startswith("RuntimeError: rank 0 failed") and "(4, 3, 3, 3)" in bad1

