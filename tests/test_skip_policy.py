"""The bad-image skip policy as a pure stream property (no image decoding).

Each simulated rank has its own sampler and ledger (as a DDP process has); a "worker"
reads the images of a block and stops at the first bad one, which the rank's main
process replaces (``BadImageLedger.substitute``), in stream order. At every pass end the
ranks exchange what they found, as ``BadImageReport.on_train_epoch_end`` does.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_roidata.sampler import RoIBatchSampler
from lit_roidata.skip import BadImageLedger, holdback_blocks


def _world(widths, heights, mb, ws, holdback, seed=7, infinite=False, grouping=True):
    samplers = [RoIBatchSampler(widths, heights, mb, seed=seed, rank=r, world_size=ws,
                                holdback=holdback, infinite=infinite, aspect_grouping=grouping)
                for r in range(ws)]
    return samplers, [BadImageLedger(s) for s in samplers]


def _deliver(sampler, ledger, block, bad, reads):
    """What a rank delivers for ``block``: known-bad replaced, new bad found and replaced."""
    blk, subs = ledger.apply_plan(block)
    while True:
        slot = next((k for k, i in enumerate(blk) if i in bad), None)
        for i in (blk if slot is None else blk[:slot + 1]):
            reads[i] += 1
        if slot is None:
            return blk, subs
        ledger.mark_bad(blk[slot], {"reason": "undecodable", "path": f"im{blk[slot]}.jpg"})
        blk, sub = ledger.substitute(blk, slot)
        subs.append(sub)


def _exchange(ledgers, samplers, next_pass):
    merged = {}
    for led in ledgers:
        merged.update(led.known)
    for led in ledgers:
        for k, v in merged.items():
            led.known.setdefault(k, v)
        led.freeze(next_pass)


def _run_pass(samplers, ledgers, p, bad, reads):
    ws = samplers[0].world_size
    out = []  # (rank, original block, delivered block, substitutes)
    for k in range(len(samplers[0])):
        for r in range(ws):
            orig = samplers[r].block(p, k * ws + r)
            blk, subs = _deliver(samplers[r], ledgers[r], orig, bad, reads)
            out.append((r, list(orig), list(blk), subs))
    _exchange(ledgers, samplers, p + 1)
    return out


def _check_pass(out, bad, is_horz, grouped):
    delivered = Counter(i for _, _, blk, _ in out for i in blk)
    assert not set(delivered) & bad, "a bad image was delivered"
    originals_good = Counter(i for _, orig, _, _ in out for i in orig if i not in bad)
    exhausted = sum(s["why"] == "reserve_exhausted" for _, _, _, subs in out for s in subs)
    for _, orig, blk, subs in out:
        assert len(blk) == len(orig)
        for o, d in zip(orig, blk):
            if o not in bad:
                assert o == d, "a good partner of a bad image was dropped"
        if grouped and not any(s["why"] == "reserve_exhausted" for s in subs):
            assert len({bool(is_horz[i]) for i in blk}) == 1, "a block mixes orientations"
    # every good image of the pass exactly once; substitutes each once and from outside
    # the pass, unless the reserve ran out (then each extra slot repeats one image)
    for i, n in originals_good.items():
        assert delivered[i] >= n == 1
    extra = {i: n for i, n in delivered.items() if i not in originals_good}
    repeats = sum(n - 1 for n in delivered.values() if n > 1)
    assert repeats <= exhausted  # (a repeat drawn later found bad is replaced again)
    if not exhausted:
        assert all(n == 1 for n in delivered.values())
        assert all(n == 1 for n in extra.values())
    return exhausted


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(6, 40), mb=st.integers(1, 3), ws=st.integers(1, 2),
       frac=st.sampled_from([0.1, 0.25, 0.5]), grouping=st.booleans(),
       data=st.data())
def test_skip_policy_exactly_once_partners_kept_never_twice(n, mb, ws, frac, grouping, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    widths = rng.integers(10, 30, n)
    heights = rng.integers(10, 30, n)
    horz = widths >= heights
    if grouping and min(horz.sum(), (~horz).sum()) < mb:
        widths[: 2 * mb], heights[: 2 * mb] = 20, 10
        widths[2 * mb: 4 * mb], heights[2 * mb: 4 * mb] = 10, 20
        horz = widths >= heights
    probe = RoIBatchSampler(widths, heights, mb, world_size=ws, aspect_grouping=grouping)
    hb = holdback_blocks(probe.blocks_per_pass, frac, ws, mb)
    if probe.blocks_per_pass - hb < ws or hb == 0:
        return
    bad = set(data.draw(st.sets(st.integers(0, n - 1), max_size=max(1, n // 4))))
    samplers, ledgers = _world(widths, heights, mb, ws, hb, grouping=grouping)
    reads: Counter = Counter()
    runs, exhausted = [], 0
    for p in range(3):
        runs.append(_run_pass(samplers, ledgers, p, bad, reads))
        exhausted += _check_pass(runs[-1], bad, horz, grouping)
    # a bad image is read at most once in the whole run (known on every rank afterwards),
    # unless the reserve ran out (a repeat may then be drawn before its badness is known)
    assert exhausted or all(reads[i] <= 1 for i in bad), {i: reads[i] for i in bad if reads[i] > 1}
    # determinism: the same run again gives the same blocks
    samplers2, ledgers2 = _world(widths, heights, mb, ws, hb, grouping=grouping)
    for p in range(3):
        assert _run_pass(samplers2, ledgers2, p, bad, Counter()) == runs[p]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(8, 30), mb=st.integers(1, 3), stop=st.integers(0, 20),
       seed=st.integers(0, 2**16))
def test_single_process_resume_mid_pass_is_exact(n, mb, stop, seed):
    """Checkpoint the ledger after ``stop`` blocks of pass 1, restore, continue: same."""
    rng = np.random.default_rng(seed)
    widths, heights = np.full(n, 20), np.full(n, 10)
    bad = set(rng.choice(n, size=max(1, n // 5), replace=False).tolist())
    probe = RoIBatchSampler(widths, heights, mb)
    hb = holdback_blocks(probe.blocks_per_pass, 0.3, 1, mb)
    samplers, ledgers = _world(widths, heights, mb, 1, hb)
    _run_pass(samplers, ledgers, 0, bad, Counter())
    ref_s, ref_l = _world(widths, heights, mb, 1, hb)
    ref_l[0].load_state_dict(ledgers[0].state_dict())
    ref = [list(_deliver(ref_s[0], ref_l[0], ref_s[0].block(1, b), bad, Counter())[0])
           for b in range(len(ref_s[0]))]
    stop = min(stop, len(ref))
    got = [list(_deliver(samplers[0], ledgers[0], samplers[0].block(1, b), bad, Counter())[0])
           for b in range(stop)]
    state = ledgers[0].state_dict()
    s2, l2 = _world(widths, heights, mb, 1, hb)
    l2[0].load_state_dict(state)
    got += [list(_deliver(s2[0], l2[0], s2[0].block(1, b), bad, Counter())[0])
            for b in range(stop, len(ref))]
    assert got == ref


def test_ims_per_batch_1_replacement_is_not_a_repeat():
    """Issue case: IMS_PER_BATCH=1, one process, every image in the pass."""
    n = 10
    samplers, ledgers = _world(np.full(n, 20), np.full(n, 10), 1, 1, holdback=2)
    bad = {int(samplers[0].block(0, 3)[0])}
    reads: Counter = Counter()
    out = _run_pass(samplers, ledgers, 0, bad, reads)
    got = [blk[0] for _, _, blk, _ in out]
    assert len(got) == len(set(got)) == 8 and not set(got) & bad
    out1 = _run_pass(samplers, ledgers, 1, bad, reads)
    assert reads[min(bad)] == 1  # known after the exchange: replaced before reading
    in_pass1 = min(bad) in {i for _, orig, _, _ in out1 for i in orig}
    assert [s["why"] for *_, subs in out1 for s in subs] == (["known_bad"] if in_pass1 else [])


def test_partner_kept_with_ims_per_batch_2():
    n = 12
    samplers, ledgers = _world(np.full(n, 20), np.full(n, 10), 2, 1, holdback=1)
    blk = samplers[0].block(0, 0)
    bad = {int(blk[1])}
    reads: Counter = Counter()
    out = _run_pass(samplers, ledgers, 0, bad, reads)
    assert out[0][2][0] == blk[0] and out[0][2][1] != blk[1]


def test_bad_replacement_is_itself_replaced_and_never_reused():
    n = 12
    samplers, ledgers = _world(np.full(n, 20), np.full(n, 10), 1, 1, holdback=3)
    res = samplers[0].reserve(0).tolist()
    first = int(samplers[0].block(0, 0)[0])
    bad = {first, res[0]}  # the first reserve image is bad too
    reads: Counter = Counter()
    out = _run_pass(samplers, ledgers, 0, bad, reads)
    assert out[0][2] == [res[1]] and reads[res[0]] == 1 and reads[first] == 1
    assert [s["bad_index"] for s in out[0][3]] == [first, res[0]]


def test_exhausted_reserve_is_counted():
    n = 8
    samplers, ledgers = _world(np.full(n, 20), np.full(n, 10), 1, 1, holdback=1)
    order = [int(samplers[0].block(0, b)[0]) for b in range(3)]
    bad = set(order)  # 3 bad images, a reserve of 1
    out = _run_pass(samplers, ledgers, 0, bad, Counter())
    assert _check_pass(out, bad, np.ones(n, bool), True) == 2


def test_state_roundtrip_and_frozen_snapshots():
    samplers, ledgers = _world(np.full(10, 20), np.full(10, 10), 1, 1, holdback=2)
    led = ledgers[0]
    led.mark_bad(3, {"reason": "missing"})
    led.freeze(2)
    assert led.frozen_for(1) == frozenset() and led.frozen_for(2) == {3}
    other = BadImageLedger(samplers[0])
    other.load_state_dict(led.state_dict())
    assert other.known == led.known and other.frozen == led.frozen
    with pytest.raises(ValueError, match="bad_image_reserve"):
        holdback_blocks(10, 1.5)
    assert holdback_blocks(100, 0.01) == 16 and holdback_blocks(100, 0) == 0
    assert holdback_blocks(100, 0.01, ims_per_batch=2) == 8
    assert holdback_blocks(10_000, 0.01, ims_per_batch=2) == 100
    assert holdback_blocks(20, 0.01) == 5 and holdback_blocks(3, 0.5, world_size=2) == 1
    assert holdback_blocks(2, 0.5, world_size=2) == 0


@pytest.mark.parametrize("grouping", [True, False])
def test_sampler_holdback_keeps_detectron_blocks_and_is_part_of_the_state(grouping):
    rng = np.random.default_rng(3)
    w, h = rng.integers(10, 30, 23), rng.integers(10, 30, 23)
    ref = RoIBatchSampler(w, h, 2, seed=5, aspect_grouping=grouping)
    held = RoIBatchSampler(w, h, 2, seed=5, aspect_grouping=grouping, holdback=3)
    assert held.blocks_per_pass == ref.blocks_per_pass - 3 == len(held)
    for p in range(2):
        assert [list(held.block(p, b)) for b in range(held.blocks_per_pass)] == \
            [list(ref.block(p, b)) for b in range(held.blocks_per_pass)]
    # the reserve: everything the pass does not deliver, each image once
    delivered = {i for b in range(held.blocks_per_pass) for i in held.block(0, b)}
    assert set(held.reserve(0).tolist()) == set(range(23)) - delivered
    state = held.state_dict()
    assert state["holdback"] == 3
    with pytest.raises(ValueError, match="holdback"):
        ref.load_state_dict(state)
    old = dict(ref.state_dict())
    old.pop("holdback")  # a checkpoint written before holdback existed
    ref.load_state_dict(old)
    with pytest.raises(ValueError, match="holdback"):
        RoIBatchSampler(w, h, 2, holdback=ref.blocks_per_pass)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(12, 40), mb=st.integers(1, 3), stop=st.integers(1, 12),
       seed=st.integers(0, 2**16))
def test_ddp_resume_from_rank0_state_repeats_no_replacement(n, mb, stop, seed):
    """Lightning saves rank 0's state only: rank 1 resumes without its use of its reserve
    share, so it takes that pass's share from the end (``resumed_at``): no image is
    delivered twice in the interrupted pass unless the reserve runs out."""
    rng = np.random.default_rng(seed)
    widths, heights = np.full(n, 20), np.full(n, 10)
    bad = set(rng.choice(n, size=max(2, n // 4), replace=False).tolist())
    probe = RoIBatchSampler(widths, heights, mb, world_size=2)
    hb = holdback_blocks(probe.blocks_per_pass, 0.5, 2, mb)
    if probe.blocks_per_pass - hb < 2 or hb == 0:
        return
    samplers, ledgers = _world(widths, heights, mb, 2, hb)
    steps = len(samplers[0])
    stop = min(stop, steps - 1)
    out = []
    before = ledgers
    for k in range(steps):
        if k == stop:  # interrupt: both ranks restart from rank 0's checkpointed state
            state = ledgers[0].state_dict()
            samplers, ledgers = _world(widths, heights, mb, 2, hb)
            for led in ledgers:
                led.load_state_dict(state)
                led.resumed_at(0, stop * 2)
        for r in range(2):
            orig = samplers[r].block(0, k * 2 + r)
            blk, subs = _deliver(samplers[r], ledgers[r], orig, bad, Counter())
            out.append((r, list(orig), list(blk), subs))
    share = len(samplers[1].known_bad_plan(0, ledgers[1].frozen_for(0))[1].get(True, [])[1::2])
    used_front, used_back = before[1].used.get((0, True), 0), ledgers[1].used.get((0, True), 0)
    delivered = Counter(i for _, _, blk, _ in out for i in blk)
    assert not set(delivered) & bad
    for _, orig, blk, _ in out:  # partners kept
        assert all(o == d for o, d in zip(orig, blk) if o not in bad)
    exhausted = sum(x["why"] == "reserve_exhausted" for *_, subs in out for x in subs)
    repeats = sum(c - 1 for c in delivered.values())
    if used_front + used_back <= share:  # the two ends of rank 1's share did not meet
        assert repeats <= exhausted


def test_merge_skip_reports_counts_each_file_once():
    from lit_roidata.skip import merge_skip_reports

    a = {"path": "/d/a.jpg", "reason": "decode_error"}
    parts = [{"counts": {"decode_error": 1, "known_bad": 2}, "files": [a]},
             {"counts": {"decode_error": 2}, "files": [dict(a), {"path": "/d/b.jpg",
                                                                  "reason": "decode_error"}]},
             {"counts": {"missing": 1}, "files": [{"path": None, "reason": "missing"}]}]
    counts, files = merge_skip_reports(parts)
    # a.jpg found by two ranks: once by its reason, once as read_again
    assert counts == {"decode_error": 2, "read_again": 1, "known_bad": 2, "missing": 1}
    assert list(files)[:2] == ["/d/a.jpg", "/d/b.jpg"] and len(files) == 3
    assert merge_skip_reports([]) == ({}, {})
