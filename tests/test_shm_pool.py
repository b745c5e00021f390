"""Reusable shared-memory slots of DataLoader workers (lit_roidata.minibatch.shm_pool).

Safety first: a slot is reused only when every tensor (and view, slice, NumPy array) of
the batch it held is gone, so batches the main process keeps are never overwritten.
Then: reuse happens, outputs are identical with and without the pool (both target
formats, torchvision output), no shared-memory file is left, a killed worker leaves no
stale state for the next workers.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_roidata.dataset import RoIBlockDataset
from lit_roidata.loader import StatefulRoIDataLoader
from lit_roidata.minibatch import shm_pool
from lit_roidata.minibatch.model_type import flags_for_model_type
from lit_roidata.minibatch.shm_pool import ShmPool
from lit_roidata.sampler import RoIBatchSampler
from test_minibatch_helpers import image_roidb, small_cfg

CFG = {"MODEL.MASK_ON": True, "MRCNN.RESOLUTION": 6, "FPN.FPN_ON": True,
       "FPN.MULTILEVEL_ROIS": True, "FPN.COARSEST_STRIDE": 16}
RPN_CFG = {**flags_for_model_type("mask_rcnn_fpn"), "MRCNN.RESOLUTION": 6,
           "TRAIN.SCALES": (64,), "TRAIN.MAX_SIZE": 96}


def _loader(root: Path, *, num_workers: int = 2, cfg: dict = CFG, **kw) -> StatefulRoIDataLoader:
    roidb = image_roidb(root, 10)
    ds_kw = {k: kw.pop(k) for k in ("output_format", "target_format", "mask_format")
             if k in kw}
    ds = RoIBlockDataset(roidb, small_cfg(**cfg), **ds_kw)
    sampler = RoIBatchSampler(np.array([e["width"] for e in roidb]),
                              np.array([e["height"] for e in roidb]), 2, seed=4,
                              infinite=True)
    if num_workers:
        kw.setdefault("multiprocessing_context", "fork")
    return StatefulRoIDataLoader(ds, sampler, num_workers=num_workers, **kw)


def _tensors(obj, prefix=""):
    """(path, tensor) of every tensor in a batch (dict, list, tuple), in order."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}/{i}")


def _snapshot(batch):
    return [(k, t.clone()) for k, t in _tensors(batch)]


def _equal(batch, snap):
    got = list(_tensors(batch))
    assert [k for k, _ in got] == [k for k, _ in snap]
    for (k, a), (_, b) in zip(got, snap):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), k


def _meta(batch):
    return batch.meta if hasattr(batch, "meta") else batch["_meta"]


def _shm_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


