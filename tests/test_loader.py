"""StatefulRoIDataLoader: its own account of the position (batches not stepped are left
out of the state), stops at clean boundaries, O(1) resume, and resume through Trainer."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.loader import StatefulRoIDataLoader
from lit_roidata.sampler import Block, RoIBatchSampler

W = np.array([640, 480, 640, 500, 480, 640, 640, 480, 333, 640, 480, 640, 640, 480, 640,
              480, 640, 640, 480, 640, 480, 640, 500])
H = np.array([480, 640, 480, 500, 640, 480, 427, 640, 500, 480, 640, 480, 480, 640, 480,
              640, 480, 480, 640, 480, 640, 427, 500])


class BlockDataset(torch.utils.data.Dataset):
    """Returns the block's indices and coordinates, like a minibatch with only ``_meta``."""

    def __init__(self) -> None:
        self.calls = 0

    def __len__(self) -> int:
        return len(W)

    def __getitems__(self, block: Block) -> dict:
        self.calls += 1
        assert isinstance(block, Block)
        return {"inds": torch.tensor(list(block)),
                "coords": torch.tensor([block.pass_index, block.block_index])}


def make_loader(num_workers=0, infinite=False, seed=3, mb=2, **kw) -> StatefulRoIDataLoader:
    sampler = RoIBatchSampler(W, H, mb, seed=seed, infinite=infinite)
    return StatefulRoIDataLoader(BlockDataset(), sampler, num_workers=num_workers, **kw)


def coords(batches) -> list[tuple[int, int]]:
    return [tuple(b["coords"].tolist()) for b in batches]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_counts_consumed_not_prefetched(num_workers):
    ref = make_loader(infinite=True)
    it = iter(ref)
    want = coords(next(it) for _ in range(30))

    a = make_loader(num_workers=num_workers, infinite=True)
    it = iter(a)
    got = coords(next(it) for _ in range(7))
    state = a.state_dict()
    # the sampler has run ahead for the workers; the saved state has not
    assert state["sampler"]["cursor"] == 7 % a.batch_sampler.blocks_per_pass
    del it
    b = make_loader(num_workers=num_workers, infinite=True)
    b.load_state_dict(state)
    it = iter(b)
    got += coords(next(it) for _ in range(23))
    assert got == want


def test_epoch_mode_iterates_passes_and_resumes_mid_epoch():
    a = make_loader()
    epochs = [coords(a) for _ in range(3)]
    assert [len(e) for e in epochs] == [len(a)] * 3
    assert [{p for p, _ in e} for e in epochs] == [{0}, {1}, {2}]
    b = make_loader()
    it = iter(b)
    first = coords(next(it) for _ in range(4))
    state = b.state_dict()
    c = make_loader()
    c.load_state_dict(state)
    assert first + coords(c) == epochs[0]  # an iteration is the rest of the pass
    assert coords(c) == epochs[1]


def test_resume_does_not_replay():
    a = make_loader(infinite=True)
    a.load_state_dict({"sampler": a.batch_sampler.state_at(10**9, 3)})
    first = next(iter(a))
    assert a.dataset.calls == 1
    assert tuple(first["coords"].tolist()) == (10**9, 3)


def test_mismatched_state_errors_unless_fresh_pass_requested():
    state = make_loader(mb=2).state_dict()
    with pytest.raises(ValueError, match="ims_per_batch"):
        make_loader(mb=3).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        make_loader(seed=4).load_state_dict(state)
    fresh = make_loader(mb=3, strict_resume=False)
    fresh.load_state_dict(state)
    assert fresh.state_dict()["sampler"]["pass"] == 1
    other = make_loader(seed=4)
    other.load_state_dict(state, strict=False)
    assert other.state_dict()["sampler"]["cursor"] == 0


def test_bad_inputs():
    s = RoIBatchSampler(W, H, 2)
    with pytest.raises(TypeError, match="RoIBatchSampler"):
        StatefulRoIDataLoader(BlockDataset(), [[0, 1]])

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield 0

    with pytest.raises(TypeError, match="map-style"):
        StatefulRoIDataLoader(Stream(), s)


def test_global_rng_untouched():
    torch.manual_seed(0)
    expect = torch.rand(3)
    torch.manual_seed(0)
    list(make_loader())
    assert torch.equal(torch.rand(3), expect)


