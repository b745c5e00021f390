"""The training stream runs one way: a pure plan, a dataset that only builds, a loader that
alone owns the position. Elastic resumes at the plan level (every image of a pass exactly
once across a world-size change), the loader's epoch length after such a resume, workers
that survive SIGTERM, and a killed worker named at the next fetch."""

from __future__ import annotations

import ast
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.loader import StatefulRoIDataLoader, WorkerDiedError
from lit_roidata.plan import Block, StreamPlan
from lit_roidata.sampler import RoIBatchSampler

PACKAGE = Path(__file__).resolve().parents[1] / "lit_roidata"


def _sizes(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    w, h = rng.integers(10, 30, n), rng.integers(10, 30, n)
    w[:4], h[:4] = 20, 10  # both orientations, whatever the draw
    w[4:8], h[4:8] = 10, 20
    return w, h


def _delivered(plan: StreamPlan, pass_index: int) -> Counter:
    """Every entry the stream delivers in a pass (all ranks), with multiplicity."""
    blocks = range(plan.delivered_blocks(pass_index))
    return Counter(i for b in blocks for i in plan.block(pass_index, b))


@settings(max_examples=80, deadline=None)
@given(n=st.integers(8, 60), mb=st.integers(1, 3), ws1=st.integers(1, 3),
       ws2=st.integers(1, 3), infinite=st.booleans(), grouping=st.booleans(),
       frac=st.floats(0, 1), repeat=st.booleans(), seed=st.integers(0, 99))
def test_every_image_once_per_pass_across_a_world_size_change(n, mb, ws1, ws2, infinite,
                                                              grouping, frac, repeat, seed):
    """Trained at ``ws1`` ranks to a point of pass 0, resumed at ``ws2``: the blocks of
    pass 0 the two runs deliver are every block of the pass once (epoch mode: but a tail of
    fewer than ``ws2`` blocks), whatever the grouping and repeat factors."""
    w, h = _sizes(n, seed)
    rf = 1 + np.random.default_rng(seed).integers(0, 3, n) * 0.5 if repeat else None
    kw = dict(aspect_grouping=grouping, seed=seed, infinite=infinite, repeat_factors=rf)
    try:
        first = [StreamPlan(w, h, mb, rank=r, world_size=ws1, **kw) for r in range(ws1)]
        second = [StreamPlan(w, h, mb, rank=r, world_size=ws2, **kw) for r in range(ws2)]
    except ValueError:
        return  # too few blocks for this many ranks (refused with a clear error)
    nb = first[0].pass_blocks(0)
    k = int(frac * (nb // ws1))  # global minibatches trained before the change
    pos = first[0].advance(0, 0, k)
    got: Counter = Counter()
    for b in range(k * ws1):  # what the first run trained
        got.update(first[0].block(0, b))
    for plan in second:  # what each rank of the second run trains in pass 0
        p, c = pos
        while True:
            blk, (p, c) = plan.next_block(p, c, stop_at_pass_end=not infinite)
            if blk is None or blk.pass_index > 0:
                break
            got.update(blk)
    whole = Counter(i for b in range(nb) for i in first[0].block(0, b))
    missing = whole - got
    assert not got - whole, "an image delivered more often than the pass holds it"
    left_out = 0 if infinite else (nb - k * ws1) % ws2
    assert sum(missing.values()) == left_out * mb


def test_plan_is_pure_and_blocks_carry_their_replacements():
    w, h = _sizes(40, 1)
    a = StreamPlan(w, h, 2, seed=5, holdback=3)
    b = StreamPlan(w, h, 2, seed=5, holdback=3)
    bad = frozenset(a.block(0, 1)[:1] + a.block(0, 4))
    for blk in range(a.pass_blocks(0)):
        x, y = a.final_block(a.block(0, blk), bad), b.final_block(b.block(0, blk), bad)
        assert list(x) == list(y) and x.substitutes == y.substitutes
        assert not set(x) & bad
        assert x.requested == list(a.block(0, blk))
    res = _delivered(a, 0)
    assert all(v == 1 for v in res.values())


def test_the_dataset_knows_nothing_of_sampler_position_or_skip_policy():
    """Nothing downstream of the plan imports upstream state: the dataset imports neither
    the sampler, the skip policy nor the loader; the plan imports no other stream module."""
    def imports(name: str) -> set[str]:
        tree = ast.parse((PACKAGE / name).read_text())
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                out.add(node.module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        return out
    assert not imports("dataset.py") & {"lit_roidata.sampler", "lit_roidata.skip",
                                        "lit_roidata.loader", "lit_roidata.datamodule"}
    assert not {m for m in imports("plan.py") if m.startswith("lit_roidata")}
    assert "lit_roidata.dataset" not in imports("skip.py")


class _Blocks(torch.utils.data.Dataset):
    def __init__(self, n: int, slow: float = 0.0) -> None:
        self.n, self.slow = n, slow

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, block: Block) -> dict:
        time.sleep(self.slow)
        return {"inds": torch.tensor(list(block)), "pass": block.pass_index,
                "block": block.block_index}


def _loader(world: int = 1, workers: int = 0, infinite: bool = False, slow: float = 0.0):
    w, h = _sizes(40, 2)
    sampler = RoIBatchSampler(w, h, 2, seed=3, world_size=world, infinite=infinite)
    return StatefulRoIDataLoader(_Blocks(40, slow), sampler, num_workers=workers,
                                 multiprocessing_context="fork" if workers else None)


def test_epoch_length_after_a_world_size_change_ends_with_the_pass():
    a = _loader(world=1)
    it = iter(a)
    for _ in range(5):
        next(it)
    state = a.state_dict()
    assert state["epoch_batches"] == 5
    b = _loader(world=2)
    b.load_state_dict(state)
    b.load_state_dict(state)  # Lightning loads it again: harmless
    rest = (b.batch_sampler.pass_blocks(0) - 5) // 2
    assert len(b) == 5 + rest  # Lightning's in-epoch count goes on from 5
    got = list(b)
    assert len(got) == rest and {x["pass"] for x in got} == {0}
    assert len(b) == b.batch_sampler.batches_in_pass(1)  # the next epoch: a whole pass
    assert b.state_dict()["epoch_batches"] == 0


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


def _workers(before: set[int], timeout: float = 10.0) -> list[psutil.Process]:
    """The loader's worker processes: the children started since ``before`` (a test
    session may have other children, e.g. a memcached server)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        kids = [p for p in psutil.Process().children() if p.pid not in before]
        if len(kids) >= 2:
            return kids
        time.sleep(0.05)
    raise AssertionError("no worker processes")


@pytest.mark.slow
def test_workers_ignore_sigterm_and_the_stream_goes_on():
    before = _children()
    loader = _loader(workers=2, infinite=True, slow=0.05)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    workers = _workers(before)
    for p in workers:  # sent by another process, as a scheduler's signal to the job is
        subprocess.run([sys.executable, "-c", f"import os; os.kill({p.pid}, {signal.SIGTERM})"],
                       check=True)
    more = [next(it) for _ in range(10)]
    assert [x["block"] for x in first + more] == list(range(13))
    # From the main process (multiprocessing's terminate(), e.g. at exit) it still ends
    # a worker: one that never stops by itself cannot hold the interpreter's exit.
    os.kill(workers[0].pid, signal.SIGTERM)
    assert workers[0].wait(timeout=10) == -signal.SIGTERM
    del it
    loader.close()


@pytest.mark.slow
def test_a_killed_worker_is_named_at_the_next_fetch_and_the_state_is_exact():
    before = _children()
    loader = _loader(workers=2, infinite=True, slow=0.05)
    it = iter(loader)
    for _ in range(4):
        next(it)
    workers = _workers(before)
    victim = workers[0]
    os.kill(victim.pid, signal.SIGKILL)
    t0 = time.time()
    while time.time() - t0 < 1.0:  # no asynchronous raise outside a fetch
        sum(range(1000))
    with pytest.raises(WorkerDiedError) as info:
        for _ in range(50):
            next(it)
    msg = str(info.value)
    assert f"pid {victim.pid}" in msg and "SIGKILL" in msg and "out-of-memory" in msg, msg
    assert time.time() - t0 < 15
    state = loader.state_dict()
    resumed = _loader(infinite=True)
    resumed.load_state_dict(state)
    nxt = next(iter(resumed))
    assert nxt["block"] == state["sampler"]["cursor"]  # nothing lost, nothing repeated
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
