"""RoIBlockDataset: blocks in workers, determinism, bad images, invalid minibatches."""

from __future__ import annotations

import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_roidata.dataset import RoIBlockDataset, rebuild_block
from lit_roidata.sampler import Block
from lit_roidata.minibatch import BadImageError, get_minibatch_blob_names, normalize_on_device
from test_minibatch_helpers import image_roidb, make_entry, small_cfg

TESTS = Path(__file__).resolve().parent
CFG = {"MODEL.MASK_ON": True, "MRCNN.RESOLUTION": 6, "FPN.FPN_ON": True,
       "FPN.MULTILEVEL_ROIS": True, "FPN.COARSEST_STRIDE": 16}


_roidb = image_roidb  # (a subprocess test imports it by this name)


def _same(a, b):
    assert list(a) == list(b)
    for k in a:
        if k != "_meta":
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_block_output_layout_and_meta(tmp_path):
    cfg = small_cfg(**CFG)
    ds = RoIBlockDataset(_roidb(tmp_path), cfg)
    out = ds.__getitems__(Block([0, 2], seed=5, pass_index=1, block_index=3))
    assert list(out)[:-1] == get_minibatch_blob_names(cfg) and list(out)[-1] == "_meta"
    assert out["data"].dtype == torch.uint8 and out["data"].shape[2] % 16 == 0
    meta = out["_meta"]
    assert meta["image_ids"].tolist() == [100, 102] and meta["flipped"].tolist() == [False, True]
    assert (meta["seed"], meta["pass_index"], meta["block_index"]) == (5, 1, 3)
    assert meta["num_skipped"] == 0 and meta["datasets"] == ["test_ds", "test_ds"]
    assert meta["im_info"].shape == (2, 3) and meta["image_sizes"].dtype == torch.int32
    # the uint8 blob normalised on the device is Detectron's float blob (within 1 grey)
    ref = RoIBlockDataset(ds.roidb, cfg, pixel_format="detectron").__getitems__(
        Block([0, 2], seed=5, pass_index=1, block_index=3))
    dev = normalize_on_device(out["data"], meta["image_sizes"], cfg.PIXEL_MEANS)
    assert dev.shape == ref["data"].shape and (dev - ref["data"]).abs().mean() < 0.5
    for k in out:
        if k not in ("data", "_meta"):
            assert torch.equal(out[k], ref[k]), k  # targets do not depend on pixel format


def test_same_block_same_tensors_other_block_differs(tmp_path):
    roidb = _roidb(tmp_path)
    cfg = small_cfg(**CFG)
    a = rebuild_block(roidb, cfg, [1, 3], seed=1, pass_index=0, block_index=7)
    b = rebuild_block(roidb, cfg, [1, 3], seed=1, pass_index=0, block_index=7)
    _same(a, b)
    c = rebuild_block(roidb, cfg, [1, 3], seed=1, pass_index=0, block_index=8)
    assert not torch.equal(a["rois"], c["rois"])
    d = rebuild_block(roidb, cfg, [1, 3], seed=1, pass_index=0, block_index=7, rng_mode="detectron")
    e = rebuild_block(roidb, cfg, [1, 3], seed=1, pass_index=0, block_index=7, rng_mode="detectron")
    _same(d, e)


