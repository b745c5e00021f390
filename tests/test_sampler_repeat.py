"""Repeat-factor sampling (Detectron2's RepeatFactorTrainingSampler) in RoIBatchSampler:
the factors against Detectron2's own function, the per-pass multiset against its
expectation, and the stream properties (grouping, DDP, resume, opt-in) with repeats."""

from __future__ import annotations

import math
import os
import pickle

import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from d2_support import import_d2_module
from lit_roidata.config import ConfigError, check_sampler_train, get_cfg, load_detectron_cfg
from lit_roidata.options import LoaderOptions, SamplingOptions, detectron_cfg
from lit_roidata.roidb.repeat_factors import (repeat_factors_for_roidb,
                                              repeat_factors_from_category_frequency)
from lit_roidata.sampler import RoIBatchSampler

SETTINGS = settings(deadline=None, max_examples=30)


# ---------------------------------------------------------------- generated datasets
@st.composite
def long_tailed(draw, max_images: int = 150):
    """Per-image category lists with Zipf-like frequencies (rare/common/frequent), images
    without annotations, duplicate categories within an image."""
    n = draw(st.integers(1, max_images))
    k = draw(st.integers(1, 60))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, k + 1) ** draw(st.floats(0.5, 2.5))
    p /= p.sum()
    per = rng.integers(0, draw(st.integers(1, 8)) + 1, n)
    off = np.r_[0, np.cumsum(per)].astype(np.int64)
    cls = (rng.choice(k, size=int(off[-1]), p=p) + 1).astype(np.int32)
    return off, cls


def _d2_dicts(off, cls, images=None):
    rows = range(off.size - 1) if images is None else images
    return [{"annotations": [{"category_id": int(c)} for c in cls[off[i]:off[i + 1]]]}
            for i in rows]


@pytest.fixture(scope="module")
def d2_rfs():
    return import_d2_module("data.samplers.distributed_sampler").RepeatFactorTrainingSampler


@SETTINGS
@given(long_tailed(), st.sampled_from([0.001, 0.01, 0.05, 0.3, 1.0, 3.0]), st.booleans())
def test_factors_equal_detectron2(d2_rfs, data, t, sqrt):
    off, cls = data
    want = d2_rfs.repeat_factors_from_category_frequency(_d2_dicts(off, cls), t, sqrt=sqrt)
    got = repeat_factors_from_category_frequency(off, cls, t, sqrt=sqrt)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want.numpy())  # bit for bit


@SETTINGS
@given(long_tailed(), st.data())
def test_factors_of_an_image_subset_equal_detectron2_on_that_subset(d2_rfs, data, pick):
    off, cls = data
    n = off.size - 1
    images = np.array(sorted(pick.draw(st.sets(st.integers(0, n - 1), min_size=1))))
    want = d2_rfs.repeat_factors_from_category_frequency(_d2_dicts(off, cls, images), 0.1)
    got = repeat_factors_from_category_frequency(off, cls, 0.1, images=images)
    np.testing.assert_array_equal(got, want.numpy())


def test_factors_hand_checked():
    # images: {1}, {1, 2, 2}, {}, {1, 3}: f(1) = 3/4, f(2) = f(3) = 1/4
    off = np.array([0, 1, 4, 4, 6])
    cls = np.array([1, 1, 2, 2, 1, 3])
    r = repeat_factors_from_category_frequency(off, cls, 0.5)
    np.testing.assert_array_equal(r, np.float32([1, math.sqrt(2), 1, math.sqrt(2)]))
    r = repeat_factors_from_category_frequency(off, cls, 0.5, sqrt=False)
    np.testing.assert_array_equal(r, np.float32([1, 2, 1, 2]))
    r = repeat_factors_from_category_frequency(off, cls, 0.5, images=[0, 1])  # f(2) = 1/2
    np.testing.assert_array_equal(r, np.float32([1, 1]))
    for bad in (0, -0.1, float("nan"), float("inf"), "x", True):
        with pytest.raises(ValueError, match="threshold"):
            repeat_factors_from_category_frequency(off, cls, bad)
    with pytest.raises(ValueError, match="once"):
        repeat_factors_from_category_frequency(off, cls, 0.5, images=[1, 1])


