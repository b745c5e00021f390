"""``on_bad_image="skip"`` through RoIDataModule (0 and 2 workers), a real Trainer.fit with
a resume, and 2-process DDP (gloo): only bad images replaced, every file reported once,
never read again once known on every rank, and kept in the checkpoint (the train
loader's state: its skip policy is the one object that applies the policy)."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch

from lit_roidata import DemoRoIDataModule, RoIDataModule
from lit_roidata.callbacks import BadImageReport
from lit_roidata.minibatch.torchvision_format import TorchvisionBatch
from datamodule_support import TINY_MODEL, dm_kwargs, read_records, run_cli, tiny_config

RESERVE = 0.2


def _break_files(root: Path) -> dict[str, str]:
    """Truncate one JPEG, empty one, and move one away (the roidb cache is already
    built, so the loss is found only when the image is read)."""
    dm = DemoRoIDataModule(**dm_kwargs(root, on_bad_image="skip"))
    dm.prepare_data()
    dm.setup("fit")
    rdb = dm.train_roidb
    paths = sorted({str(rdb[i]["image"]) for i in range(len(rdb))})
    truncated, empty, missing = paths[1], paths[7], paths[20]
    data = Path(truncated).read_bytes()
    Path(truncated).write_bytes(data[: len(data) // 2])
    Path(empty).write_bytes(b"")
    # renamed, not deleted, so the demo data still counts as complete (not regenerated)
    Path(missing).rename(Path(missing).with_name("moved_" + Path(missing).name))
    return {truncated: "undecodable", empty: "undecodable", missing: "missing"}


@pytest.fixture(scope="module")
def broken(tmp_path_factory: Any) -> tuple[Path, dict[str, str]]:
    root = Path(tmp_path_factory.mktemp("skip_demo"))
    return root, _break_files(root)


def _exchange(loader: Any) -> dict:
    """What BadImageReport.on_train_epoch_end runs."""
    return loader.skip_policy.exchange(loader.position)


def _epochs(dm: RoIDataModule, n: int) -> tuple[list[list[dict]], list[dict]]:
    loader = dm.train_dataloader()
    metas, reports = [], []
    for _ in range(n):  # an iteration is the rest of the pass
        metas.append([(b["_meta"] if isinstance(b, dict) else b.meta) for b in loader])
        reports.append(_exchange(loader))
    return metas, reports


def _check(metas: list[dict], bad: dict[str, str]) -> None:
    images = Counter(p for m in metas for p in m["images"])
    assert not set(images) & set(bad)
    keys = Counter((m["pass_index"], i) for m in metas for i in m["indices"])
    assert all(n == 1 for n in keys.values())  # no entry twice in a pass
    for m in metas:
        assert not [s for s in m["substitutes"] if s["why"] == "reserve_exhausted"]
        bad_slots = {s["slot"] for s in m["substitutes"]}
        for k, (req, used) in enumerate(zip(m["requested_indices"], m["indices"])):
            if k not in bad_slots:
                assert req == used  # partners kept


@pytest.mark.parametrize("nw", [0, 2])
def test_datamodule_replaces_only_bad_images_and_reports_each_file(broken, nw: int) -> None:
    root, bad = broken
    dm = DemoRoIDataModule(**dm_kwargs(root, on_bad_image="skip", num_workers=nw,
                                   bad_image_reserve=RESERVE))
    dm.setup("fit")
    metas, reports = _epochs(dm, 2)
    for ms in metas:
        _check(ms, bad)
    files = {r["path"]: r for r in reports[0]["files"]}
    assert set(files) <= set(bad) and files  # found in the first pass
    for path, rec in files.items():
        assert rec["reason"] == bad[path] and path in rec["message"]
    counts = reports[0]["counts"]
    assert sum(counts.get(k, 0) for k in ("missing", "undecodable")) == len(files)
    # second pass: what is known is replaced before it is read; nothing found twice
    again = {r["path"] for r in reports[1]["files"]}
    assert not again & set(files)
    read1 = {p for m in metas[1] for s in m["skipped"] for p in [s["path"]]}
    assert not read1 & set(files)
    # the bad list is in the loader's (checkpoint) state and restored
    loader = dm.train_dataloader()  # a second call continues the first loader
    state = loader.state_dict()
    assert {v["path"] for v in state["skip"]["ledger"]["known"].values()} >= set(files)
    other = DemoRoIDataModule(**dm_kwargs(root, on_bad_image="skip", num_workers=nw,
                                      bad_image_reserve=RESERVE))
    other.setup("fit")
    restored = other.train_dataloader()
    restored.load_state_dict(state)
    assert restored.skip_policy.ledger.known == loader.skip_policy.ledger.known
    assert restored.skip_policy.ledger.frozen == loader.skip_policy.ledger.frozen
    if nw == 2:
        ref = DemoRoIDataModule(**dm_kwargs(root, on_bad_image="skip", num_workers=0,
                                        bad_image_reserve=RESERVE))
        ref.setup("fit")
        ref_metas, _ = _epochs(ref, 2)
        assert [[m["indices"] for m in ms] for ms in ref_metas] == \
            [[m["indices"] for m in ms] for ms in metas]


def test_ims_per_batch_1_default_reserve_no_repeat(broken) -> None:
    """The issue's case: IMS_PER_BATCH=1, default reserve: no image twice in a pass."""
    root, bad = broken
    over = dict(dm_kwargs(root)["overrides"], **{"TRAIN.IMS_PER_BATCH": 1})
    dm = DemoRoIDataModule(**dm_kwargs(root, on_bad_image="skip", overrides=over))
    dm.setup("fit")
    metas, reports = _epochs(dm, 2)
    for ms in metas:
        _check(ms, bad)
    assert reports[0]["files"] and "reserve_exhausted" not in reports[0]["counts"]