@pytest.mark.slow
def test_rebuild_in_another_process_is_identical(tmp_path):
    roidb = _roidb(tmp_path)
    cfg = small_cfg(**CFG)
    here = rebuild_block(roidb, cfg, [4, 5], seed=9, pass_index=2, block_index=11)
    script = textwrap.dedent(f"""
        import sys, torch, numpy as np
        sys.path.insert(0, {str(TESTS)!r})
        from pathlib import Path
        from test_dataset import _roidb, CFG
        from test_minibatch_helpers import small_cfg
        from lit_roidata.dataset import rebuild_block
        out = rebuild_block(_roidb(Path({str(tmp_path)!r})), small_cfg(**CFG), [4, 5], seed=9,
                            pass_index=2, block_index=11)
        out.pop("_meta")
        torch.save(out, {str(tmp_path / "other.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=str(TESTS.parent))
    other = torch.load(tmp_path / "other.pt")
    here.pop("_meta")
    _same(here, other)


def test_dataloader_workers_match_in_process(tmp_path):
    roidb = _roidb(tmp_path)
    cfg = small_cfg(**CFG)
    ds = RoIBlockDataset(roidb, cfg)
    blocks = [Block([i, i + 2], seed=3, pass_index=0, block_index=i) for i in range(3)]
    dl = torch.utils.data.DataLoader(ds, batch_sampler=blocks, collate_fn=lambda b: b,
                                     num_workers=1, multiprocessing_context="fork")
    for blk, got in zip(blocks, dl):
        _same(got, ds.__getitems__(blk))


def test_bad_image_raise_names_file(tmp_path):
    roidb = _roidb(tmp_path)
    roidb[1]["image"] = str(tmp_path / "missing.jpg")
    ds = RoIBlockDataset(roidb, small_cfg())
    with pytest.raises(BadImageError, match=r"image id 101 of dataset 'test_ds'.*missing\.jpg"):
        ds.__getitems__(Block([0, 1], seed=0, pass_index=0, block_index=0))


def test_bad_image_skip_replaces_deterministically_and_counts(tmp_path):
    roidb = _roidb(tmp_path)
    Path(roidb[1]["image"]).write_bytes(b"\xff\xd8 truncated")
    calls = []

    def replacement(block, attempt):
        calls.append(attempt)
        return block.derive([2, 3] if attempt == 1 else [4, 5], attempt=attempt)

    ds = RoIBlockDataset(roidb, small_cfg(), on_bad_image="skip", replacement=replacement)
    blk = Block([0, 1], seed=0, pass_index=0, block_index=4)
    out = ds.__getitems__(blk)
    meta = out["_meta"]
    assert calls == [1] and meta["indices"] == [2, 3] and meta["requested_indices"] == [0, 1]
    assert meta["attempt"] == 1 and meta["num_skipped"] == 1
    assert meta["skipped"][0]["image_id"] == 101 and meta["skipped"][0]["reason"] == "undecodable"
    assert ds.skip_counts["undecodable"] == 1
    again = RoIBlockDataset(roidb, small_cfg(), on_bad_image="skip",
                            replacement=replacement).__getitems__(blk)
    _same(out, again)
    # default replacement (no sampler): deterministic too, same orientation as the block
    d1 = RoIBlockDataset(roidb, small_cfg(), on_bad_image="skip").__getitems__(blk)
    d2 = RoIBlockDataset(roidb, small_cfg(), on_bad_image="skip").__getitems__(blk)
    assert d1["_meta"]["indices"] == d2["_meta"]["indices"] and 1 not in d1["_meta"]["indices"]


def test_invalid_keypoint_minibatch_replaced_then_bounded(tmp_path):
    roidb = _roidb(tmp_path)
    r = np.random.default_rng(0)
    for i, e in enumerate(roidb):
        kp = make_entry(r, width=e["width"], height=e["height"], keypoints=4)
        e.update({k: kp[k] for k in kp if k not in ("image", "id", "flipped")})
        e["gt_keypoints"][:, 2, :] = 2 if i >= 4 else 0  # only 4 and 5 have visible keypoints
    cfg = small_cfg(**{"MODEL.KEYPOINTS_ON": True, "KRCNN.NUM_KEYPOINTS": 4,
                       "KRCNN.HEATMAP_SIZE": 8,
                       "KRCNN.MIN_KEYPOINT_COUNT_FOR_VALID_MINIBATCH": 0})
    rep = lambda b, a: b.derive([4, 5], attempt=a)  # noqa: E731
    ds = RoIBlockDataset(roidb, cfg, replacement=rep)
    out = ds.__getitems__(Block([0, 1], seed=0, pass_index=0, block_index=0))
    assert out["_meta"]["indices"] == [4, 5] and out["_meta"]["num_invalid_replaced"] == 1
    assert ds.skip_counts["invalid_minibatch"] == 1
    stuck = RoIBlockDataset(roidb, cfg, max_attempts=2, replacement=lambda b, a: b)
    with pytest.raises(RuntimeError, match="no usable minibatch after 2 replacements"):
        stuck.__getitems__(Block([0, 1], seed=0, pass_index=0, block_index=0))


def test_torchvision_output_and_pickling(tmp_path):
    roidb = _roidb(tmp_path)
    cfg = small_cfg(**{"MODEL.MASK_ON": True})
    ds = RoIBlockDataset(roidb, cfg, output_format="torchvision")
    batch = ds.__getitems__(Block([0, 1], seed=0, pass_index=0, block_index=0))
    images, targets = batch
    assert batch.meta["indices"] == [0, 1]
    back = pickle.loads(pickle.dumps(batch))
    assert back.meta["indices"] == [0, 1] and torch.equal(back[0][0], images[0])
    with pytest.raises(ValueError, match="output_format"):
        RoIBlockDataset(roidb, cfg, output_format="coco")
    with pytest.raises(TypeError, match="Block"):
        ds.__getitems__([0, 1])


def test_compact_masks_finalized_on_device_equal_detectron_blobs(tmp_path):
    from lit_roidata.minibatch.device import finalize_on_device

    roidb = _roidb(tmp_path)
    cfg = small_cfg(**CFG)
    blk = Block([0, 3], seed=4, pass_index=0, block_index=1)
    ref = RoIBlockDataset(roidb, cfg, pixel_format="detectron").__getitems__(blk)
    fast = RoIBlockDataset(roidb, cfg, mask_format="compact").__getitems__(blk)
    assert fast["masks_int32"].shape[1] == 36 and "mask_class_int32" in fast
    out = finalize_on_device(fast, cfg.PIXEL_MEANS, cfg.MODEL.NUM_CLASSES)
    assert "mask_class_int32" not in out and list(out) == list(ref)
    assert torch.equal(out["masks_int32"], ref["masks_int32"])
    assert out["data"].dtype == torch.float32 and (out["data"] - ref["data"]).abs().mean() < 0.5
    assert finalize_on_device(ref, cfg.PIXEL_MEANS, cfg.MODEL.NUM_CLASSES) is ref


def test_transport_packs_small_tensors_into_one_buffer():
    from lit_roidata.minibatch.transport import packed

    big = torch.zeros(2, 3, 8, 8, dtype=torch.uint8).share_memory_()
    d = {"data": big, "rois": torch.randn(7, 5), "n": torch.tensor(2.5),
         "_meta": {"ids": torch.tensor([3, 4]), "flipped": torch.tensor([True, False]),
                   "names": ["a", "b"], "empty": torch.zeros(0, 5)}}
    back = pickle.loads(pickle.dumps(packed(d)))
    assert type(back) is dict and list(back) == list(d) and list(back["_meta"]) == list(d["_meta"])
    for got, want in [(back["rois"], d["rois"]), (back["n"], d["n"]),
                      (back["_meta"]["ids"], d["_meta"]["ids"]),
                      (back["_meta"]["flipped"], d["_meta"]["flipped"]),
                      (back["_meta"]["empty"], d["_meta"]["empty"]), (back["data"], big)]:
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    # the small ones share one storage
    ptr = back["rois"].untyped_storage().data_ptr()
    assert back["_meta"]["ids"].untyped_storage().data_ptr() == ptr


def test_bad_image_in_worker_reraised_with_names(tmp_path):
    roidb = _roidb(tmp_path)
    roidb[1]["image"] = str(tmp_path / "missing.jpg")
    ds = RoIBlockDataset(roidb, small_cfg())
    dl = torch.utils.data.DataLoader(
        ds, batch_sampler=[Block([0, 1], seed=0, pass_index=0, block_index=0)],
        collate_fn=lambda b: b, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(BadImageError, match=r"image id 101 of dataset 'test_ds'.*missing\.jpg"):
        next(iter(dl))


class _SizedRoidb(list):
    widths = np.array([4., 2, 4, 4, 2, 4, 2, 4, 4, 2, 4, 4])
    heights = np.array([2., 4, 2, 2, 4, 2, 4, 2, 2, 4, 2, 2])


def test_replacement_without_a_sampler_is_the_same_policy_in_its_own_domain():
    # Values pinned before the two replacement policies became one (draw_replacement):
    # without a sampler the substitute comes from the block's orientation group, drawn in
    # the dataset's own seed domain (not the sampler's).
    ds = RoIBlockDataset(_SizedRoidb([{}] * 12), small_cfg())
    got = {first: [ds._replacement(Block([first, 3], seed=7, pass_index=1, block_index=3), a)
                   for a in (1, 2)] for first in (0, 1)}
    assert [list(b) for b in got[0]] == [[8, 2], [11, 2]]  # horizontal like entry 0
    assert [list(b) for b in got[1]] == [[6, 1], [9, 1]]  # vertical like entry 1
    assert [(b.seed, b.pass_index, b.block_index, b.attempt) for b in got[0]] == [
        (7, 1, 3, 1), (7, 1, 3, 2)]
    plain = RoIBlockDataset([{}] * 12, small_cfg())  # no sizes: the whole roidb
    assert [list(plain._replacement(Block([0, 3], 7, 1, 3), a)) for a in (1, 2)] == [
        [7, 1], [11, 2]]
