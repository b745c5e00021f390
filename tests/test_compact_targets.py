"""``target_format="compact"``: workers ship the sampled anchors; the device expands them to
Detectron's dense RPN / RetinaNet blobs, bit for bit, for every family and both RNG modes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lit_roidata.catalog import Catalog
from lit_roidata.config import get_cfg
from lit_roidata.dataset import RoIBlockDataset
from lit_roidata.sampler import Block
from lit_roidata.demo.data import register_demo_datasets
from lit_roidata.minibatch import get_minibatch_blob_names
from lit_roidata.minibatch.anchors import concat_fields, level_offsets, rpn_fields
from lit_roidata.minibatch.device import expand_sparse, expand_targets, finalize_on_device
from lit_roidata.minibatch.model_type import flags_for_model_type
from lit_roidata.minibatch.rpn import RPN_COMPACT_KEYS, add_rpn_blobs
from lit_roidata.roidb.build import combined_roidb_for_training

# Every family whose loader blobs hold RPN or RetinaNet targets (the e2e configs put
# the RPN family in the loader whatever their second stage: boxes, masks, keypoints).
FAMILIES = ["rpn_only", "rpn_only_fpn", "faster_rcnn", "faster_rcnn_fpn", "mask_rcnn",
            "mask_rcnn_fpn", "keypoint_rcnn", "keypoint_rcnn_fpn", "retinanet"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compact")
    reg = register_demo_datasets(tmp / "demo", Catalog(), num_images={
        "demo_train_a": 6, "demo_train_b": 2, "demo_val": 1})
    return reg, tmp


def _cfg(model_type: str, **extra):
    cfg = get_cfg()
    cfg.merge_from_dict(flags_for_model_type(model_type))
    over = {"MODEL.NUM_CLASSES": 5, "TRAIN.SCALES": (160, 200), "TRAIN.MAX_SIZE": 333,
            "TRAIN.IMS_PER_BATCH": 2}
    if model_type == "retinanet":
        over.update({"FPN.RPN_MIN_LEVEL": 3, "FPN.RPN_MAX_LEVEL": 7, "FPN.COARSEST_STRIDE": 128})
    over.update(extra)
    cfg.merge_from_dict(over)
    return cfg


def _roidb(demo, cfg, name):
    reg, tmp = demo
    return combined_roidb_for_training(reg.train_datasets[:1], (), cfg,
                                       str(tmp / f"cache-{name}"), catalog=reg.catalog,
                                       progress=False)


def _assert_same(expanded, dense, names):
    assert [k for k in expanded if k != "_meta"] == [k for k in dense if k != "_meta"] == names
    for k in names:
        a, b = torch.as_tensor(expanded[k]), torch.as_tensor(dense[k])
        assert a.dtype == b.dtype and a.shape == b.shape, k
        # bit-identical, also for float blobs (compare the raw bytes, not the values)
        assert a.numpy().tobytes() == b.numpy().tobytes(), k


@pytest.mark.parametrize("rng_mode", ["block", "detectron"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_compact_expands_to_the_dense_blobs(demo, model_type, rng_mode):
    cfg = _cfg(model_type)
    roidb = _roidb(demo, cfg, model_type)
    n = len(roidb)
    blocks = [Block([i, (i + 3) % n], seed=7, pass_index=0, block_index=b)
              for b, i in enumerate(range(0, n, 3))]
    dense_ds = RoIBlockDataset(roidb, cfg, rng_mode=rng_mode, target_format="detectron",
                               mask_format="detectron")
    compact_ds = RoIBlockDataset(roidb, cfg, rng_mode=rng_mode, target_format="compact",
                                 mask_format="compact")
    names = get_minibatch_blob_names(cfg)
    for blk in blocks:
        dense = dense_ds.__getitems__(blk)
        compact = compact_ds.__getitems__(blk)
        family_keys = [k for k in compact if k.startswith(("rpn_", "retnet_cls_labels"))]
        assert family_keys and not any(k.endswith("_wide") or k.endswith(tuple(
            f"_fpn{lvl}" for lvl in range(2, 8))) for k in family_keys), family_keys
        # the compact form is small: at most RPN_BATCH_SIZE_PER_IM rows per image
        if "rpn_compact_labels_int32" in compact:
            assert len(compact["rpn_compact_labels_int32"]) <= 2 * 256
        finalize_on_device(compact, cfg.PIXEL_MEANS, 5)
        finalize_on_device(dense, cfg.PIXEL_MEANS, 5)
        _assert_same(compact, dense, names)


def test_compact_raw_keeps_the_sampled_anchors(demo):
    """``expand_compact_targets=False`` (``target_format="compact_raw"``) leaves them."""
    cfg = _cfg("faster_rcnn_fpn")
    roidb = _roidb(demo, cfg, "faster_rcnn_fpn")
    blk = Block([0, 1], seed=1, pass_index=0, block_index=0)
    batch = RoIBlockDataset(roidb, cfg, target_format="compact").__getitems__(blk)
    finalize_on_device(batch, cfg.PIXEL_MEANS, 5, expand_compact_targets=False)
    assert all(k in batch for k in RPN_COMPACT_KEYS) and batch["data"].dtype == torch.float32
    rows = batch["rpn_compact_labels_int32"]
    assert rows.dtype == torch.int32 and set(rows[:, 2].tolist()) <= {0, 1}
    # the anchor column indexes the concatenated fields: every labelled anchor exists
    assert int(rows[:, 1].max()) < len(concat_fields(rpn_fields(cfg)))


def _tiny_fpn_cfg():
    cfg = get_cfg()
    cfg.merge_from_dict({"RPN.RPN_ON": True, "FPN.FPN_ON": True, "FPN.MULTILEVEL_RPN": True,
                         "FPN.RPN_MIN_LEVEL": 2, "FPN.RPN_MAX_LEVEL": 3,
                         "FPN.COARSEST_STRIDE": 8, "TRAIN.MAX_SIZE": 32,
                         "FPN.RPN_ANCHOR_START_SIZE": 8, "FPN.RPN_ASPECT_RATIOS": (1.0,)})
    return cfg


def test_hand_checked_expansion():
    """One gt box, one image: the compact rows land where the wide blobs put them."""
    cfg = _tiny_fpn_cfg()
    entry = {"id": 1, "image": "x.jpg", "width": 32, "height": 32, "flipped": False,
             "boxes": np.array([[0, 0, 7, 7]], np.float32), "gt_classes": np.array([1], np.int32),
             "is_crowd": np.zeros(1, bool), "segms": [], "seg_areas": np.zeros(1, np.float32),
             "box_to_gt_ind_map": np.zeros(1, np.int32), "max_classes": np.ones(1, np.int64),
             "max_overlaps": np.ones(1, np.float32)}
    dense: dict = {}
    compact: dict = {}
    add_rpn_blobs(dense, [1.0], [entry], cfg, np.random.RandomState(0))
    add_rpn_blobs(compact, [1.0], [entry], cfg, np.random.RandomState(0), compact=True)
    assert compact["rpn_compact_layout"].tolist() == [[2, 1, 8], [3, 1, 4]]
    # anchor (0, 0) of level 2, (-2, -2, 5, 5), straddles the border; the best inside
    # anchor is (2, 2, 9, 9) at cell y = x = 1 (index 9): IoU 36/92, a best-match positive
    assert concat_fields(rpn_fields(cfg))[9].tolist() == [2, 2, 9, 9]
    fg = compact["rpn_compact_fg_int32"]
    assert fg.tolist() == [[0, 9]]
    # targets of (0, 0, 7, 7) from (2, 2, 9, 9): centres 3.5 vs 5.5, equal sizes
    np.testing.assert_allclose(compact["rpn_compact_bbox_targets"], [[-0.25, -0.25, 0, 0]])
    n_lab = len(compact["rpn_compact_labels_int32"])
    assert compact["rpn_compact_outside_weights"].tolist() == [np.float32(1.0 / n_lab)]
    assert dense["rpn_labels_int32_wide_fpn2"][0, 0, 1, 1] == 1
    assert dense["rpn_bbox_inside_weights_wide_fpn2"][0, :, 1, 1].tolist() == [1.0] * 4
    assert (dense["rpn_labels_int32_wide_fpn2"] == 1).sum() == 1
    out = expand_targets({k: torch.from_numpy(v) for k, v in compact.items()
                          if k not in ("im_info", "roidb")})
    for k, v in out.items():
        np.testing.assert_array_equal(v.numpy(), dense[k], err_msg=k)
    offsets = level_offsets(rpn_fields(cfg))
    assert offsets.tolist() == [0, 64, 80]


def test_expand_sparse_and_order():
    rows = torch.tensor([[0, 3], [5, -1]], dtype=torch.int32)
    out = expand_sparse(rows, torch.tensor([1, 2, 3]))
    assert out.dtype == torch.int32 and out.view(-1).tolist() == [3, 0, 0, 0, 0, -1]
    batch = {"a": 1, "x_sparse": rows, "x_shape": torch.tensor([6]), "b": 2}
    expand_targets(batch)
    assert list(batch) == ["a", "x", "b"]


def test_datamodule_option_reaches_the_workers(tmp_path):
    from lit_roidata import DemoRoIDataModule

    dm = DemoRoIDataModule(demo_root=str(tmp_path / "demo"),
                       sources={"cache_dir": str(tmp_path / "c")},
                       model_type="faster_rcnn_fpn", loader={"num_workers": 0},
                       demo_size={"demo_train_a": 4, "demo_train_b": 2, "demo_val": 1},
                       overrides={"MODEL.NUM_CLASSES": 5, "TRAIN.SCALES": [160],
                                  "TRAIN.MAX_SIZE": 256})
    assert dm.make_dataset.__self__ is dm
    dm.prepare_data()
    dm.setup("fit")
    assert dm.make_dataset().target_format == "compact"
    raw = dm.make_dataset().__getitems__(next(iter(dm.make_sampler())))
    assert raw["_meta"]["target_format"] == "compact" and "rpn_compact_layout" in raw
    out = dm.on_after_batch_transfer(raw, 0)
    assert list(out)[:-1] == get_minibatch_blob_names(dm.cfg)
    with pytest.raises(ValueError, match="target_format"):
        RoIBlockDataset([], dm.cfg, target_format="dense")
    raw_dm = DemoRoIDataModule(demo_root=str(tmp_path / "demo"),
                           sources={"cache_dir": str(tmp_path / "c")},
                           model_type="faster_rcnn_fpn", loader={"num_workers": 0},
                           demo_size={"demo_train_a": 4, "demo_train_b": 2, "demo_val": 1},
                           overrides={"MODEL.NUM_CLASSES": 5, "TRAIN.SCALES": [160],
                                      "TRAIN.MAX_SIZE": 256},
                           output={"target_format": "compact_raw"})
    raw_dm.setup("fit")
    ds = raw_dm.make_dataset()
    assert ds.target_format == "compact"
    kept = raw_dm.on_after_batch_transfer(ds.__getitems__(next(iter(raw_dm.make_sampler()))), 0)
    assert all(k in kept for k in RPN_COMPACT_KEYS) and kept["data"].dtype == torch.float32
    assert not any(k.startswith("rpn_labels_int32_wide") for k in kept)


@pytest.mark.parametrize("target_format", ["compact", "detectron"])
def test_worker_output_crosses_with_one_copy(demo, monkeypatch, target_format):
    """Large blobs are built in shared memory (sent as a handle); only small tensors are
    copied, once, into the packed buffer, which is itself in shared memory."""
    import lit_roidata.dataset as dataset_mod
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (registers the tensor reducers)

    from lit_roidata.minibatch.transport import PackedBlobs, transfer_report

    cfg = _cfg("mask_rcnn_fpn")
    roidb = _roidb(demo, cfg, "mask_rcnn_fpn")
    blk = Block([0, 1], seed=3, pass_index=0, block_index=0)
    ref = RoIBlockDataset(roidb, cfg, target_format=target_format).__getitems__(blk)
    monkeypatch.setattr(dataset_mod, "_in_worker", lambda: True)
    out = RoIBlockDataset(roidb, cfg, target_format=target_format).__getitems__(blk)
    assert isinstance(out, PackedBlobs) and out["data"].is_shared()
    rep = transfer_report(out)
    assert rep["moved_bytes"] == 0
    big = [k for k, v in out.items()
           if torch.is_tensor(v) and v.numel() * v.element_size() > 1 << 16]
    assert all(out[k].is_shared() for k in big) and "data" in big
    if target_format == "compact":
        compact_bytes = sum(out[k].numel() * out[k].element_size() for k in RPN_COMPACT_KEYS)
        assert compact_bytes < 2 * 256 * 4 * 8 and rep["copied_bytes"] < rep["shared_bytes"] / 2
    else:  # the wide RPN blobs are allocated in shared memory too
        assert out["rpn_labels_int32_wide_fpn2"].is_shared()
    layout, buf = out.__reduce__()[1]
    assert buf.is_shared() and buf.numel() >= rep["packed_bytes"]
    back = ForkingPickler.loads(bytes(ForkingPickler.dumps(out)))
    for k, v in ref.items():
        if torch.is_tensor(v):
            assert torch.equal(back[k], v), k


def test_torchvision_output_built_in_shared_memory(demo, monkeypatch):
    """In a worker, torchvision images and masks are built in shared memory (no copy out)."""
    import lit_roidata.dataset as dataset_mod

    cfg = _cfg("mask_rcnn_fpn")
    roidb = _roidb(demo, cfg, "mask_rcnn_fpn")
    blk = Block([0, 1], seed=3, pass_index=0, block_index=0)
    ref = RoIBlockDataset(roidb, cfg, output_format="torchvision").__getitems__(blk)
    monkeypatch.setattr(dataset_mod, "_in_worker", lambda: True)
    out = RoIBlockDataset(roidb, cfg, output_format="torchvision").__getitems__(blk)
    for (im, tg), (rim, rtg) in zip(zip(*out), zip(*ref)):
        assert im.is_shared() and tg["masks"].is_shared() and not rim.is_shared()
        assert type(im) is type(rim) and torch.equal(im, rim)
        assert type(tg["masks"]) is type(rtg["masks"]) and torch.equal(tg["masks"], rtg["masks"])


def test_shared_empty_segments_read_as_zeros():
    """The worker allocator relies on new segments being zero-filled (no memset pass)."""
    from lit_roidata.dataset import _as_tensor, _shared_alloc

    for k in range(20):
        a = _shared_alloc((3, 257, 129), np.dtype(np.float32 if k % 2 else np.uint8))
        assert not a.any()
        a[...] = 7  # dirty it before it is freed; the next one must still be zeros
        t = _as_tensor(a)
        assert t.is_shared() and t.data_ptr() == a.ctypes.data
        del a, t