def _infinite_epochs(dm: RoIDataModule, n: int) -> list[dict]:
    """What Lightning does in infinite mode: a fresh iterator per epoch, a fixed number of
    batches (here 2/3 of a pass, as with ``limit_train_batches``: epochs and passes do not
    align), then the epoch-end exchange."""
    loader = dm.train_dataloader()
    metas = []
    for _ in range(n):
        it = iter(loader)
        metas += [next(it)["_meta"] for _ in range(len(loader) * 2 // 3)]
        it.close()
        _exchange(loader)
    return metas


def test_infinite_mode_passes_across_epochs(broken) -> None:
    """Passes and epochs are not aligned; the bad list found in an epoch applies from
    the next pass not started, the same with 0 and 2 workers."""
    root, bad = broken
    runs = []
    for nw in (0, 2):
        dm = DemoRoIDataModule(**dm_kwargs(root, on_bad_image="skip", num_workers=nw,
                                       infinite=True, bad_image_reserve=RESERVE))
        dm.setup("fit")
        metas = _infinite_epochs(dm, 5)
        for p in {m["pass_index"] for m in metas}:
            _check([m for m in metas if m["pass_index"] == p], bad)
        runs.append([(m["pass_index"], m["block_index"], m["indices"]) for m in metas])
        # a file is a new skip at most once on this rank (flips: "again")
        new = Counter(s["path"] for m in metas for s in m["skipped"] if not s.get("again"))
        assert new and all(n == 1 for n in new.values())
    assert runs[0] == runs[1]


def test_torchvision_format_counts_skips_and_keeps_meta_on_device(broken) -> None:
    root, bad = broken
    dm = DemoRoIDataModule(**dm_kwargs(root, on_bad_image="skip", output_format="torchvision",
                                   bad_image_reserve=RESERVE))
    dm.setup("fit")
    metas, reports = _epochs(dm, 1)
    _check(metas[0], bad)
    assert reports[0]["files"] and sum(reports[0]["counts"].values()) >= len(reports[0]["files"])
    loader = dm.train_dataloader()
    batch = next(iter(loader))
    moved = dm.transfer_batch_to_device(batch, torch.device("cpu"), 0)
    assert isinstance(moved, TorchvisionBatch) and moved.meta is batch.meta


def test_no_collective_inside_batch_fetching(broken, monkeypatch) -> None:
    """The loader's fetch path never calls torch.distributed (a collective there can
    hang DDP when ranks differ); the exchange happens only in the epoch hook."""
    root, _ = broken
    dm = DemoRoIDataModule(**dm_kwargs(root, on_bad_image="skip", bad_image_reserve=RESERVE))
    dm.setup("fit")
    calls = []

    def gather(out: list, obj: Any) -> None:
        calls.append(obj)
        out[:] = [obj, {"counts": {}, "files": []}]

    loader = dm.train_dataloader()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)  # not a collective
    for name in ("all_gather_object", "all_gather", "all_reduce", "broadcast_object_list",
                 "barrier", "gather_object", "broadcast"):
        monkeypatch.setattr(torch.distributed, name, gather if name == "all_gather_object"
                            else lambda *a, **k: calls.append(name))
    for _ in loader:
        pass
    assert not calls
    report = _exchange(loader)
    assert len(calls) == 1 and report["files"]


class _Recorder(pl.Callback):
    def __init__(self) -> None:
        self.trained: list[list[int]] = []
        self.images: list[str] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.trained.append(list(batch["_meta"]["indices"]))
        self.images += list(batch["_meta"]["images"])


def _trainer(tmp: Path, steps: int, callbacks: list, **kw: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp), num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=callbacks, **kw)