# ---------------------------------------------------------------------- safety
@pytest.mark.parametrize("output_format", ["detectron", "torchvision"])
def test_kept_batches_are_never_overwritten(tmp_path, output_format):
    loader = _loader(tmp_path, output_format=output_format, prefetch_factor=2)
    it = iter(loader)
    kept, snaps, slices, slice_snaps = [], [], [], []
    for i in range(14):  # more than the 2 x (2 + 3) slots
        b = next(it)
        kept.append(b)
        snaps.append(_snapshot(b))
        # a slice and a NumPy view kept without their parent batch
        name, big = max(_tensors(b), key=lambda kv: kv[1].numel())
        part = big.reshape(-1)[: max(1, big.numel() // 3)]
        slices.append((part, big.reshape(-1)[-7:].numpy()))
        slice_snaps.append((part.clone(), big.reshape(-1)[-7:].clone().numpy()))
        del b, big, part
    pool = loader.shm_pool
    assert pool is not None
    for i in range(0, 14, 2):  # drop every other batch with its slices: slots come back
        kept[i] = slices[i] = slice_snaps[i] = None
    for i in range(1, 14, 4):  # and some batches but not their slices
        kept[i] = None
    gc.collect()
    for _ in range(40):  # many more batches, dropped at once: slots are reused
        next(it)
    for b, s in zip(kept, snaps):
        if b is not None:
            _equal(b, s)
    for (part, arr), (want_part, want_arr) in zip(*[[x for x in v if x is not None]
                                                    for v in (slices, slice_snaps)]):
        assert torch.equal(part, want_part) and np.array_equal(arr, want_arr)
    stats = pool.stats()
    assert stats["released"] > 0 and stats["pool_arrays"] > 0
    assert stats["no_free_slot"] > 0  # the kept batches held their slots
    del it


def test_slot_freed_only_when_last_view_dies(tmp_path):
    loader = _loader(tmp_path, num_workers=1, prefetch_factor=1)
    it = iter(loader)
    b = next(it)
    nxt = next(it)  # the loader's generator now holds this one, not b
    pool = loader.shm_pool
    view = b["data"][0, 0, :3]
    holder = b["rois"].numpy()
    gc.collect()
    held = pool.stats()["released"]
    del b
    gc.collect()
    assert pool.stats()["released"] == held  # a view and an array still hold the lease
    del view
    gc.collect()
    assert pool.stats()["released"] == held
    del holder
    gc.collect()
    assert pool.stats()["released"] == held + 1
    del it, nxt


# ---------------------------------------------------------------------- reuse
def test_steady_state_reuses_slots(tmp_path):
    loader = _loader(tmp_path, num_workers=2, prefetch_factor=2)
    it = iter(loader)
    for _ in range(60):
        b = next(it)
        del b
    stats = loader.shm_pool.stats()
    assert stats["blocks"] >= 60
    # every block got a slot, every array fitted (no new segment), and slots came back
    assert stats["no_free_slot"] <= 2 and stats["fallback_arrays"] == 0
    assert stats["released"] >= 55 and stats["pool_arrays"] >= 2 * 55
    assert stats["in_use"] <= stats["slots"]
    del it


def test_full_slot_falls_back_to_new_segments(tmp_path):
    loader = _loader(tmp_path, num_workers=1, shm_pool_slot_bytes=4096)
    ref = _loader(tmp_path, num_workers=0)
    it = iter(loader)
    got = [_snapshot(next(it)) for _ in range(4)]
    want = [_snapshot(b) for b, _ in zip(ref, range(4))]
    for g, w in zip(got, want):
        assert [k for k, _ in g] == [k for k, _ in w]
        for (k, a), (_, b) in zip(g, w):
            assert torch.equal(a, b), k
    stats = loader.shm_pool.stats()
    assert stats["fallback_arrays"] > 0
    del it


# ---------------------------------------------------------------------- identical outputs
@pytest.mark.parametrize("cfg,kw", [
    (CFG, {}),
    (CFG, {"mask_format": "compact"}),
    (CFG, {"output_format": "torchvision"}),
    (RPN_CFG, {"target_format": "detectron"}),
    (RPN_CFG, {"target_format": "compact"}),
])
def test_pool_on_and_off_give_identical_batches(tmp_path, cfg, kw):
    def run(pool: bool) -> list:
        loader = _loader(tmp_path, cfg=cfg, shm_pool=pool, **dict(kw))
        out = []
        for b, _ in zip(loader, range(6)):
            out.append((_snapshot(b), type(b).__name__, list(_meta(b))))
        return out

    on, off = run(True), run(False)
    for (a, ta, ma), (b, tb, mb) in zip(on, off, strict=True):
        assert ta == tb and ma == mb
        assert [k for k, _ in a] == [k for k, _ in b]
        for (k, x), (_, y) in zip(a, b):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), k


def test_torchvision_images_travel_through_the_pool(tmp_path):
    from torchvision import tv_tensors

    loader = _loader(tmp_path, output_format="torchvision")
    it = iter(loader)
    images, targets = next(it)
    assert all(type(im) is tv_tensors.Image for im in images)
    assert all(type(t["masks"]) is tv_tensors.Mask for t in targets)
    assert loader.shm_pool.stats()["pool_arrays"] > 0
    del it


# ---------------------------------------------------------------------- lifetime
def test_no_shm_files_left_and_killed_worker_leaves_no_stale_state(tmp_path):
    before = _shm_files()
    loader = _loader(tmp_path, num_workers=2)
    ref = [_snapshot(b) for b, _ in zip(_loader(tmp_path, num_workers=0), range(3))]
    torch_it = loader._start_workers()
    first = next(torch_it)
    os.kill(torch_it._workers[0].pid, signal.SIGKILL)
    with pytest.raises(RuntimeError):
        for _ in range(20):
            next(torch_it)
    del torch_it, first
    gc.collect()
    # a new iteration gets new workers and a new pool: nothing stale, same batches
    loader2 = _loader(tmp_path, num_workers=2)
    got = [_snapshot(b) for b, _ in zip(loader2, range(3))]
    for g, w in zip(got, ref):
        for (k, a), (_, b) in zip(g, w):
            assert torch.equal(a, b), k
    del loader, loader2
    gc.collect()
    assert _shm_files() - before == set()


@pytest.mark.parametrize("persistent", [False, True])
def test_new_workers_get_a_new_pool_running_ones_keep_theirs(tmp_path, persistent):
    """The next epoch continues the running stream: the same workers, the same pool. A
    restored position starts a new stream: new workers get a new pool (persistent
    workers are reused and keep theirs)."""
    loader = _loader(tmp_path, num_workers=1, persistent_workers=persistent)
    loader.batch_sampler.infinite = False
    list(zip(loader, range(2)))
    pool = loader.shm_pool
    list(zip(loader, range(2)))
    assert pool is not None and loader.shm_pool is pool
    loader.load_state_dict(loader.state_dict())
    list(zip(loader, range(2)))
    assert (loader.shm_pool is pool) == persistent


def test_spawned_workers_share_the_pool(tmp_path):
    loader = _loader(tmp_path, num_workers=1, multiprocessing_context="spawn")
    ref = _loader(tmp_path, num_workers=0)
    it = iter(loader)
    got = [_snapshot(next(it)) for _ in range(3)]
    want = [_snapshot(b) for b, _ in zip(ref, range(3))]
    for g, w in zip(got, want):
        for (k, a), (_, b) in zip(g, w):
            assert torch.equal(a, b), k
    assert loader.shm_pool.stats()["pool_arrays"] > 0
    del it


def test_pin_memory_loader_gives_identical_batches(tmp_path):
    # Without an accelerator PyTorch turns pinning off; with one the pin thread unpickles
    # and copies, which releases the slot when the original goes.
    loader = _loader(tmp_path, pin_memory=True)
    ref = _loader(tmp_path, num_workers=0)
    got = [_snapshot(b) for b, _ in zip(loader, range(4))]
    want = [_snapshot(b) for b, _ in zip(ref, range(4))]
    for g, w in zip(got, want):
        for (k, a), (_, b) in zip(g, w):
            assert torch.equal(a, b), k


def test_lease_released_from_another_thread():
    # What the pin-memory thread does: unpickle there, keep a copy, drop the original.
    pool = ShmPool(1, 2, 1 << 16)
    arena = shm_pool.ShmPool.acquire(pool, 0)
    t = pool._alloc(arena, (4, 5), torch.float32)
    t.copy_(torch.arange(20.0).reshape(4, 5))
    rebuild, args = shm_pool.pooled_reduce(dict, ({"x": t, "y": t[1:, 2]},), arena)[0:2]
    assert pool.flags[0, arena.slot] == 1
    out: dict = {}

    def consumer():
        batch = rebuild(*args)
        out["copy"] = {k: v.clone() for k, v in batch.items()}
        assert batch["y"].data_ptr() == batch["x"].data_ptr() + 4 * 7  # views in the slot

    th = threading.Thread(target=consumer)
    th.start()
    th.join()
    gc.collect()
    assert pool.stats()["released"] == 1 and pool.flags[0, arena.slot] == 0
    assert torch.equal(out["copy"]["x"], torch.arange(20.0).reshape(4, 5))
    assert torch.equal(out["copy"]["y"], torch.tensor([7.0, 12.0, 17.0]))


def test_reduce_without_slot_tensors_gives_the_slot_back():
    pool = ShmPool(1, 1, 1 << 12)
    arena = pool.acquire(0)
    payload = {"x": torch.ones(3).share_memory_(), "big": torch.ones(2000)}  # too big
    rebuild, args = shm_pool.pooled_reduce(dict, (payload,), arena)
    assert pool.flags[0, 0] == 0
    back = rebuild(*args)
    assert torch.equal(back["x"], torch.ones(3)) and torch.equal(back["big"], torch.ones(2000))
    assert pool.acquire(0) is not None and pool.acquire(0) is None  # one slot, taken


def test_pool_reuse_zeroes_what_an_earlier_block_wrote():
    pool = ShmPool(1, 1, 1 << 12)
    a = pool.acquire(0)
    pool._alloc(a, (100,), torch.int32).fill_(-1)
    pool.give_back(a)
    b = pool.acquire(0)
    assert b.slot == a.slot
    assert torch.count_nonzero(pool._alloc(b, (200,), torch.int32)) == 0



def test_private_tensors_are_copied_into_the_slot_with_their_metadata():
    from torchvision import tv_tensors

    pool = ShmPool(1, 1, 1 << 16)
    arena = pool.acquire(0)
    boxes = tv_tensors.BoundingBoxes(torch.arange(8.0).reshape(2, 4), format="XYXY",
                                     canvas_size=(30, 40))
    labels = torch.tensor([3, 1])
    payload = {"boxes": boxes, "labels": labels, "again": labels, "t": torch.arange(6)[::2]}
    rebuild, args = shm_pool.pooled_reduce(dict, (payload,), arena)
    boxes.zero_()  # the worker may reuse its own tensors: the batch has its copy
    back = rebuild(*args)
    assert type(back["boxes"]) is tv_tensors.BoundingBoxes
    assert back["boxes"].canvas_size == (30, 40) and back["boxes"].format.name == "XYXY"
    assert torch.equal(back["boxes"].as_subclass(torch.Tensor), torch.arange(8.0).reshape(2, 4))
    assert back["again"].data_ptr() == back["labels"].data_ptr()  # one copy, aliased
    assert torch.equal(back["t"], torch.tensor([0, 2, 4]))
    assert pool.stats()["pool_arrays"] == 3
    del back
    gc.collect()
    assert pool.reclaim() == 1 and pool.flags[0, 0] == 0


def test_freeing_a_batch_runs_no_python_code():
    """A lease dies without running Python code (no finaliser, no ``__del__``): a
    Ctrl-C that arrives while a batch is freed must reach the training loop, and
    KeyboardInterrupt raised inside a finaliser is swallowed ("Exception ignored")."""
    import sys

    pool = ShmPool(1, 2, 1 << 16)
    arena = pool.acquire(0)
    t = pool._alloc(arena, (4, 5), torch.float32)
    rebuild, args = shm_pool.pooled_reduce(dict, ({"x": t, "y": t[1:]},), arena)
    batch = rebuild(*args)
    view = batch["y"][0]
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        del batch, view
    finally:
        sys.setprofile(None)
    assert not calls, calls
    assert pool.flags[0, arena.slot] == 1  # freed lazily, by the next reclaim
    assert pool.reclaim() == 1 and pool.flags[0, arena.slot] == 0


# ---------------------------------------------------------------------- private torch API
def test_torch_still_has_untyped_storage_new_shared():
    """The one private torch call (``UntypedStorage._new_shared``). Failing here means a
    torch release dropped it: the package still works (public fallback, tested below) but
    every shared-memory page is now written once; find the new call or accept the cost."""
    assert callable(getattr(torch.UntypedStorage, "_new_shared", None)), (
        f"torch {torch.__version__} has no UntypedStorage._new_shared: "
        "lit_roidata.minibatch.shm_pool.new_shared_storage now takes its public path")


def _child_writes(t: torch.Tensor) -> None:
    t.fill_(7)


def _never(*args, **kwargs):
    raise AssertionError("the public path must not call UntypedStorage._new_shared")


@pytest.mark.parametrize("path", ["env", "missing", "private"])
def test_new_shared_storage_both_paths_are_zeroed_shared_segments(monkeypatch, path):
    """``LIT_ROIDATA_PUBLIC_SHM=1`` or a torch without the private call: the public path;
    either way a zero-filled storage in a segment another process writes into."""
    import multiprocessing as mp

    from lit_roidata.minibatch.transport import shared_empty

    monkeypatch.setenv(shm_pool.PUBLIC_SHM_ENV, "1" if path == "env" else "0")
    if path != "private":
        monkeypatch.setattr(torch.UntypedStorage, "_new_shared",
                            classmethod(_never) if path == "env" else None, raising=False)
    for nbytes in (1, 4097, 3 << 20):
        st = shm_pool.new_shared_storage(nbytes)
        t = torch.empty(0, dtype=torch.uint8).set_(st)
        assert st.is_shared() and st.nbytes() == nbytes and not t.any()
    t = shared_empty((5, 7), np.float32, pool=False)
    assert t.is_shared() and t.dtype == torch.float32 and not t.any()
    child = mp.get_context("fork").Process(target=_child_writes, args=(t,))
    child.start()
    child.join(30)
    assert child.exitcode == 0 and bool((t == 7).all())  # the child wrote our pages


def test_pool_on_the_public_shm_path_gives_identical_batches(tmp_path, monkeypatch):
    monkeypatch.setenv(shm_pool.PUBLIC_SHM_ENV, "1")
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", None, raising=False)
    ref = [_snapshot(b) for b, _ in zip(_loader(tmp_path, num_workers=0), range(4))]
    loader = _loader(tmp_path, shm_pool_slot_bytes=8 << 20)  # the public path writes it all
    it = iter(loader)
    got = [_snapshot(next(it)) for _ in range(4)]
    assert loader.shm_pool.stats()["pool_arrays"] > 0
    del it
    for a, b in zip(got, ref, strict=True):
        assert [k for k, _ in a] == [k for k, _ in b]
        for (k, x), (_, y) in zip(a, b):
            assert torch.equal(x, y), k
