"""RoIBatchSampler against Detectron semantics: sampler and aspect grouping; multi-gpu and weights
and the invariants of Detectron semantics: tested invariants."""

from __future__ import annotations

import pickle
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lit_roidata.sampler import Block, RoIBatchSampler, draw_replacement

SETTINGS = settings(deadline=None, max_examples=40)


@st.composite
def sizes(draw, min_len: int = 1, max_len: int = 60):
    """Random per-image widths/heights with a random mix of orientations (squares too)."""
    n = draw(st.integers(min_len, max_len))
    kind = draw(st.lists(st.sampled_from(["h", "v", "s"]), min_size=n, max_size=n))
    w = np.array([{"h": 640, "v": 480, "s": 500}[k] for k in kind])
    h = np.array([{"h": 480, "v": 640, "s": 500}[k] for k in kind])
    return w, h


def _grouped_ok(w, h, mb):
    horz = int((w >= h).sum())
    return horz // mb + (len(w) - horz) // mb > 0


def _stream(sampler: RoIBatchSampler, n: int) -> list[Block]:
    return [sampler.draw() for _ in range(n)]


# ---------------------------------------------------------------- Detectron semantics: tested
# invariants
@SETTINGS
@given(sizes(), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_ungrouped_stream_is_perm_plus_wrapped_head(wh, mb, seed):
    w, h = wh
    if len(w) < mb:
        with pytest.raises(ValueError, match="fewer than"):
            RoIBatchSampler(w, h, mb, aspect_grouping=False, seed=seed)
        return
    s = RoIBatchSampler(w, h, mb, aspect_grouping=False, seed=seed, infinite=True)
    L = len(w)
    blocks = _stream(s, 2 * s.blocks_per_pass)
    flat = [i for b in blocks for i in b]
    expect = []
    for p in (0, 1):
        perm = s.permutation(p)
        assert sorted(perm.tolist()) == list(range(L))
        expect += perm.tolist() + perm[: (-L) % mb].tolist()
    assert flat == expect
    assert all(len(set(b)) == mb for b in blocks)  # no index twice within a block


# ---------------------------------------------------------------- Detectron semantics: tested
# invariants
@SETTINGS
@given(sizes(), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_grouped_pass_invariants(wh, mb, seed):
    w, h = wh
    if not _grouped_ok(w, h, mb):
        with pytest.raises(ValueError, match="horizontal"):
            RoIBatchSampler(w, h, mb, seed=seed)
        return
    s = RoIBatchSampler(w, h, mb, seed=seed)
    horizontal = w >= h
    for p in range(3):
        perm = s.permutation(p)
        assert len(perm) % mb == 0
        assert len(set(perm.tolist())) == len(perm)  # each index at most once per pass
        omitted = np.setdiff1d(np.arange(len(w)), perm)
        assert (horizontal[omitted]).sum() < mb and (~horizontal[omitted]).sum() < mb
        s.set_epoch(p)
        blocks = list(s)
        assert len(blocks) == len(s) == s.blocks_per_pass
        assert [i for b in blocks for i in b] == perm.tolist()
        for b in blocks:  # single orientation, never straddling two passes
            assert len(set(horizontal[b].tolist())) == 1 and b.pass_index == p


def test_grouped_hand_checked_example():
    # 4 horizontal (0, 2, 4, 5: square 5 counts as horizontal) and 3 vertical (1, 3, 6).
    w = np.array([10, 5, 10, 5, 10, 7, 3])
    h = np.array([5, 10, 5, 10, 5, 7, 4])
    s = RoIBatchSampler(w, h, 2, seed=11)
    assert s.blocks_per_pass == 3 and s.num_horizontal == 4
    blocks = list(s)
    horz = [b for b in blocks if set(b) <= {0, 2, 4, 5}]
    vert = [b for b in blocks if set(b) <= {1, 3, 6}]
    assert len(horz) == 2 and len(vert) == 1 and len(blocks) == 3
    assert sorted(i for b in horz for i in b) == [0, 2, 4, 5]  # no horizontal tail
    assert len(set(vert[0])) == 2  # one random vertical image left out


def test_permutation_is_pure_and_ignores_global_rng():
    w, h = np.arange(1, 50), np.arange(49, 0, -1)
    a = RoIBatchSampler(w, h, 2, seed=5)
    np.random.seed(0), torch.manual_seed(0)
    pa = [a.permutation(p).copy() for p in range(3)]
    np.random.seed(123), torch.manual_seed(99), np.random.rand(10)
    b = RoIBatchSampler(w, h, 2, seed=5)
    assert all(np.array_equal(x, b.permutation(p)) for p, x in enumerate(pa))
    assert not np.array_equal(pa[0], pa[1])
    assert not np.array_equal(pa[0], RoIBatchSampler(w, h, 2, seed=6).permutation(0))


# ---------------------------------------------------------------- Detectron semantics: tested
# invariants
@pytest.mark.parametrize("grouping", [True, False])
def test_concurrent_draws_are_atomic(grouping):
    w, h = np.random.default_rng(0).integers(100, 900, (2, 503))
    threads_n, per_thread = 8, 300
    shared = RoIBatchSampler(w, h, 3, aspect_grouping=grouping, seed=7)
    results: list[list[Block]] = [[] for _ in range(threads_n)]
    barrier = threading.Barrier(threads_n)

    def work(k: int) -> None:
        barrier.wait()
        for _ in range(per_thread):
            results[k].append(shared.draw())

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads_n)]
    [t.start() for t in ts], [t.join() for t in ts]
    got = Counter((b.pass_index, b.block_index, tuple(b)) for r in results for b in r)
    ref = RoIBatchSampler(w, h, 3, aspect_grouping=grouping, seed=7)
    want = Counter((b.pass_index, b.block_index, tuple(b))
                   for b in _stream(ref, threads_n * per_thread))
    assert got == want
    assert shared.state_dict() == ref.state_dict()