# ---------------------------------------------------------------- a real roidb
@pytest.fixture(scope="module")
def coco_roidb(tmp_path_factory):
    from lit_roidata.roidb.build import combined_roidb_for_training
    from roidb_fixtures import make_coco, write_dataset

    root = str(tmp_path_factory.mktemp("rfs"))
    cats = [{"id": i, "name": f"c{i}"} for i in range(1, 13)]
    data = make_coco(7, n_images=60, max_anns=4, categories=cats)
    rng = np.random.default_rng(3)  # make the tail long: most annotations in 2 categories
    for a in data["annotations"]:
        if rng.random() < 0.8:
            a["category_id"] = int(rng.integers(1, 3))
    cat = write_dataset(root, "rfs_train", data)
    return combined_roidb_for_training(["rfs_train"], (), get_cfg(), os.path.join(root, "cache"),
                                       catalog=cat, check_images=False, progress=False)


def test_roidb_factors_cached_and_flips_share_them(coco_roidb, d2_rfs):
    roidb = coco_roidb
    assert roidb.flipped.any()
    r = repeat_factors_for_roidb(roidb, 0.2)
    side = [f for f in os.listdir(roidb.path) if f.startswith("repeat_factors-")]
    assert len(side) == 1
    rows = np.asarray(roidb.entry_image_rows)
    for i in range(len(roidb)):  # a flipped entry has its original's factor
        assert r[i] == r[np.flatnonzero(rows == rows[i])].max()
    # Detectron2's function on dataset dicts of the roidb's images and kept annotations
    # (crowd rows included, as Detectron2's dicts include crowd annotations).
    orig = np.flatnonzero(~roidb.flipped)
    dicts = [{"annotations": [{"category_id": int(c)} for c in roidb[i]["gt_classes"]]}
             for i in orig]
    want = d2_rfs.repeat_factors_from_category_frequency(dicts, 0.2).numpy()
    np.testing.assert_array_equal(r[orig], want)
    assert (r > 1).any() and (r == 1).any()
    # read back from the side file (not recomputed), equal
    again = repeat_factors_for_roidb(roidb, 0.2)
    np.testing.assert_array_equal(again, r)
    os.utime(os.path.join(roidb.path, side[0]))
    assert repeat_factors_for_roidb(roidb, 0.3) is not None  # another key: a second file
    assert len([f for f in os.listdir(roidb.path) if f.startswith("repeat_factors-")]) == 2
    # a damaged side file is recomputed, not used
    with open(os.path.join(roidb.path, side[0]), "wb") as fh:
        fh.write(b"junk")
    np.testing.assert_array_equal(repeat_factors_for_roidb(roidb, 0.2), r)


# ---------------------------------------------------------------- the per-pass multiset
def _factors(n, seed):
    rng = np.random.default_rng(seed)
    r = np.where(rng.random(n) < 0.5, 1.0, 1.0 + rng.random(n) * 3)
    r[: min(n, 3)] = [1.0, 2.0, 2.5][: min(n, 3)]
    return r.astype(np.float32)


def _wh(n, seed):
    rng = np.random.default_rng(seed)
    horz = rng.random(n) < 0.6
    return np.where(horz, 640, 480), np.where(horz, 480, 640)


def _count_stat(counts_sum, passes, r):
    """Per-image z-scores of the total count over ``passes`` against its expectation
    ``passes * r`` (variance ``passes * q (1 - q)``, q = frac(r)); images with integral
    factors must be exact."""
    r = r.astype(np.float64)
    q = r - np.floor(r)
    var = passes * q * (1 - q)
    dev = counts_sum - passes * r
    exact = var == 0
    assert np.all(dev[exact] == 0)
    return dev[~exact] / np.sqrt(var[~exact])


def test_mean_count_is_the_factor_within_sampling_error():
    n, passes = 200, 400
    r = _factors(n, 1)
    w, h = _wh(n, 2)
    s = RoIBatchSampler(w, h, 2, aspect_grouping=False, seed=5, repeat_factors=r)
    total = np.zeros(n)
    for p in range(passes):
        counts = s.repeat_counts(p)
        perm = s.permutation(p)
        np.testing.assert_array_equal(np.bincount(perm, minlength=n), counts)  # the multiset
        total += counts
    z = _count_stat(total, passes, r)
    # Each image: |z| < 5.3 (two-sided 1.2e-7; Bonferroni over <= 200 images: a false
    # failure has probability < 3e-5). The whole vector: chi-square at 1e-6 both ways.
    assert np.abs(z).max() < 5.3
    chi2 = float((z ** 2).sum())
    lo, hi = scipy.stats.chi2.ppf([1e-6, 1 - 1e-6], z.size)
    assert lo < chi2 < hi
    # The same statistic rejects a rounding with a 3% bias in the fractional part.
    biased = total + passes * 0.03 * ((r - np.floor(r)) > 0)
    zb = _count_stat_unchecked(biased, passes, r)
    assert float((zb ** 2).sum()) > hi


