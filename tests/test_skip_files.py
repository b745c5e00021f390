"""The skip policy with real bad files (truncated JPEG, missing, zero bytes) through the
dataset, the stateful loader with 0 and 2 workers, and RoIDataModule."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import cv2
import numpy as np
import pytest

from lit_roidata.dataset import BadImageFound, RoIBlockDataset
from lit_roidata.loader import StatefulRoIDataLoader
from lit_roidata.sampler import RoIBatchSampler
from test_minibatch_helpers import make_entry, small_cfg, write_image


def _truncated_jpeg(path: Path, w: int, h: int) -> None:
    im = (np.random.default_rng(1).random((h, w, 3)) * 255).astype(np.uint8)
    data = cv2.imencode(".jpg", im)[1].tobytes()
    path.write_bytes(data[: len(data) // 2])


def _roidb(root: Path, n: int = 16) -> tuple[list[dict], dict[int, str]]:
    """``n`` entries (landscape and portrait); entries 1, 4 and 9 are bad files."""
    r = np.random.default_rng(0)
    out, bad = [], {}
    for i in range(n):
        w, h = (64, 48) if i % 3 else (48, 64)
        p = root / f"im{i}.png"
        if i == 1:
            p = root / "truncated.jpg"
            _truncated_jpeg(p, w, h)
            bad[i] = "undecodable"
        elif i == 4:
            p = root / "missing.png"
            bad[i] = "missing"
        elif i == 9:
            p = root / "empty.png"
            p.write_bytes(b"")
            bad[i] = "undecodable"
        else:
            write_image(p, w, h, seed=i)
        out.append(make_entry(r, width=w, height=h, image=str(p), image_id=100 + i))
    return out, bad


def _setup(root: Path, mb: int, *, holdback: int | None = None, rank: int = 0, ws: int = 1,
           nw: int = 0, persistent: bool = False, **options):
    """The roidb, its bad files, the plan, a hand-back dataset and the loader owning the
    skip policy (its ledger)."""
    roidb, bad = _roidb(root)
    w = np.array([e["width"] for e in roidb])
    h = np.array([e["height"] for e in roidb])
    holdback = 6 // mb if holdback is None else holdback  # enough reserve of each orientation
    sampler = RoIBatchSampler(w, h, mb, seed=4, holdback=holdback, rank=rank, world_size=ws)
    ds = RoIBlockDataset(roidb, small_cfg(**{"TRAIN.IMS_PER_BATCH": mb}), on_bad_image="skip",
                         replacement=sampler.replacement_block, hand_back_bad_images=True,
                         **options)
    loader = StatefulRoIDataLoader(ds, sampler, num_workers=nw, persistent_workers=persistent,
                                   multiprocessing_context="fork" if nw else None)
    return roidb, bad, sampler, loader, ds


def _meta(batch):
    return batch["_meta"] if isinstance(batch, dict) else batch.meta


def _check_pass(sampler, metas, bad):
    assert not [s for m in metas for s in m["substitutes"] if s["why"] == "reserve_exhausted"]
    got = Counter(i for m in metas for i in m["indices"])
    assert not set(got) & set(bad)
    assert all(n == 1 for n in got.values()), got  # nothing delivered twice
    want = [i for b in range(len(sampler) * sampler.world_size)
            for i in sampler.block(metas[0]["pass_index"], b) if i not in bad]
    assert all(got[i] == 1 for i in want)  # every good image of the pass, once
    for m in metas:  # partners kept
        for req, used in zip(m["requested_indices"], m["indices"]):
            if req not in bad:
                assert req == used


@pytest.mark.parametrize("mb", [1, 2])
def test_real_bad_files_replaced_alone_and_reported(tmp_path: Path, mb: int) -> None:
    roidb, bad, sampler, loader, ds = _setup(tmp_path, mb)
    ledger = loader.skip_policy.ledger
    metas = [_meta(b) for b in loader]
    _check_pass(sampler, metas, bad)
    found = {s["index"]: s for m in metas for s in m["skipped"]}
    in_pass = {i for b in range(len(sampler)) for i in sampler.block(0, b)} & set(bad)
    assert in_pass <= set(found) <= set(bad)  # (a reserve image can be bad too)
    in_pass = set(found)
    for i, rec in found.items():
        assert rec["reason"] == bad[i] and rec["path"] == roidb[i]["image"]
        assert rec["image_id"] == 100 + i and str(roidb[i]["image"]) in rec["message"]
    assert set(ledger.known) == in_pass
    # next pass: the known files are replaced before reading (no new skip)
    loader.skip_policy.exchange(loader.position)
    metas1 = [_meta(b) for b in loader]
    _check_pass(sampler, metas1, bad)
    assert not {s["index"] for m in metas1 for s in m["skipped"]} & in_pass
    known_subs = [s for m in metas1 for s in m["substitutes"] if s["bad_index"] in in_pass]
    assert len(known_subs) == len({i for b in range(len(sampler)) for i in sampler.block(1, b)}
                                  & in_pass)
    assert all(s["why"] == "known_bad" for s in known_subs)


def test_dataset_hands_back_a_bad_image_as_a_typed_result(tmp_path: Path) -> None:
    """The dataset only builds: a stream block with an unreadable image comes back as
    BadImageFound; the ledger (the loader's) replaces that image and the block builds."""
    roidb, bad, sampler, loader, ds = _setup(tmp_path, 2)
    ledger = loader.skip_policy.ledger
    res = ds.__getitems__(next(b for b in sampler if set(b) & set(bad)))
    assert isinstance(res, BadImageFound) and res.block[res.slot] in bad
    assert res.record["path"] == roidb[res.block[res.slot]]["image"]
    while isinstance(res, BadImageFound):
        ledger.mark_bad(res.block[res.slot], res.record)
        blk, sub = ledger.substitute(res.block, res.slot)
        assert sub["bad_index"] in bad and blk.requested == res.block.requested
        res = ds.build_stream_block(blk, res.skipped + [res.record])
    assert not set(res["_meta"]["indices"]) & set(bad)


def _loader_metas(tmp_path: Path, nw: int, mb: int, persistent: bool = False) -> list[dict]:
    roidb, bad, sampler, loader, ds = _setup(tmp_path, mb, nw=nw, persistent=persistent)
    assert loader.skip_policy is not None
    metas = []
    for _ in range(2):  # one pass each
        metas.append([b["_meta"] for b in loader])
        loader.skip_policy.exchange(loader.position)  # what the epoch-end report runs
    for ms in metas:
        _check_pass(sampler, ms, bad)
    return [[(m["indices"], [s["index"] for s in m["skipped"]]) for m in ms] for ms in metas]


@pytest.mark.parametrize("mb", [1, 2])
def test_same_stream_with_0_and_2_workers(tmp_path: Path, mb: int) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert _loader_metas(tmp_path / "a", 0, mb) == _loader_metas(tmp_path / "b", 2, mb)


def test_persistent_workers_skip_the_images_found_in_the_previous_pass(tmp_path: Path) -> None:
    """Known bad images are replaced in the main process, before a block reaches a worker:
    workers that live across passes need to learn nothing."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    want = _loader_metas(tmp_path / "a", 0, 2)
    assert _loader_metas(tmp_path / "b", 2, 2, persistent=True) == want
    assert not [s for _, skipped in want[1] for s in skipped]  # pass 1 reads no bad file


def test_torchvision_output_counts_and_keeps_meta(tmp_path: Path) -> None:
    roidb, bad, sampler, loader, _ = _setup(tmp_path, 2, output_format="torchvision")
    metas = [o.meta for o in loader]
    _check_pass(sampler, metas, bad)
    assert sum(m["num_skipped"] for m in metas) == len(loader.skip_policy.ledger.known)
