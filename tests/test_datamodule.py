"""RoIDataModule: config assembly, dataloaders, evaluation batches, Trainer fit/resume."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

from lit_roidata import DemoRoIDataModule, RoIDataModule
from lit_roidata.loader import EvalLoader
from lit_roidata.minibatch import get_minibatch_blob_names

from datamodule_support import TINY_MODEL, dm_kwargs


@pytest.fixture(scope="module")
def dm(root: Path) -> RoIDataModule:
    dm = DemoRoIDataModule(**dm_kwargs(root))
    dm.prepare_data()
    dm.setup("fit")
    return dm


# ---------------------------------------------------------------------------- config
def test_config_precedence_yaml_then_model_type_then_overrides(tmp_path: Path) -> None:
    y = tmp_path / "detectron.yaml"
    y.write_text("MODEL:\n  FASTER_RCNN: True\n  NUM_CLASSES: 81\nTRAIN:\n  SCALES: (500,)\n"
                 "  DATASETS: ('coco_2014_train',)\nTEST:\n  DATASETS: ('coco_2014_minival',)\n")
    dm = RoIDataModule(detectron_config=str(y))
    assert dm.cfg.RPN.RPN_ON and dm.cfg.TRAIN.SCALES == (500,) and dm.cfg.MODEL.NUM_CLASSES == 81
    dm = RoIDataModule(detectron_config=str(y), model_type="fast_rcnn",
                       overrides={"TRAIN.SCALES": [600, 700], "MODEL": {"NUM_CLASSES": 3}})
    assert not dm.cfg.RPN.RPN_ON and not dm.cfg.MODEL.FASTER_RCNN
    assert dm.cfg.TRAIN.SCALES == (600, 700) and dm.cfg.MODEL.NUM_CLASSES == 3
    assert dm.seed == dm.cfg.RNG_SEED == 3
    assert RoIDataModule(sampling={"seed": 11}).seed == 11
    # Dataset names fall back to the Detectron file; test falls back to val.
    assert dm._datasets("train") == (("coco_2014_train",), ())
    assert dm._datasets("val") == (("coco_2014_minival",), ())
    assert dm._datasets("test") == (("coco_2014_minival",), ())
    assert dm.hparams.detectron_config == str(y)


def test_bad_arguments_fail_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="num_workers"):
        RoIDataModule(loader={"num_workers": -1})
    with pytest.raises(ValueError, match="model_type"):
        RoIDataModule(model_type="yolo")  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="TRAIN.SCALE"):
        RoIDataModule(overrides={"TRAIN.SCALE": [800]})
    dm = RoIDataModule(datasets={"train": ["a", "b"], "train_proposal_files": ["p.pkl"]})
    with pytest.raises(ValueError, match="one proposal file per dataset"):
        dm._datasets("train")
    with pytest.raises(ValueError, match="no training datasets"):
        RoIDataModule().setup("fit")


# ------------------------------------------------------------------------ train batches
def test_demo_defaults_and_train_batches(dm: RoIDataModule) -> None:
    names, props = dm._datasets("train")
    assert names == ("demo_train_a", "demo_train_b") and len(props) == 2
    assert dm._datasets("val")[0] == ("demo_val",)
    loader = dm.train_dataloader()
    assert len(loader) == len(dm.make_sampler()) > 0
    batch = next(iter(loader))
    assert list(batch)[:-1] == get_minibatch_blob_names(dm.cfg) and list(batch)[-1] == "_meta"
    data = batch["data"]
    assert data.dtype == torch.uint8 and data.shape[0] == dm.cfg.TRAIN.IMS_PER_BATCH
    out = dm.on_after_batch_transfer(dict(batch), 0)
    assert out["data"].dtype == torch.float32
    # Same block in Detectron's float pixel format: same layout and padding, pixels within
    # one grey level (uint8 vs float resize kernel).
    ref = dm.make_dataset(pixel_format="detectron", sampler=dm.make_sampler())
    block = next(iter(dm.make_sampler()))
    mine = dm.on_after_batch_transfer(dm.make_dataset().__getitems__(block), 0)["data"]
    theirs = ref.__getitems__(block)["data"]
    theirs = torch.as_tensor(theirs)
    assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
    assert torch.equal(mine == 0, theirs == 0) or (mine - theirs).abs().max() <= 1.0 + 1e-4
    assert (mine - theirs).abs().max() <= 1.0 + 1e-4 and (mine - theirs).abs().mean() < 0.5


def test_builders_make_the_data_modules_loaders_without_a_trainer(dm: RoIDataModule) -> None:
    """build_train_loader / build_eval_loader (no Lightning needed) give the batches the
    data module hands Lightning; a sampler or dataset of your own replaces that part."""
    from lit_roidata.loader import build_eval_loader, build_train_loader, build_train_sampler

    def indices(loader: Any, n: int) -> list[list[int]]:
        it = iter(loader)
        return [list(next(it)["_meta"]["indices"]) for _ in range(n)]

    mine = build_train_loader(dm.cfg, dm.train_roidb, seed=dm.seed, num_workers=0)
    dm.setup("fit")  # what a new fit does: its first loader starts the stream
    assert indices(mine, 3) == indices(dm.train_dataloader(), 3)
    other = build_train_sampler(dm.cfg, dm.train_roidb, seed=dm.seed + 1)
    swapped = build_train_loader(dm.cfg, dm.train_roidb, sampler=other)
    assert swapped.batch_sampler is other and indices(swapped, 3) != indices(mine, 3)
    with pytest.raises(TypeError, match="pixel_format"):
        build_train_loader(dm.cfg, dm.train_roidb, dataset=mine.dataset,
                           pixel_format="detectron")
    # persistent workers with the skip policy: known bad images are replaced before a
    # block reaches a worker (tests/test_skip_files.py)
    kept = build_train_loader(dm.cfg, dm.train_roidb, on_bad_image="skip", num_workers=1,
                              persistent_workers=True)
    assert kept.persistent_workers and kept.skip_policy is not None
    ev = build_eval_loader(dm.cfg, dm.val_roidb, with_rois=True)
    assert [b["_meta"]["indices"] for b in ev] == [b["_meta"]["indices"]
                                                   for b in dm.val_dataloader()]
    assert build_eval_loader(dm.cfg, None) == []


def test_rank_and_world_size_split_the_stream(dm: RoIDataModule) -> None:
    whole = [list(b) for b in dm.make_sampler(world_size=1, rank=0)]
    parts = [[list(b) for b in dm.make_sampler(world_size=2, rank=r)] for r in (0, 1)]
    n = len(parts[0])
    assert len(parts[1]) == n
    assert [b for k in range(n) for b in (parts[0][k], parts[1][k])] == whole[:2 * n]


# ---------------------------------------------------------------------- eval batches
@pytest.mark.parametrize("world", [1, 2, 3])
def test_eval_loader_covers_every_image_once_in_order(dm: RoIDataModule, world: int) -> None:
    roidb = dm.val_roidb
    limit = dm.cfg.TEST["PROPOSAL_LIMIT"]
    seen: list[int] = []
    lengths = []
    for rank in range(world):
        loader = EvalLoader(roidb, dm.cfg, rank=rank, world_size=world, ims_per_batch=2,
                            with_rois=True)
        lengths.append(sum(len(b) for b in loader.batches))
        for batch in loader:
            meta = batch["_meta"]
            seen += meta["indices"]
            for b, (i, s) in enumerate(zip(meta["indices"], meta["im_scales"])):
                e = roidb[i]
                assert not e["flipped"] and meta["image_ids"][b] == e["id"]
                assert meta["heights"][b] == e["height"] and meta["widths"][b] == e["width"]
                np.testing.assert_allclose(batch["im_info"][b].numpy(),
                                           [round(e["height"] * s), round(e["width"] * s), s],
                                           rtol=1e-6)
                props = e["boxes"][e["gt_classes"] == 0][:limit]
                rows = batch["rois"][batch["rois"][:, 0] == b]
                np.testing.assert_allclose(rows[:, 1:].numpy(), props * np.float32(s), rtol=1e-6)
                h, w = batch["_meta"]["image_sizes"][b].tolist()
                assert (h, w) == (round(e["height"] * s), round(e["width"] * s))
    assert seen == list(range(len(roidb)))  # contiguous shards: rank order is roidb order
    assert max(lengths) - min(lengths) <= 1


def test_eval_without_proposals_has_no_rois(dm: RoIDataModule) -> None:
    batch = next(iter(EvalLoader(dm.val_roidb, dm.cfg, with_rois=False)))
    assert "rois" not in batch and batch["data"].dtype == torch.uint8


# ---------------------------------------------------------------------- Trainer runs
class _RecorderHooks:
    def __init__(self, fail_at: int | None = None) -> None:
        self.trained: list[list[int]] = []
        self.fail_at = fail_at

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.fail_at is not None and trainer.global_step == self.fail_at:
            raise RuntimeError("simulated failure inside the training step")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.trained.append(list(batch["_meta"]["indices"]))


def _trainer(tmp: Path, steps: int, callbacks: list, ns: Any = pl, **kw: Any) -> pl.Trainer:
    return ns.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      default_root_dir=str(tmp), num_sanity_val_steps=0,
                      limit_val_batches=0, callbacks=callbacks, **kw)


def _model(ns: Any = None) -> Any:
    from lit_roidata.demo import DemoFastRCNN

    return (DemoFastRCNN if ns is None else ns.lit(DemoFastRCNN))(**TINY_MODEL)


@pytest.mark.parametrize("infinite", [False, True])
def test_fit_without_warnings_and_resume_after_an_exception(
        root: Path, tmp_path: Path, infinite: bool, lightning_ns: Any) -> None:
    """A failure inside step 3 → OnExceptionCheckpoint → resume: the batches trained
    after the resume are exactly those an uninterrupted run trains (the failed one too),
    and a normal run raises no Lightning warning about samplers or resuming. In both
    Lightning namespaces (``lit_roidata`` with ``pytorch_lightning``,
    ``lit_roidata.lightning`` with ``import lightning as L``)."""
    ns = lightning_ns
    kw = dm_kwargs(root, num_workers=1, infinite=infinite)
    steps = 6
    Recorder, DataModule = ns.callback(_RecorderHooks), ns.lit(DemoRoIDataModule)
    full = Recorder()
    ns.seed_everything(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path / "a", steps, [full], ns).fit(_model(ns),
                                                        datamodule=DataModule(**kw))
    ours = [w for w in caught if "lit_roidata" in w.filename or any(
        s in str(w.message).lower() for s in ("sampler", "resum", "dataloader", "worker"))]
    assert not ours, [str(w.message) for w in ours]
    assert len(full.trained) == steps

    crash = Recorder(fail_at=3)
    ckpt_dir = tmp_path / "exc"
    on_exc = ns.callbacks.OnExceptionCheckpoint(dirpath=str(ckpt_dir))
    with pytest.raises(RuntimeError, match="simulated failure"):
        _trainer(tmp_path / "b", steps, [crash, on_exc], ns).fit(_model(ns),
                                                                   datamodule=DataModule(**kw))
    assert crash.trained == full.trained[:3]
    resumed = Recorder()
    _trainer(tmp_path / "c", steps, [resumed], ns).fit(
        _model(ns), datamodule=DataModule(**kw), ckpt_path=str(ckpt_dir / "on_exception.ckpt"))
    assert crash.trained + resumed.trained == full.trained


@pytest.mark.parametrize("target_format", ["detectron", "compact"])
def test_rpn_family_and_quirk_flag_reach_the_workers(root: Path, target_format: str) -> None:
    dm = DemoRoIDataModule(**dm_kwargs(root, model_type="faster_rcnn", fix_rpn_quirks=True,
                                   train_proposal_files=[], target_format=target_format))
    dm.prepare_data()
    dm.setup("fit")
    sampler = dm.make_sampler()
    ds = dm.make_dataset(sampler=sampler)
    assert ds.fix_rpn_quirks and ds.target_format == target_format
    batch = ds.__getitems__(next(iter(sampler)))
    assert "im_info" in batch
    assert ("rpn_labels_int32_wide" in batch) == (target_format == "detectron")
    batch = dm.on_after_batch_transfer(batch, 0)
    assert "rpn_labels_int32_wide" in batch
    assert list(batch)[:-1] == get_minibatch_blob_names(dm.cfg)


def test_torchvision_output_format(root: Path) -> None:
    dm = DemoRoIDataModule(**dm_kwargs(root, output_format="torchvision"))
    dm.prepare_data()
    dm.setup("fit")
    images, targets = next(iter(dm.train_dataloader()))
    assert len(images) == len(targets) == dm.cfg.TRAIN.IMS_PER_BATCH
    assert {"boxes", "labels", "image_id"} <= set(targets[0])


def test_skip_counts_are_counted_at_hand_out_reported_and_checkpointed(root: Path) -> None:
    """The loader's skip policy counts what a batch's ``_meta`` says when the batch is
    handed out; the counts travel in the loader's state and the epoch's exchange reports
    and clears them."""
    dm = DemoRoIDataModule(**dm_kwargs(root, on_bad_image="skip"))
    dm.setup("fit")
    loader = dm.train_dataloader()
    batch = {"data": torch.zeros(1, 3, 4, 4, dtype=torch.uint8),
             "_meta": {"skipped": [{"reason": "missing"}, {"reason": "undecodable"}],
                       "num_invalid_replaced": 2, "image_sizes": torch.tensor([[4, 4]])}}
    loader.skip_policy.count(batch["_meta"])
    counts = {"missing": 1, "undecodable": 1, "invalid_minibatch": 2}
    assert loader.state_dict()["skip"]["pending"] == counts
    other = DemoRoIDataModule(**dm_kwargs(root, on_bad_image="skip"))
    other.setup("fit")
    restored = other.train_dataloader()
    restored.load_state_dict(loader.state_dict())
    assert restored.skip_policy.exchange(restored.position)["counts"] == counts
    assert loader.skip_policy.exchange(loader.position)["counts"] == counts
    assert loader.skip_policy.exchange(loader.position)["counts"] == {}
    assert loader.skip_policy.run_report(log_it=False)["counts"] == counts
    assert DemoRoIDataModule(**dm_kwargs(root)).train_dataloader().skip_policy is None


@pytest.mark.parametrize("pixel_format", ["uint8", "detectron"])
def test_compact_masks_expand_on_device_to_detectron_blobs(root: Path, pixel_format: str) -> None:
    """mask_format="compact" + on_after_batch_transfer == Detectron's blobs from the workers."""
    batches = {}
    for mask_format in ("compact", "detectron"):
        dm = DemoRoIDataModule(**dm_kwargs(root, model_type="mask_rcnn_proposals",
                                       mask_format=mask_format, pixel_format=pixel_format))
        dm.prepare_data()
        dm.setup("fit")
        sampler = dm.make_sampler()
        ds = dm.make_dataset(sampler=sampler)
        raw = ds.__getitems__(next(iter(sampler)))
        if mask_format == "compact":
            assert "mask_class_int32" in raw
        batches[mask_format] = dm.on_after_batch_transfer(dict(raw), 0)
    compact, detectron = batches["compact"], batches["detectron"]
    assert list(compact)[:-1] == list(detectron)[:-1] == get_minibatch_blob_names(dm.cfg)
    for name in get_minibatch_blob_names(dm.cfg):
        a, b = torch.as_tensor(compact[name]), torch.as_tensor(detectron[name])
        assert a.dtype == b.dtype and torch.equal(a, b), name
    masks = torch.as_tensor(detectron["masks_int32"])
    assert masks.shape[1] == dm.cfg.MODEL.NUM_CLASSES * dm.cfg.MRCNN.RESOLUTION ** 2