# ---------------------------------------------------------------- through Trainer
class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[tuple[int, int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(tuple(batch["coords"].tolist()))
        return self.layer(batch["inds"].float()[:, None]).sum() * 0.0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(tmp_path, loader, ckpt_path=None, every=None, **trainer_kw):
    model = Recorder()
    callbacks = []
    if every:
        callbacks.append(pl.callbacks.ModelCheckpoint(
            dirpath=tmp_path, every_n_train_steps=every, save_top_k=-1,
            filename="{epoch}-{step}"))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks,
                         enable_checkpointing=bool(every), **trainer_kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
    bad = [str(w.message) for w in caught if "resum" in str(w.message).lower()]
    assert not bad, bad
    assert trainer.train_dataloader is loader  # not replaced, not wrapped
    return model.seen


@pytest.mark.parametrize("num_workers", [0, 2])
def test_trainer_mid_epoch_resume_epoch_mode(tmp_path, num_workers):
    per_epoch = len(make_loader())
    full = fit(tmp_path, make_loader(num_workers=num_workers), every=1, max_epochs=2)
    assert len(full) == 2 * per_epoch and [p for p, _ in full] == [0] * per_epoch + [1] * per_epoch
    for step in (3, per_epoch, per_epoch + 2):  # mid epoch 0, its last batch, mid epoch 1
        ckpt = next(tmp_path.glob(f"*-step={step}.ckpt"))
        loader = make_loader(num_workers=num_workers)
        rest = fit(tmp_path / "r", loader, ckpt_path=str(ckpt), max_epochs=2)
        assert rest == full[step:]
        if num_workers == 0:
            assert loader.dataset.calls == len(rest)  # nothing replayed


@pytest.mark.parametrize("num_workers", [0, 2])
def test_trainer_resume_infinite_stream_max_steps(tmp_path, num_workers):
    steps = 17
    full = fit(tmp_path, make_loader(num_workers=num_workers, infinite=True), every=5,
               max_steps=steps)
    assert full == coords(b for b, _ in zip(iter(make_loader(infinite=True)), range(steps)))
    ckpt = next(tmp_path.glob("*-step=15.ckpt"))
    rest = fit(tmp_path / "r", make_loader(num_workers=num_workers, infinite=True),
               ckpt_path=str(ckpt), max_steps=steps)
    assert rest == full[15:]


def _train(loader, n, accumulate, steps, interrupt=None):
    """What a training loop does: take ``n`` batches, step the optimizer after every
    ``accumulate``-th; ``interrupt(i, stepped)`` may return a state (then stop there)."""
    it = iter(loader)
    for i in range(n):
        batch = next(it)
        if interrupt is not None and (state := interrupt(i, False)) is not None:
            return batch, state
        if (i + 1) % accumulate == 0:
            steps[0] += 1
        if interrupt is not None and (state := interrupt(i, True)) is not None:
            return batch, state
    return None, None


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 30), accumulate=st.integers(1, 3), stepped=st.booleans(),
       infinite=st.booleans())
def test_state_leaves_out_the_batches_not_stepped(n, accumulate, stepped, infinite):
    """Interrupted after batch ``n`` (before or after its optimizer step, inside an
    accumulation window or not): the state resumes at the first batch no optimizer step
    covers, so that batch (or window) is trained again; nothing else repeats or is lost."""
    want = coords(b for b, _ in zip(iter(make_loader(infinite=True)), range(60)))
    steps = [0]
    loader = make_loader(infinite=True, optimizer_steps=lambda: steps[0])
    _, state = _train(loader, 60, accumulate, steps,
                      lambda i, s: loader.state_dict() if i == n - 1 and s == stepped else None)
    trained = steps[0] * accumulate  # batches covered by a finished optimizer step
    assert state["consumed_batches"] == trained
    again = make_loader(infinite=True)
    again.load_state_dict(state)
    it = iter(again)
    assert coords(next(it) for _ in range(10)) == want[trained:trained + 10]


@settings(max_examples=60, deadline=None)
@given(request=st.integers(0, 20), accumulate=st.integers(1, 3),
       refused=st.sets(st.integers(1, 30), max_size=6), infinite=st.booleans())
