"""StatefulRoIDataLoader: consumed-batch state, O(1) resume, and resume through Trainer."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import pytorch_lightning as pl
import torch

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
    c.set_epoch(0)
    assert first + coords(c) == epochs[0]
    c.set_epoch(1)
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


@pytest.mark.parametrize("infinite", [False, True])
def test_inflight_and_pass_end_hooks(infinite):
    ends: list[int] = []
    held = [0]
    a = make_loader(infinite=infinite, inflight=lambda: held[0],
                    on_pass_end=lambda: ends.append(len(seen)))
    seen = []
    it = iter(a)
    n = len(a) + 2 if infinite else len(a)
    for _ in range(n):
        seen.append(next(it))
    assert ends == [len(a) - 1]  # called as the pass's last batch is handed out
    held[0] = 1  # the last batch was handed out but training_step failed
    state = a.state_dict()
    b = make_loader(infinite=infinite)
    b.load_state_dict(state)
    b.set_epoch(0)
    assert coords([next(iter(b))]) == coords(seen[-1:])


def test_persistent_workers_reiteration_continues_stream():
    want = coords(b for b, _ in zip(iter(make_loader(infinite=True)), range(24)))
    a = make_loader(num_workers=2, infinite=True, persistent_workers=True)
    got = []
    for _ in range(3):  # Lightning abandons the iterator at each epoch end
        it = iter(a)
        got += coords(next(it) for _ in range(8))
    assert got == want


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
