"""The torchvision output's fast paths equal the previous implementation bit for bit.

Oracles: ``tests/oracles/minibatch.py`` (the code before the speed work) and
``pycocotools.mask.decode``.
"""

from __future__ import annotations

import numpy as np
import pycocotools.mask as mask_util
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oracles import minibatch as oracle
from lit_roidata.minibatch import torchvision_format as tvf
from lit_roidata.minibatch.core import build_minibatch  # noqa: F401  (import order as users)
from lit_roidata.minibatch.mask import decode_rle_into, rle_counts
from test_minibatch_helpers import make_entry, small_cfg, write_image


def _masks_of(draw_mask: np.ndarray) -> dict:
    return mask_util.encode(np.asfortranarray(draw_mask.astype(np.uint8)))


@st.composite
def binary_masks(draw):
    h = draw(st.integers(1, 40))
    w = draw(st.integers(1, 40))
    kind = draw(st.sampled_from(["random", "zeros", "ones", "rect", "edges", "sparse"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "random":
        m = rng.random((h, w)) < rng.random()
    elif kind == "zeros":
        m = np.zeros((h, w), bool)
    elif kind == "ones":
        m = np.ones((h, w), bool)
    elif kind == "sparse":
        m = rng.random((h, w)) < 0.02
    else:
        m = np.zeros((h, w), bool)
        y0, x0 = rng.integers(0, h), rng.integers(0, w)
        m[y0:rng.integers(y0, h + 1), x0:rng.integers(x0, w + 1)] = True
        if kind == "edges":  # runs that wrap from the bottom of a column to the next top
            m[0, :] = True
            m[-1, :] = True
    return m


@settings(max_examples=300)
@given(binary_masks())
def test_decode_rle_into_equals_pycocotools(m):
    rle = _masks_of(m)
    ref = mask_util.decode(rle)
    out = np.zeros(m.shape, np.uint8)
    decode_rle_into(rle["counts"], out)
    assert np.array_equal(out, ref)
    decode_rle_into(rle["counts"].decode("ascii"), out2 := np.zeros(m.shape, np.uint8))
    assert np.array_equal(out2, ref)


def test_rle_counts_large_and_negative_differences():
    # long runs (several 5-bit groups) and counts smaller than two before (negative deltas)
    h, w = 700, 900
    m = np.zeros((h, w), np.uint8)
    m[10:650, 5:800] = 1
    m[3, 850:] = 1
    m[:, 0] = 1
    rle = _masks_of(m)
    counts = rle_counts(rle["counts"])
    assert counts.sum() == h * w
    flat = np.repeat(np.arange(counts.size) % 2, counts).astype(np.uint8)
    assert np.array_equal(flat.reshape(w, h).T, m)
    assert rle_counts(b"").size == 0


@st.composite
def segm_entries(draw):
    """An entry with every kind of segm the torchvision path sees, and a target size."""
    height = draw(st.integers(8, 60))
    width = draw(st.integers(8, 60))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    segms = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["poly", "poly", "multi", "short", "empty", "rle",
                                     "rle_list", "uncompressed", "outside"]))
        if kind in ("poly", "multi", "outside", "short"):
            n_parts = 1 if kind != "multi" else int(rng.integers(2, 4))
            parts = []
            for _ in range(n_parts):
                k = 2 if kind == "short" else int(rng.integers(3, 8))
                lo, hi = (-20.0, width + 20.0) if kind == "outside" else (0.0, float(width))
                xs = np.round(rng.uniform(lo, hi, k), 2)
                ys = np.round(rng.uniform(lo, height + (20 if kind == "outside" else 0), k), 2)
                parts.append(np.stack([xs, ys], 1).ravel().tolist())
            if kind == "multi":
                parts.append([1.0, 2.0, 3.0, 4.0])  # < 3 points: dropped
            segms.append(parts)
        elif kind == "empty":
            segms.append([])
        else:
            m = np.zeros((height, width), np.uint8)
            y0, x0 = rng.integers(0, height), rng.integers(0, width)
            m[y0:y0 + rng.integers(1, 20), x0:x0 + rng.integers(1, 20)] = 1
            rle = _masks_of(m)
            if kind == "uncompressed":
                c = rle_counts(rle["counts"]).tolist()
                segms.append({"size": [height, width], "counts": c})
            elif kind == "rle_list":
                segms.append([{"size": [height, width], "counts": rle["counts"].decode()}])
            else:
                segms.append({"size": [height, width], "counts": rle["counts"].decode()})
    n = len(segms)
    entry = {"height": height, "width": width, "segms": segms,
             "gt_classes": np.ones(n, np.int32)}
    rows = np.flatnonzero(rng.random(n) < 0.8) if n else np.zeros(0, np.int64)
    scale = draw(st.sampled_from([1.0, 0.5, 1.37, 2.0, float(rng.uniform(0.3, 3.0))]))
    h = max(1, int(round(height * scale)))
    w = max(1, int(round(width * scale)))
    return entry, rows, scale, h, w


@settings(max_examples=200)
@given(segm_entries(), st.booleans())
def test_masks_equal_previous_implementation(case, shared):
    entry, rows, scale, h, w = case
    new = tvf._masks(entry, rows, scale, h, w, shared)
    old = oracle.tv_masks(entry, rows, scale, h, w, shared)
    assert new.dtype == old.dtype and new.shape == old.shape
    assert torch.equal(new, old)


@settings(max_examples=60)
@given(st.integers(1, 50), st.integers(1, 50), st.sampled_from(["uint8", "detectron"]),
       st.booleans(), st.booleans(), st.integers(0, 2**32 - 1))
def test_image_tensor_equals_previous_implementation(h, w, pixel_format, shared, strided, seed):
    rng = np.random.default_rng(seed)
    if pixel_format == "uint8":
        im = rng.integers(0, 256, (h, 2 * w if strided else w, 3), dtype=np.uint8)
    else:
        im = rng.normal(0, 50, (h, 2 * w if strided else w, 3)).astype(np.float32)
    if strided:
        im = im[:, ::2]
    new = tvf._image_tensor(im, pixel_format, shared)
    old = oracle.tv_image_tensor(im, pixel_format, shared)
    assert type(new) is type(old) and new.dtype == old.dtype and new.shape == old.shape
    assert torch.equal(new.as_subclass(torch.Tensor), old.as_subclass(torch.Tensor))


@pytest.mark.parametrize("rng_kind", ["block", "detectron"])
@pytest.mark.parametrize("flipped", [False, True])
def test_whole_batch_equals_previous_implementation(tmp_path, monkeypatch, rng_kind, flipped):
    cfg = small_cfg(**{"MODEL.MASK_ON": True, "TRAIN.SCALES": [40, 72],
                       "TRAIN.MAX_SIZE": 200})
    entries = _entries_for_batch(tmp_path, flipped)

    def gen():
        return (np.random.RandomState(3) if rng_kind == "detectron"
                else np.random.default_rng(3))

    for shared in (False, True):
        ims, tgts = tvf.build_torchvision_batch(entries, cfg, gen(), shared=shared)
        with monkeypatch.context() as mp:
            mp.setattr(tvf, "_masks", oracle.tv_masks)
            mp.setattr(tvf, "_image_tensor", oracle.tv_image_tensor)
            ims0, tgts0 = tvf.build_torchvision_batch(entries, cfg, gen(), shared=shared)
        for a, b in zip(ims, ims0):
            assert torch.equal(a.as_subclass(torch.Tensor), b.as_subclass(torch.Tensor))
        for a, b in zip(tgts, tgts0):
            assert a.keys() == b.keys()
            for k in a:
                if torch.is_tensor(a[k]):
                    assert type(a[k]) is type(b[k]) and torch.equal(
                        a[k].as_subclass(torch.Tensor), b[k].as_subclass(torch.Tensor)), k
                else:
                    assert a[k] == b[k], k


@settings(max_examples=200)
@given(segm_entries(), st.booleans())
def test_compact_masks_paste_to_the_full_masks(case, shared):
    """Cropped, bit-packed masks pasted back (the device step) equal the full masks."""
    from lit_roidata.minibatch.device import paste_mask_crops

    entry, rows, scale, h, w = case
    full = tvf._masks(entry, rows, scale, h, w)
    bits, boxes = tvf._mask_crops(full.numpy(), shared)
    assert bits.is_shared() == boxes.is_shared() == shared and boxes.shape == (rows.size, 4)
    assert bits.numel() <= (full.numel() + 7) // 8
    out = paste_mask_crops(bits, boxes, (h, w))
    assert out.dtype == torch.uint8 and torch.equal(out, full)


def _entries_for_batch(tmp_path, flipped):
    r = np.random.default_rng(11)
    entries = []
    for i in range(3):
        p = tmp_path / f"t{i}.png"
        write_image(p, 64, 48, seed=i)
        entries.append(make_entry(r, image=str(p), image_id=i, crowd=i == 1,
                                  num_gt=(0 if i == 2 else 4), flipped=flipped))
    return entries


@pytest.mark.parametrize("flipped", [False, True])
@pytest.mark.parametrize("augmented", [False, True])
def test_compact_masks_finished_equal_full_masks(tmp_path, flipped, augmented):
    """A batch with compact masks after ``finish_batch`` (``on_after_batch_transfer``) is
    the full-mask batch, key order included (crowd, flipped, augmented, empty images)."""
    import albumentations as A

    from lit_roidata.minibatch.augment import Augmentation
    from lit_roidata.minibatch.device import finish_batch, paste_target_masks

    cfg = small_cfg(**{"MODEL.MASK_ON": True, "TRAIN.SCALES": [40, 72], "TRAIN.MAX_SIZE": 200})
    entries = _entries_for_batch(tmp_path, flipped)
    aug = Augmentation([A.Affine(scale=(0.8, 1.2), rotate=(-10, 10), p=1)], cfg) \
        if augmented else None
    for shared in (False, True):
        full = tvf.build_torchvision_batch(entries, cfg, np.random.default_rng(3), augment=aug,
                                           shared=shared)
        batch = tvf.TorchvisionBatch(tvf.build_torchvision_batch(
            entries, cfg, np.random.default_rng(3), augment=aug, shared=shared,
            compact_masks=True))
        assert all("masks" not in t and "mask_crops" in t for t in batch[1])
        assert finish_batch(batch, cfg) is batch
        assert paste_target_masks(batch) is batch  # pasted already: unchanged
        assert [t["masks"].shape[0] for t in batch[1]] == [4, 3, 0]  # one crowd gt
        for a, b in zip(batch[1], full[1]):
            assert list(a) == list(b)
            for k in a:
                if torch.is_tensor(a[k]):
                    assert type(a[k]) is type(b[k]) and torch.equal(a[k], b[k]), k
                else:
                    assert a[k] == b[k], k