# ---------------------------------------------------------------- Detectron semantics: tested
# invariants
@SETTINGS
@given(sizes(min_len=4), st.integers(1, 4), st.booleans(), st.integers(0, 1000))
def test_invalid_blocks_are_replaced_deterministically(wh, mb, grouping, seed):
    w, h = wh
    if (grouping and not _grouped_ok(w, h, mb)) or len(w) < mb:
        return
    s = RoIBatchSampler(w, h, mb, aspect_grouping=grouping, seed=seed, infinite=True)
    clone = pickle.loads(pickle.dumps(s))  # what a worker process holds
    horizontal = w >= h

    def invalid(b: Block) -> bool:  # a stand-in for the keypoint rule
        return b.attempt < 2 and (b.block_index + b.attempt) % 3 == 0

    def build(sampler, b):
        attempt = 0
        while invalid(b):
            attempt += 1
            b = sampler.replacement_block(b, attempt)
        return b

    stream = _stream(s, 12)
    out = [build(s, b) for b in stream]
    assert out == [build(clone, b) for b in stream]  # pure: same in any process
    for b, o in zip(stream, out):
        assert (o.pass_index, o.block_index) == (b.pass_index, b.block_index)
        assert len(o) == mb == len(set(o))
        if grouping:
            assert len(set(horizontal[o].tolist())) == 1
            assert horizontal[o[0]] == horizontal[b[0]]
    # the substitutes did not shift the stream: the next block is the same either way
    assert s.draw() == _stream(RoIBatchSampler(w, h, mb, aspect_grouping=grouping, seed=seed,
                                               infinite=True), 13)[-1]


# ---------------------------------------------------------------- Detectron semantics: tested
# invariants
@SETTINGS
@given(sizes(min_len=2, max_len=80), st.integers(1, 4), st.integers(1, 4), st.booleans(),
       st.booleans(), st.integers(0, 1000))