def test_stop_request_ends_at_the_first_clean_boundary(request, accumulate, refused, infinite):
    """``request_stop`` after batch ``request``: the iteration ends before the first batch
    ``b > request`` such that batches ``< b`` are all stepped, ``b`` is not an
    iterator's first fetch and ``ready()`` agrees; ``on_stop`` sees the position after
    the stepped batches; a loader restored from it continues the stream."""
    ref = make_loader(infinite=infinite)
    want = [c for _ in range(3) for c in coords(ref)] if not infinite else coords(
        b for b, _ in zip(iter(ref), range(60)))
    steps, seen, asked, stopped = [0], [], [], []
    loader = make_loader(infinite=infinite, optimizer_steps=lambda: steps[0])

    def ready() -> bool:
        asked.append(len(seen))
        return len(seen) not in refused

    def on_stop() -> None:
        stopped.append((len(seen), loader.state_dict()))

    first_fetch = set()
    while not stopped and len(seen) < len(want) - 5:
        first_fetch.add(len(seen))
        for batch in loader:  # one epoch: as Lightning, len(loader) batches, no more fetch
            seen.append(coords([batch])[0])
            if len(seen) % accumulate == 0:
                steps[0] += 1
            if len(seen) == request + 1:
                loader.request_stop(ready=ready, on_stop=on_stop)
            if len(seen) % len(loader) == 0:
                break
    assert seen == want[:len(seen)]
    if not stopped:
        return
    b, state = stopped[0]
    assert b == len(seen) and b > request and b % accumulate == 0 and b not in first_fetch
    assert b not in refused
    clean = [k for k in range(request + 1, b) if k % accumulate == 0 and k not in first_fetch]
    assert all(k in refused for k in clean)  # no earlier clean boundary was ready
    assert asked == clean + [b]
    assert state["consumed_batches"] == b
    again = make_loader(infinite=infinite)
    again.load_state_dict(state)
    assert coords([next(iter(again))]) == want[b:b + 1]
    assert not loader.stop_requested


def test_set_epoch_is_ignored():
    """The stream never follows Lightning's epoch number (set on the loader or, as
    Lightning does, on its batch sampler): an iteration continues where the last ended."""
    want = coords(make_loader())  # pass 0
    a = make_loader()
    a.set_epoch(5)
    a.batch_sampler.set_epoch(7)
    assert coords(a) == want
    b = make_loader()
    it = iter(b)
    head = coords(next(it) for _ in range(3))
    del it
    b.set_epoch(4)
    b.batch_sampler.set_epoch(4)
    assert head + coords(b) == want


def test_persistent_workers_reiteration_continues_stream():
    want = coords(b for b, _ in zip(iter(make_loader(infinite=True)), range(24)))
    a = make_loader(num_workers=2, infinite=True, persistent_workers=True)
    got = []
    for _ in range(3):  # Lightning abandons the iterator at each epoch end
        it = iter(a)
        got += coords(next(it) for _ in range(8))
    assert got == want


def _note_worker_start(folder, worker_id):
    import os

    (folder / f"{os.getpid()}-{worker_id}").touch()


@pytest.mark.parametrize("infinite", [False, True])
def test_the_stream_outlives_the_epoch(tmp_path, infinite):
    """Pass boundaries cost no wait: the workers that built the end of one epoch already
    build the next one's first blocks (one DataLoader iterator, no worker restart), and the
    batches are the stream's, epoch by epoch, in both modes."""
    import functools

    ref = make_loader(infinite=infinite)
    if infinite:
        it = iter(ref)
        want = [coords(next(it) for _ in range(len(ref))) for _ in range(3)]
    else:
        want = [coords(ref) for _ in range(3)]
    a = make_loader(num_workers=2, infinite=infinite,
                    worker_init_fn=functools.partial(_note_worker_start, tmp_path))
    got = []
    for _ in range(3):  # Lightning calls iter() at every epoch and stops after len()
        it = iter(a)
        got.append(coords(next(it) for _ in range(len(a))))
    assert got == want
    assert len(list(tmp_path.iterdir())) == 2  # the same two workers throughout
    a.load_state_dict(a.state_dict())  # a restored position starts a new stream
    next(iter(a))
    assert len(list(tmp_path.iterdir())) > 2  # (the second new worker may still start)


def test_loader_resume_with_other_world_size():
    def loaders(ws):
        return [StatefulRoIDataLoader(BlockDataset(), RoIBatchSampler(
            W, H, 2, seed=3, rank=r, world_size=ws, infinite=True)) for r in range(ws)]

    ref = make_loader(infinite=True)
    want = coords(b for b, _ in zip(iter(ref), range(40)))
    two = loaders(2)
    its = [iter(x) for x in two]
    got = [c for _ in range(7) for it in its for c in coords([next(it)])]
    state = two[0].state_dict()
    assert state == two[1].state_dict()
    three = loaders(3)
    for x in three:
        x.load_state_dict(state)
    its = [iter(x) for x in three]
    got += [c for _ in range(5) for it in its for c in coords([next(it)])]
    assert got == want[:len(got)]  # the global stream goes on: no repeat, no skip


def test_loaders_with_workers_stop_the_main_process_opencv_pool():
    # fork_safe_opencv runs where workers are set up: a worker forked while the parent's
    # OpenCV pool exists can hang on its first OpenCV call.
    import cv2

    before = cv2.getNumThreads()
    try:
        cv2.setNumThreads(4)
        make_loader(num_workers=0)
        assert cv2.getNumThreads() == 4  # no workers: left alone
        make_loader(num_workers=1)
        assert cv2.getNumThreads() == 1
    finally:
        cv2.setNumThreads(before)