@pytest.mark.parametrize("shm_pool", [False, True])
def test_compact_torchvision_masks_cross_workers_and_paste_to_full_masks(root: Path,
                                                                         shm_pool: bool) -> None:
    """The torchvision output's default compact masks, through a worker and the transfer
    step, equal the full masks of ``mask_format="detectron"``, in a fraction of the bytes."""
    from lit_roidata.minibatch.transport import transfer_report

    batches, sizes = {}, {}
    for mask_format in ("compact", "detectron"):
        dm = DemoRoIDataModule(**dm_kwargs(root, output_format="torchvision", num_workers=1,
                                           model_type="mask_rcnn_fpn", shm_pool=shm_pool,
                                           **({} if mask_format == "compact"
                                              else {"mask_format": mask_format})))
        dm.setup("fit")
        it = iter(dm.train_dataloader())
        raw = [next(it) for _ in range(3)]
        sizes[mask_format] = sum(r["shared_bytes"] + r["copied_bytes"]
                                 for r in map(transfer_report, raw))
        assert all(("mask_crops" in t) == (mask_format == "compact") for b in raw for t in b[1])
        batches[mask_format] = [dm.on_after_batch_transfer(dm.transfer_batch_to_device(
            b, torch.device("cpu"), 0), 0) for b in raw]
        dm.teardown("fit")
    assert sizes["compact"] < sizes["detectron"]
    for a, b in zip(batches["compact"], batches["detectron"]):
        for ta, tb in zip(a[1], b[1]):
            assert list(ta) == list(tb) and type(ta["masks"]) is type(tb["masks"])
            assert ta["masks"].dtype == torch.uint8 and torch.equal(ta["masks"], tb["masks"])