def test_ddp_split(wh, mb, ws, grouping, infinite, seed):
    w, h = wh
    ref_kw = dict(aspect_grouping=grouping, seed=seed, infinite=True)
    try:
        ref = RoIBatchSampler(w, h, mb, **ref_kw)
    except ValueError:
        return
    kw = dict(aspect_grouping=grouping, seed=seed, infinite=infinite, world_size=ws)
    if not infinite and ref.blocks_per_pass < ws:
        with pytest.raises(ValueError, match="world_size"):
            RoIBatchSampler(w, h, mb, rank=0, **kw)
        return
    ranks = [RoIBatchSampler(w, h, mb, rank=r, **kw) for r in range(ws)]
    assert len({len(s) for s in ranks}) == 1
    if infinite:
        steps = 2 * len(ranks[0]) + 1
        per_rank = [_stream(s, steps) for s in ranks]
        stream = _stream(ref, steps * ws)
    else:
        per_rank = [list(s) for s in ranks]
        steps = len(ranks[0])
        stream = [ref.block(0, i) for i in range(steps * ws)]
    assert {len(x) for x in per_rank} == {steps}  # equal counts: no rank waits
    for r in range(ws):  # rank r gets stream blocks r, r + ws, ...
        assert per_rank[r] == stream[r::ws]
        assert [(b.pass_index, b.block_index) for b in per_rank[r]] == [
            (b.pass_index, b.block_index) for b in stream[r::ws]]
    coords = [(b.pass_index, b.block_index) for x in per_rank for b in x]
    assert len(set(coords)) == len(coords) == steps * ws  # disjoint, cover the prefix


# ---------------------------------------------------------------- Detectron semantics: tested
# invariants
@SETTINGS
@given(st.integers(1, 40), st.integers(1, 5))
def test_simple_loader_order(n, mb):
    if n < mb:
        return
    w, h = np.full(n, 3), np.full(n, 4)
    s = RoIBatchSampler(w, h, mb, shuffle=False, infinite=True)
    flat = [i for b in _stream(s, 3 * s.blocks_per_pass) for i in b]
    expect = []
    for _ in range(3):
        expect += list(range(n)) + list(range((-n) % mb))
    assert flat == expect


# ---------------------------------------------------------------- resume
@SETTINGS
@given(sizes(min_len=6), st.integers(1, 3), st.integers(1, 4), st.integers(1, 4),
       st.integers(0, 40), st.booleans())
def test_resume_with_other_world_size_continues_global_stream(wh, mb, ws1, ws2, steps,
                                                              grouping):
    w, h = wh
    kw = dict(aspect_grouping=grouping, seed=4, infinite=True)
    try:
        ref = RoIBatchSampler(w, h, mb, **kw)
    except ValueError:
        return
    first = [RoIBatchSampler(w, h, mb, rank=r, world_size=ws1, **kw) for r in range(ws1)]
    seen = [b for _ in range(steps) for s in first for b in [s.draw()]]
    state = first[0].state_dict()
    assert all(s.state_dict() == state for s in first)
    second = [RoIBatchSampler(w, h, mb, rank=r, world_size=ws2, **kw) for r in range(ws2)]
    for s in second:
        s.load_state_dict(state)
    seen += [b for _ in range(5) for s in second for b in [s.draw()]]
    assert seen == _stream(ref, len(seen))  # no block repeated or skipped


def test_epoch_mode_resume_and_set_epoch():
    w, h = np.arange(10, 40), np.arange(40, 10, -1)
    a = RoIBatchSampler(w, h, 2, seed=9, world_size=2, rank=1)
    full = [list(a) for _ in range(3)]  # each iteration is one pass
    assert [b.pass_index for b in full[2]] == [2] * len(a)
    b = RoIBatchSampler(w, h, 2, seed=9, world_size=2, rank=1)
    b.load_state_dict(b.state_at(1, 4))
    b.set_epoch(1)  # Lightning calls this after loading: the cursor must survive
    assert list(b) == full[1][2:]
    b.set_epoch(2)
    assert list(b) == full[2]


def test_advance_matches_drawing():
    w, h = np.arange(10, 37), np.arange(37, 10, -1)
    for infinite in (False, True):
        s = RoIBatchSampler(w, h, 2, world_size=3, infinite=infinite)
        pos = (0, 0)
        for n in range(1, 40):
            s.draw()
            pos = s.advance(*pos, 1)
            assert s.normalize(*s.advance(0, 0, n)) == s.normalize(*pos)
            st_ = s.state_dict()
            assert s.normalize(st_["pass"], st_["cursor"]) == s.normalize(*pos)
        assert s.advance(0, 0, 10**12)[0] > 10**10  # O(1) far ahead