def _skip_state(ckpt: Path) -> dict:
    """The skip policy's ledger in a checkpoint (the train loader's state)."""
    saved = torch.load(ckpt, weights_only=False)
    return saved["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["skip"]["ledger"]


def test_skip_needs_the_report_callback(broken, tmp_path: Path) -> None:
    """The data module adds no callback itself: without BadImageReport the fit stops
    before training, naming the callback to add."""
    from lit_roidata.demo import DemoFastRCNN

    root, _ = broken
    dm = DemoRoIDataModule(**dm_kwargs(root, on_bad_image="skip", bad_image_reserve=RESERVE))
    with pytest.raises(RuntimeError, match="lit_roidata.callbacks.BadImageReport"):
        _trainer(tmp_path, 2, []).fit(DemoFastRCNN(**TINY_MODEL), datamodule=dm)


@pytest.mark.slow
def test_trainer_fit_reports_and_resumes_with_the_bad_list(broken, tmp_path: Path,
                                                            caplog) -> None:
    from lit_roidata.demo import DemoFastRCNN

    root, bad = broken
    kw = dm_kwargs(root, on_bad_image="skip", num_workers=1, bad_image_reserve=RESERVE)
    dm = DemoRoIDataModule(**kw)
    dm.setup("fit")
    steps = len(dm.train_dataloader()) + 3  # one epoch and a bit
    rec = _Recorder()
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True,
                                        every_n_train_steps=steps - 1)
    at_epoch_end = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ep"), every_n_epochs=1,
                                                save_on_train_epoch_end=True, save_top_k=-1)
    pl.seed_everything(0)
    dm = DemoRoIDataModule(**kw)
    with caplog.at_level(logging.WARNING, logger="lit_roidata"):
        _trainer(tmp_path / "a", steps, [rec, ckpt, at_epoch_end, BadImageReport()]).fit(
            DemoFastRCNN(**TINY_MODEL), datamodule=dm)
    assert not set(rec.images) & set(bad)
    text = caplog.text
    found = [p for p in bad if p in text]
    assert found and "skip report of the epoch" in text and "skip report of the whole run" in text
    for p in found:  # each file listed once per report, with its reason
        assert text.count(f"  {p} (") >= 1
    state = _skip_state(tmp_path / "ck" / "last.ckpt")
    assert {r["path"] for r in state["known"].values()} >= set(found)
    # the epoch-end checkpoint holds the state after the exchange (bad list frozen for
    # the next pass; BadImageReport runs before checkpoint callbacks), so a resume from
    # it replaces exactly as the uninterrupted run
    (ep,) = list((tmp_path / "ep").glob("epoch=0-*.ckpt"))
    ep_state = _skip_state(ep)
    (start, frozen), = [f for f in ep_state["frozen"] if f[0] == 1]
    assert {int(i) for i in frozen} == {int(k) for k in ep_state["known"]}
    # resume: the known files are never read again
    rec2 = _Recorder()
    dm2 = DemoRoIDataModule(**kw)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_roidata"):
        trainer = _trainer(tmp_path / "b", steps + 4, [rec2, BadImageReport()])
        trainer.fit(DemoFastRCNN(**TINY_MODEL), datamodule=dm2,
                    ckpt_path=str(tmp_path / "ck" / "last.ckpt"))
    # (Lightning 2.4 also writes last.ckpt at the epoch-end hooks that max_steps runs)
    saved_step = torch.load(tmp_path / "ck" / "last.ckpt", weights_only=False)["global_step"]
    assert len(rec2.trained) == steps + 4 - saved_step and not set(rec2.images) & set(bad)
    known = trainer.train_dataloader.skip_policy.ledger.known
    assert known.keys() >= {int(k) for k in state["known"]}
    assert not any("skipping image" in r.message and any(p in r.message for p in found)
                   for r in caplog.records)