@pytest.mark.parametrize("name", ["EvalLoader", "EvalDataset", "fork_safe_opencv"])
def test_the_data_module_re_exports_nothing(name: str) -> None:
    import lit_roidata.datamodule as dm_module

    with pytest.raises(AttributeError):
        getattr(dm_module, name)


def test_worker_modules_import_no_lightning() -> None:
    """DataLoader workers import the loader, dataset and skip modules: not Lightning
    (seconds of import per worker; a fresh interpreter, as a spawned worker)."""
    code = ("import sys, lit_roidata.loader, lit_roidata.dataset, lit_roidata.skip; "
            "print(sorted(m for m in sys.modules if 'lightning' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stdout


def test_finish_batch_is_the_device_hook():
    from lit_roidata.config import load_detectron_cfg
    from lit_roidata.minibatch.device import finish_batch, normalize_on_device

    cfg = load_detectron_cfg(None)
    data = torch.randint(0, 256, (2, 3, 8, 6), dtype=torch.uint8)
    sizes = torch.tensor([[8, 6], [5, 4]])
    out = finish_batch({"data": data.clone(), "_meta": {"image_sizes": sizes}}, cfg)
    assert torch.equal(out["data"], normalize_on_device(data, sizes, cfg.PIXEL_MEANS))
    assert out["data"][1, :, 5:].abs().sum() == 0  # the padding is zeroed
    # no sizes in _meta: the whole padded blob counts as the image
    full = finish_batch({"data": data.clone()}, cfg)["data"]
    assert torch.equal(full, normalize_on_device(data, [[8, 6]] * 2, cfg.PIXEL_MEANS))
    other = (data,)
    assert finish_batch(other, cfg) is other  # not a dict batch: unchanged