def test_mismatched_state_is_rejected_unless_not_strict(caplog):
    w, h = np.arange(10, 30), np.arange(30, 10, -1)
    s = RoIBatchSampler(w, h, 2, seed=1)
    state = s.state_at(3, 4)
    for other in (RoIBatchSampler(w, h, 4, seed=1), RoIBatchSampler(w, h, 2, seed=2),
                  RoIBatchSampler(w[:-2], h[:-2], 2, seed=1)):
        with pytest.raises(ValueError, match="does not match"):
            other.load_state_dict(state)
        other.load_state_dict(state, strict=False)
        assert other.state_dict()["pass"] == 4 and other.state_dict()["cursor"] == 0
    with pytest.raises(ValueError, match="lacks"):
        s.load_state_dict({"pass": 1})


def test_bad_arguments():
    w, h = np.ones(8), np.ones(8)
    with pytest.raises(ValueError, match="rank=2"):
        RoIBatchSampler(w, h, 2, rank=2, world_size=2)
    with pytest.raises(ValueError, match="heights"):
        RoIBatchSampler(w, h[:3], 2)
    with pytest.raises(TypeError, match="ims_per_batch"):
        RoIBatchSampler(w, h, 2.0)
    with pytest.raises(ValueError, match="world_size=5"):
        RoIBatchSampler(w, h, 2, world_size=5)
    assert len(RoIBatchSampler(w, h, 2, world_size=5, infinite=True)) == 1


def test_block_pickles_with_coordinates():
    b = Block([3, 1], seed=2, pass_index=5, block_index=7, attempt=1)
    c = pickle.loads(pickle.dumps(b))
    assert type(c) is Block and c == [3, 1]
    assert (c.seed, c.pass_index, c.block_index, c.attempt) == (2, 5, 7, 1)


def test_block_derive_keeps_the_stream_coordinates():
    b = Block(np.array([3, 1]), seed=2, pass_index=5, block_index=7, attempt=1)
    assert type(b[0]) is int  # arrays become plain ints
    d = b.derive([4, 6])
    assert type(d) is Block and d == [4, 6] and b == [3, 1]
    assert (d.seed, d.pass_index, d.block_index, d.attempt) == (2, 5, 7, 1)
    assert b.derive([0], attempt=3).attempt == 3


_W = np.array([4., 2, 4, 4, 2, 4, 2, 4, 4, 2, 4, 4])
_H = np.array([2., 4, 2, 2, 4, 2, 4, 2, 2, 4, 2, 2])


@pytest.mark.parametrize("grouping", [True, False])
def test_replacement_block_is_draw_replacement_and_pinned(grouping):
    # Values pinned before the policy became one function (draw_replacement): a change of
    # the draw would change every resumed run that replaced a block.
    s = RoIBatchSampler(_W, _H, 2, aspect_grouping=grouping, seed=7)
    b = s.block(1, 3)
    assert list(b) == ([3, 7] if grouping else [9, 8])
    got = [s.replacement_block(b, a) for a in (1, 2)]
    assert [list(x) for x in got] == [[11, 7], [0, 3]]
    assert [(x.pass_index, x.block_index, x.attempt) for x in got] == [(1, 3, 1), (1, 3, 2)]
    pool = np.flatnonzero(_W >= _H) if grouping else len(_W)
    assert got == [draw_replacement(b, a, pool, 2) for a in (1, 2)]
    other = draw_replacement(b, 1, pool, 2, domain=1)  # the seed domain is a parameter
    assert other.attempt == 1
    with pytest.raises(ValueError, match="attempt"):
        draw_replacement(b, 0, pool, 2)


def test_too_few_images_for_a_block_is_an_error_q14():
    # Detectron quirk Q14 (docs/detectron_quirks.md): an empty permutation, IndexError later.
    w, h = np.array([4.0, 4.0, 2.0]), np.array([2.0, 2.0, 4.0])  # 2 horizontal, 1 vertical
    with pytest.raises(ValueError, match=r"aspect grouping.*Q14.*docs/detectron_quirks\.md"):
        RoIBatchSampler(w, h, 3)
    with pytest.raises(ValueError, match=r"fewer than.*Q14.*docs/detectron_quirks\.md"):
        RoIBatchSampler(w, h, 4, aspect_grouping=False)