@pytest.mark.slow
def test_ddp_two_processes_exchange_bad_images(broken, tmp_path: Path) -> None:
    """2 ranks (gloo): each file found once in the run over both ranks, reported by rank
    0 at the epoch end, never read again by either rank after the exchange."""
    root, bad = broken
    rec = tmp_path / "rec"
    cfg = tiny_config(root, tmp_path / "ddp.yaml",
                      trainer={"max_epochs": 2, "max_steps": -1, "devices": 2,
                               "strategy": "ddp", "limit_val_batches": 0,
                               "num_sanity_val_steps": 0, "val_check_interval": None},
                      callbacks=[{"class_path": "test_skip_datamodule.SkipRecorder",
                                  "init_args": {"path": str(rec)}},
                                 {"class_path": "lit_roidata.callbacks.BadImageReport"}],
                      data={"num_workers": 1, "on_bad_image": "skip", "infinite": False,
                            "bad_image_reserve": RESERVE},
                      drop_callbacks=("ModelCheckpoint",))
    res = run_cli("fit", "--config", str(cfg), timeout=500)
    assert res.returncode == 0, res.stderr[-4000:]
    r0, r1 = read_records(rec, 0), read_records(rec, 1)
    assert len(r0) == len(r1) > 0
    skipped = [(r["epoch"], s) for recs in (r0, r1) for r in recs for s in r["skipped"]]
    paths = Counter(s["path"] for _, s in skipped)
    assert paths and set(paths) <= set(bad)
    # never read again once known on every rank (after the first epoch-end exchange)
    assert all(e == 0 for e, _ in skipped), skipped
    for recs in (r0, r1):  # on one rank a file is a new skip once (its flip: "again")
        mine = Counter(s["path"] for r in recs for s in r["skipped"] if not s["again"])
        assert all(n == 1 for n in mine.values()), mine
    delivered = [p for recs in (r0, r1) for r in recs for p in r["images"]]
    assert not set(delivered) & set(bad)
    for epoch in range(2):  # exactly once per pass across both ranks
        keys = Counter(i for recs in (r0, r1) for r in recs if r["epoch"] == epoch
                       for i in r["indices"])
        assert all(n == 1 for n in keys.values())
    out = res.stdout + res.stderr
    assert f"bad images found ({len(paths)})" in out  # rank 0, each file once
    for p in paths:
        assert out.count(f"  {p} (") == 2  # the epoch report and the run's total


class SkipRecorder(pl.Callback):
    """Per rank: the entries, files and newly skipped files of every trained batch."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        meta = batch["_meta"]
        rec = {"epoch": int(trainer.current_epoch),
               "indices": [int(i) for i in meta["indices"]], "images": list(meta["images"]),
               "skipped": [{"path": s["path"], "again": bool(s.get("again"))}
                           for s in meta["skipped"]]}
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as f:
            f.write(json.dumps(rec) + "\n")


def test_exchange_counts_each_file_once_across_ranks(broken, monkeypatch) -> None:
    """Two ranks that found the same file in one epoch (an image and its flipped copy):
    the merged report counts it once by its reason, the second find as read_again."""
    root, _ = broken
    dm = DemoRoIDataModule(**dm_kwargs(root, on_bad_image="skip", bad_image_reserve=RESERVE))
    dm.setup("fit")
    loader = dm.train_dataloader()
    policy = loader.skip_policy
    rec = {"reason": "missing", "path": "/x/a.jpg", "image_id": 1, "dataset": "d",
           "message": "m", "index": 3}
    policy.pending.update({"missing": 1})
    policy.records.append(dict(rec))
    other = {"counts": {"missing": 1, "known_bad": 2}, "files": [dict(rec, index=40)]}

    def gather(out: list, obj: Any) -> None:
        out[:] = [obj, other]

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda *a: 0)
    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    report = _exchange(loader)
    assert report["counts"] == {"known_bad": 2, "missing": 1, "read_again": 1}
    assert [f["path"] for f in report["files"]] == ["/x/a.jpg"]
    assert {3, 40} <= set(policy.ledger.known)  # both ranks' finds are known everywhere
    assert policy.last_report == report and not policy.pending