def _count_stat_unchecked(counts_sum, passes, r):
    r = r.astype(np.float64)
    q = r - np.floor(r)
    m = q > 0
    return (counts_sum[m] - passes * r[m]) / np.sqrt(passes * q[m] * (1 - q[m]))


def test_pass_multiset_is_a_function_of_seed_and_pass():
    r = _factors(50, 3)
    w, h = _wh(50, 4)
    a = RoIBatchSampler(w, h, 2, seed=8, repeat_factors=r)
    b = RoIBatchSampler(w, h, 2, seed=8, repeat_factors=r)
    np.random.seed(0)
    for p in (5, 0, 3):
        np.testing.assert_array_equal(a.permutation(p), b.permutation(p))
    assert not np.array_equal(a.repeat_counts(0), a.repeat_counts(1))
    c = RoIBatchSampler(w, h, 2, seed=9, repeat_factors=r)
    assert not np.array_equal(a.repeat_counts(0), c.repeat_counts(0))
    d = pickle.loads(pickle.dumps(a))
    np.testing.assert_array_equal(d.permutation(7), a.permutation(7))


# ---------------------------------------------------------------- stream properties
@st.composite
def repeat_setup(draw):
    n = draw(st.integers(4, 60))
    seed = draw(st.integers(0, 10**6))
    w, h = _wh(n, seed)
    return w, h, _factors(n, seed + 1)


@SETTINGS
@given(repeat_setup(), st.integers(1, 4), st.integers(0, 1000))
def test_grouping_holds_with_repeats(wh, mb, seed):
    w, h, r = wh
    try:
        s = RoIBatchSampler(w, h, mb, seed=seed, repeat_factors=r, infinite=True)
    except ValueError:
        return
    horz = w >= h
    for p in range(3):
        counts = s.repeat_counts(p)
        perm = s.permutation(p)
        assert perm.size == s.natural_blocks(p) * mb
        got = np.bincount(perm, minlength=w.size)
        assert np.all(got <= counts)
        cut = counts - got  # each orientation loses fewer than mb copies (its tail)
        assert cut[horz].sum() < mb and cut[~horz].sum() < mb
        for b in range(s.pass_blocks(p)):
            blk = s.block(p, b)
            assert len({bool(horz[i]) for i in blk}) == 1


@SETTINGS
@given(repeat_setup(), st.integers(1, 3), st.integers(1, 3), st.booleans(), st.booleans(),
       st.integers(0, 1000))
def test_ddp_split_with_repeats(wh, mb, ws, grouping, infinite, seed):
    w, h, r = wh
    kw = dict(aspect_grouping=grouping, seed=seed, repeat_factors=r)
    try:
        ref = RoIBatchSampler(w, h, mb, infinite=True, **kw)
        ranks = [RoIBatchSampler(w, h, mb, rank=k, world_size=ws, infinite=infinite, **kw)
                 for k in range(ws)]
    except ValueError:
        return
    if infinite:
        steps = 3 * len(ranks[0]) + 1
        per_rank = [[s.draw() for _ in range(steps)] for s in ranks]
        stream = [ref.draw() for _ in range(steps * ws)]
        for k in range(ws):
            assert per_rank[k] == stream[k::ws]
    else:
        for p in range(3):  # each iteration is one pass, of that pass's length
            lens = {len(s) for s in ranks}
            assert lens == {ref.pass_blocks(p) // ws}
            per_rank = [list(s) for s in ranks]
            assert {len(x) for x in per_rank} == lens
            full = [ref.block(p, i) for i in range(len(per_rank[0]) * ws)]
            for k in range(ws):
                assert per_rank[k] == full[k::ws]
                assert all(b.pass_index == p for b in per_rank[k])


@SETTINGS
@given(repeat_setup(), st.integers(1, 3), st.sampled_from([(1, 2), (2, 1), (1, 1), (2, 2)]),
       st.integers(0, 60), st.booleans())
def test_resume_at_any_step_with_1_2_processes_continues_the_stream(wh, mb, wss, steps,
                                                                     grouping):
    w, h, r = wh
    ws1, ws2 = wss
    kw = dict(aspect_grouping=grouping, seed=4, infinite=True, repeat_factors=r)
    try:
        ref = RoIBatchSampler(w, h, mb, **kw)
    except ValueError:
        return
    first = [RoIBatchSampler(w, h, mb, rank=k, world_size=ws1, **kw) for k in range(ws1)]
    seen = [b for _ in range(steps) for s in first for b in [s.draw()]]
    state = first[0].state_dict()
    assert state["repeat_factors"] == ref.repeat_digest
    second = [RoIBatchSampler(w, h, mb, rank=k, world_size=ws2, **kw) for k in range(ws2)]
    for s in second:
        s.load_state_dict(pickle.loads(pickle.dumps(state)))
    seen += [b for _ in range(7) for s in second for b in [s.draw()]]
    assert seen == [ref.draw() for _ in range(len(seen))]


@SETTINGS
@given(repeat_setup(), st.integers(1, 3), st.sampled_from([(1, 2), (2, 1), (2, 2)]),
       st.integers(0, 40))
def test_epoch_mode_resume_with_other_world_size(wh, mb, wss, steps):
    """Epoch mode: a pass's global blocks are delivered in order across the resume; only
    the pass-end remainder (< world_size blocks) of each pass is left out."""
    w, h, r = wh
    ws1, ws2 = wss
    kw = dict(seed=11, repeat_factors=r)
    try:
        ref = RoIBatchSampler(w, h, mb, **kw)
        first = [RoIBatchSampler(w, h, mb, rank=k, world_size=ws1, **kw) for k in range(ws1)]
        second = [RoIBatchSampler(w, h, mb, rank=k, world_size=ws2, **kw) for k in range(ws2)]
    except ValueError:
        return
    pos = (0, 0)
    seen = []
    for _ in range(steps):
        pos = first[0].normalize(*pos)
        seen += [s.draw() for s in first]
        pos = first[0].advance(*pos, 1)
    state = first[0].state_at(*pos)
    for s in second:
        s.load_state_dict(state)
    assert len(second[0]) == second[0].batches_in_pass(second[0].normalize(*pos)[0])
    for _ in range(2 * len(second[0]) + 1):
        seen += [s.draw() for s in second]
    by_pass: dict[int, list[int]] = {}
    for b in seen:
        by_pass.setdefault(b.pass_index, []).append(b.block_index)
        assert list(b) == list(ref.block(b.pass_index, b.block_index))
    for p, blocks in by_pass.items():
        assert blocks == list(range(len(blocks)))  # in order, none skipped or repeated
        assert ref.pass_blocks(p) - len(blocks) < max(ws1, ws2) or p == max(by_pass)


def test_advance_and_len_follow_pass_lengths():
    n = 37
    w, h = _wh(n, 5)
    r = _factors(n, 6)
    for infinite in (False, True):
        s = RoIBatchSampler(w, h, 2, world_size=3, infinite=infinite, repeat_factors=r)
        assert len({s.pass_blocks(p) for p in range(20)}) > 1  # lengths vary
        pos = (0, 0)
        for k in range(1, 120):
            blk = s.draw()
            assert s.normalize(*pos) == (blk.pass_index, blk.block_index - s.rank) or infinite
            pos = s.advance(*pos, 1)
            assert s.normalize(*s.advance(0, 0, k)) == s.normalize(*pos)
            st_ = s.state_dict()
            assert s.normalize(st_["pass"], st_["cursor"]) == s.normalize(*pos)
        if not infinite:
            t = RoIBatchSampler(w, h, 2, world_size=3, repeat_factors=r)
            for p in range(5):
                assert len(t) == t.pass_blocks(p) // 3 == len(list(t))


def test_all_ones_factors_give_todays_stream_and_none_is_opt_in():
    w, h = _wh(41, 7)
    for grouping in (True, False):
        base = RoIBatchSampler(w, h, 2, aspect_grouping=grouping, seed=3, infinite=True)
        ones = RoIBatchSampler(w, h, 2, aspect_grouping=grouping, seed=3, infinite=True,
                               repeat_factors=np.ones(41))
        assert [base.draw() for _ in range(100)] == [ones.draw() for _ in range(100)]
        assert "repeat_factors" not in base.state_dict()
        with pytest.raises(ValueError, match="repeat_factors"):
            base.load_state_dict(ones.state_dict())  # other stream identity: refused
        with pytest.raises(ValueError, match="repeat_factors"):
            ones.load_state_dict(base.state_dict())


def test_bad_repeat_factors():
    w, h = _wh(10, 1)
    with pytest.raises(ValueError, match="10"):
        RoIBatchSampler(w, h, 2, repeat_factors=np.ones(9))
    with pytest.raises(ValueError, match=">= 1"):
        RoIBatchSampler(w, h, 2, repeat_factors=np.r_[np.ones(9), 0.5])
    with pytest.raises(ValueError, match=">= 1"):
        RoIBatchSampler(w, h, 2, repeat_factors=np.r_[np.ones(9), np.nan])


def test_skip_reserve_with_repeats():
    w, h = _wh(80, 9)
    r = _factors(80, 10)
    s = RoIBatchSampler(w, h, 2, seed=2, holdback=3, world_size=2, repeat_factors=r)
    for p in range(4):
        nd = s.delivered_blocks(p)
        assert nd == s.pass_blocks(p) // 2 * 2 == 2 * len(list(s))
        delivered = s.permutation(p)[: nd * 2]
        res = s.reserve(p)
        assert not np.isin(res, delivered).any()
        assert np.isin(s.permutation(p)[nd * 2:], np.r_[res, delivered]).all()


# ---------------------------------------------------------------- configuration
def test_config_keys_both_ways():
    cfg = load_detectron_cfg({"DATALOADER": {"SAMPLER_TRAIN": "RepeatFactorTrainingSampler",
                                             "REPEAT_THRESHOLD": 0.001}})
    assert check_sampler_train(cfg)
    assert not check_sampler_train(get_cfg())
    via_option = detectron_cfg(None, None, None, LoaderOptions(),
                               SamplingOptions(repeat_factor_threshold=0.001))
    assert via_option.DATALOADER.SAMPLER_TRAIN == "RepeatFactorTrainingSampler"
    assert via_option.DATALOADER.REPEAT_THRESHOLD == 0.001
    same = detectron_cfg(None, None, {"DATALOADER.REPEAT_THRESHOLD": 0.001}, LoaderOptions(),
                         SamplingOptions(repeat_factor_threshold=0.001))
    assert same.DATALOADER.REPEAT_THRESHOLD == 0.001
    with pytest.raises(ValueError, match="repeat_factor_threshold"):
        detectron_cfg(None, None, {"DATALOADER.REPEAT_THRESHOLD": 0.01}, LoaderOptions(),
                      SamplingOptions(repeat_factor_threshold=0.001))
    cfg = load_detectron_cfg({"DATALOADER.REPEAT_THRESHOLD": 1})  # an int is a float here
    assert cfg.DATALOADER.REPEAT_THRESHOLD == 1.0


def test_config_errors_are_named():
    with pytest.raises(ConfigError, match="SAMPLER_TRAIN.*RepeatFactorTrainingSampler"):
        load_detectron_cfg({"DATALOADER.SAMPLER_TRAIN": "RepeatFactorSampler"})
    with pytest.raises(ConfigError, match="not a training sampler"):
        load_detectron_cfg({"DATALOADER.SAMPLER_TRAIN": "WeightedTrainingSampler"})
    with pytest.raises(ConfigError, match="REPEAT_THRESHOLD"):  # D2's default 0.0
        load_detectron_cfg({"DATALOADER.SAMPLER_TRAIN": "RepeatFactorTrainingSampler"})
    with pytest.raises(ConfigError, match="REPEAT_THRESHOLD"):
        load_detectron_cfg({"DATALOADER.SAMPLER_TRAIN": "RepeatFactorTrainingSampler",
                            "DATALOADER.REPEAT_THRESHOLD": -1.0})
    for bad in (0, 0.0, -0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="repeat_factor_threshold"):
            SamplingOptions(repeat_factor_threshold=bad)
    with pytest.raises(ConfigError, match="unknown config key"):
        load_detectron_cfg({"DATALOADER.NUM_WORKERS": 4})  # other D2 keys stay unknown


def test_build_train_sampler_reads_the_config(coco_roidb):
    from lit_roidata.loader import build_train_sampler

    cfg = load_detectron_cfg({"DATALOADER.SAMPLER_TRAIN": "RepeatFactorTrainingSampler",
                              "DATALOADER.REPEAT_THRESHOLD": 0.2, "TRAIN.IMS_PER_BATCH": 1})
    s = build_train_sampler(cfg, coco_roidb, infinite=True)
    np.testing.assert_array_equal(s.repeat_factors, repeat_factors_for_roidb(coco_roidb, 0.2))
    plain = build_train_sampler(load_detectron_cfg({"TRAIN.IMS_PER_BATCH": 1}), coco_roidb)
    assert plain.repeat_digest is None
    s = build_train_sampler(cfg, coco_roidb, bad_image_reserve=0.1, world_size=2)
    assert s.holdback > 0 and s.pass_blocks(0) >= 2


# ---------------------------------------------------------------- the stateful loader
@pytest.mark.parametrize("infinite", [False, True])
def test_loader_epochs_follow_pass_lengths_and_resume_exactly(infinite):
    import torch

    from lit_roidata.loader import StatefulRoIDataLoader

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return 45

        def __getitems__(self, block):
            return (block.pass_index, block.block_index, tuple(block))

    w, h = _wh(45, 12)
    r = _factors(45, 13)

    def loader():
        s = RoIBatchSampler(w, h, 2, seed=6, infinite=infinite, repeat_factors=r)
        return StatefulRoIDataLoader(Blocks(), s)

    a = loader()
    ref = []
    for p in range(4):
        n = len(a)
        if infinite:
            it = iter(a)
            got = [next(it) for _ in range(n)]
        else:
            got = list(a)
            assert len(got) == n == a.batch_sampler.pass_blocks(p)  # one pass per epoch
            assert {g[0] for g in got} == {p}
        ref += got
    def take(ld, k):
        out = []
        while len(out) < k:
            for x in ld:
                out.append(x)
                if len(out) == k:
                    break
        return out

    for stop in (0, 1, 7, len(ref) // 2, len(ref) - 3):
        b = loader()
        head = take(b, stop)
        c = loader()
        c.load_state_dict(b.state_dict())
        assert head + take(c, len(ref) - stop) == ref


# ---------------------------------------------------------------- Lightning's epochs
def test_lightning_epochs_are_passes_with_reloaded_loaders():
    """With repeat factors each pass has its own length; with a loader per epoch
    (``reload_dataloaders_every_n_epochs=1``) every Lightning epoch is exactly one pass
    and ends with its validation."""
    import pytorch_lightning as pl
    import torch

    from lit_roidata.loader import StatefulRoIDataLoader

    w, h = _wh(45, 1)
    r = _factors(45, 2)

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return 45

        def __getitems__(self, block):
            return torch.tensor([block.pass_index, block.block_index])

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)
            self.seen, self.vals = [], []

        def training_step(self, batch, i):
            self.seen.append((self.current_epoch, int(batch[0]), int(batch[1])))
            return self.lin(torch.ones(1, 1)).sum()

        def validation_step(self, batch, i):
            pass

        def on_validation_epoch_end(self):
            self.vals.append(self.current_epoch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), 0.1)

    class Data(pl.LightningDataModule):
        prev = None

        def train_dataloader(self):
            ld = StatefulRoIDataLoader(Blocks(), RoIBatchSampler(w, h, 2, seed=6,
                                                                 repeat_factors=r))
            if self.prev is not None:
                ld.load_state_dict(self.prev.state_dict())
            self.prev = ld
            return ld

        def val_dataloader(self):
            return torch.utils.data.DataLoader([torch.zeros(1)])

    model = Model()
    trainer = pl.Trainer(max_epochs=5, reload_dataloaders_every_n_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         accelerator="cpu")
    trainer.fit(model, datamodule=Data())
    ref = RoIBatchSampler(w, h, 2, seed=6, repeat_factors=r)
    lengths = [ref.pass_blocks(p) for p in range(5)]
    assert len(set(lengths)) > 1
    for e in range(5):
        got = [(p, b) for ee, p, b in model.seen if ee == e]
        assert got == [(e, b) for b in range(lengths[e])]
    assert model.vals == list(range(5))


def test_datamodule_refuses_epochs_without_reloading():
    from types import SimpleNamespace

    from lit_roidata.loader_callbacks import check_trainer_for_loader

    def check(trainer, sampler):
        check_trainer_for_loader(trainer, sampler, skip=False)

    w, h = _wh(20, 1)
    s = RoIBatchSampler(w, h, 2, repeat_factors=_factors(20, 2))
    with pytest.raises(ValueError, match="reload_dataloaders_every_n_epochs=1"):
        check(SimpleNamespace(reload_dataloaders_every_n_epochs=0), s)
    check(SimpleNamespace(reload_dataloaders_every_n_epochs=1), s)
    check(None, s)
    inf = RoIBatchSampler(w, h, 2, infinite=True, repeat_factors=_factors(20, 2))
    check(SimpleNamespace(reload_dataloaders_every_n_epochs=0), inf)
    plain = RoIBatchSampler(w, h, 2)
    check(SimpleNamespace(reload_dataloaders_every_n_epochs=0), plain)
