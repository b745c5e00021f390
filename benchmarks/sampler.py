"""Sampler cost per batch, and resume time at a late step (design.md "What done means").

Baselines measured in the same run:

* Detectron's ``RoIDataLoader`` cursor (Detectron semantics: sampler and aspect grouping), written
out below: a ``deque``
  permutation rotated under a ``threading.Lock``, reshuffled (grouping included) when the
  cursor passes the end;
* resume by replay (what mmengine does on resume): draw and drop every earlier batch.

Usage: ``python benchmarks/sampler.py [--quick]``.

``--repeat-factors [--d2-src /path/to/detectron2]`` measures repeat-factor sampling
instead (:func:`repeat_factor_rows`), against Detectron2's ``RepeatFactorTrainingSampler``
imported from a source checkout (only ``detectron2/data/samplers/distributed_sampler.py``
and ``detectron2/utils/comm.py`` are executed; nothing is installed or copied):

* computing the factors of a long-tailed dataset of 1.7M images (1,203 Zipf-distributed
  categories): ours over the roidb columns vs Detectron2's
  ``repeat_factors_from_category_frequency`` over its dataset dicts (building the dicts
  is not timed); and reading them back from the cache side file;
* one pass's draw: our multiset + grouped permutation (``repeat_counts`` +
  ``permutation``) vs Detectron2's per-epoch work (``_get_epoch_indices`` + ``randperm``);
* per batch and resume with repeats.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import deque

import numpy as np

from lit_roidata.sampler import RoIBatchSampler


class DetectronCursor:
    """Detectron's ``_shuffle_roidb_inds`` + ``_get_next_minibatch_inds`` (Detectron semantics:
    sampler and aspect grouping)."""

    def __init__(self, widths: np.ndarray, heights: np.ndarray, mb: int, seed: int) -> None:
        self._w, self._h, self._mb = widths, heights, mb
        self._rng = np.random.RandomState(seed)
        self._lock = threading.Lock()
        self._shuffle()

    def _shuffle(self) -> None:
        horz = self._w >= self._h
        vert = np.logical_not(horz)
        horz_inds = np.where(horz)[0]
        vert_inds = np.where(vert)[0]
        horz_inds = self._rng.permutation(horz_inds)
        vert_inds = self._rng.permutation(vert_inds)
        mb = self._mb
        horz_inds = horz_inds[: (len(horz_inds) // mb) * mb]
        vert_inds = vert_inds[: (len(vert_inds) // mb) * mb]
        inds = np.hstack((horz_inds, vert_inds))
        inds = np.reshape(inds, (-1, mb))
        row_perm = self._rng.permutation(np.arange(inds.shape[0]))
        inds = np.reshape(inds[row_perm, :], (-1,))
        self._perm = deque(inds)
        self._cur = 0

    def next_inds(self) -> list:
        with self._lock:
            db_inds = [self._perm[i] for i in range(self._mb)]
            self._perm.rotate(-self._mb)
            self._cur += self._mb
            if self._cur >= len(self._perm):
                self._shuffle()
        return db_inds


def per_batch(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def resume_time(sampler: RoIBatchSampler, step: int, repeats: int) -> float:
    """Seconds to restore the position after ``step`` global minibatches and draw one."""
    times = []
    for r in range(repeats):
        sampler._memo.clear()  # a fresh process has no cached permutation
        t0 = time.perf_counter()
        sampler.load_state_dict(sampler.state_at(*sampler.advance(0, 0, step + r)))
        sampler.draw()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _long_tailed(n_images: int, anns_per_image: float, n_cats: int, seed: int):
    """``(img_gt_off, gt_classes)`` of a Zipf-tailed dataset (LVIS has 1,203 categories)."""
    rng = np.random.default_rng(seed)
    per = rng.poisson(anns_per_image, n_images)
    off = np.r_[0, np.cumsum(per)].astype(np.int64)
    p = 1.0 / np.arange(1, n_cats + 1) ** 1.1
    p /= p.sum()
    cls = (rng.choice(n_cats, size=int(off[-1]), p=p) + 1).astype(np.int32)
    return off, cls


def _import_d2_sampler(src: str):
    import importlib
    import os
    import sys
    import types

    for pkg, sub in (("detectron2", ""), ("detectron2.data", "data"),
                     ("detectron2.data.samplers", "data/samplers")):
        if pkg not in sys.modules:
            mod = types.ModuleType(pkg)
            mod.__path__ = [os.path.join(src, "detectron2", sub).rstrip("/")]
            sys.modules[pkg] = mod
    return importlib.import_module("detectron2.data.samplers.distributed_sampler")


def _best(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), times


def _spread(times: list[float], unit: float = 1.0) -> str:
    return "[" + ", ".join(f"{t * unit:.3g}" for t in times) + "]"


def repeat_factor_rows(args) -> None:
    """Repeat-factor rows: factor computation and per-pass draw vs Detectron2 (module doc)."""
    import logging
    import os
    import tempfile

    import torch

    from lit_roidata.roidb.repeat_factors import repeat_factors_from_category_frequency

    logging.getLogger("detectron2").setLevel(logging.WARNING)
    n = 100_000 if args.quick else args.images
    reps = 2 if args.quick else 3
    off, cls = _long_tailed(n, args.anns_per_image, 1203, seed=0)
    print(f"repeat factors: {n:,} images, {cls.size:,} annotations, 1203 categories, "
          f"t=0.001; best of {reps} (all runs listed)")
    ours_t, ours_all = _best(lambda: repeat_factors_from_category_frequency(off, cls, 0.001),
                             reps)
    r = repeat_factors_from_category_frequency(off, cls, 0.001)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "repeat_factors-x.npy")
        np.save(path, r, allow_pickle=False)
        load_t, load_all = _best(lambda: np.load(path), reps)
    print(f"  factors, ours (columns):       {ours_t:8.3f} s  {_spread(ours_all)}")
    print(f"  factors, ours (cached file):   {load_t * 1e3:8.2f} ms {_spread(load_all, 1e3)}")
    d2 = None
    if args.d2_src:
        d2 = _import_d2_sampler(args.d2_src).RepeatFactorTrainingSampler
        dicts = [{"annotations": [{"category_id": int(c)} for c in cls[off[i]:off[i + 1]]]}
                 for i in range(n)]
        d2_t, d2_all = _best(lambda: d2.repeat_factors_from_category_frequency(dicts, 0.001),
                             reps)
        same = bool((d2.repeat_factors_from_category_frequency(dicts, 0.001).numpy() == r).all())
        del dicts
        print(f"  factors, Detectron2 (dicts):   {d2_t:8.3f} s  {_spread(d2_all)}   "
              f"(ratio Detectron2/ours {d2_t / ours_t:.1f}x; equal: {same})")
    else:
        print("  factors, Detectron2: skipped (no --d2-src)")

    rng = np.random.default_rng(1)
    w = np.where(rng.random(n) < 0.7, 640, 480)
    h = np.where(w == 640, 480, 640)
    s = RoIBatchSampler(w, h, 2, seed=3, infinite=True, repeat_factors=r)
    plain = RoIBatchSampler(w, h, 2, seed=3, infinite=True)
    print(f"  mean factor {float(r.mean()):.3f}; pass 0: {s.natural_blocks(0) * 2:,} entries "
          f"for {n:,} images")

    def ours_pass(p=[0]):
        p[0] += 1
        s._memo.clear()
        s.permutation(p[0])

    def plain_pass(p=[0]):
        p[0] += 1
        plain._memo.clear()
        plain.permutation(p[0])

    op_t, op_all = _best(ours_pass, reps)
    pp_t, pp_all = _best(plain_pass, reps)
    print(f"  one pass, ours (multiset + grouped perm): {op_t * 1e3:8.1f} ms "
          f"{_spread(op_all, 1e3)}  (without repeat factors: {pp_t * 1e3:.1f} ms)")
    if d2 is not None:
        sampler = d2(torch.from_numpy(r), seed=3)
        g = torch.Generator()
        g.manual_seed(3)

        def d2_pass():
            idx = sampler._get_epoch_indices(g)
            idx[torch.randperm(len(idx), generator=g)]

        d2p_t, d2p_all = _best(d2_pass, reps)
        print(f"  one pass, Detectron2 (_get_epoch_indices + randperm): {d2p_t * 1e3:8.1f} ms "
              f"{_spread(d2p_all, 1e3)}  (ratio Detectron2/ours {d2p_t / op_t:.1f}x)")

    nb = 20_000 if args.quick else 200_000
    t_rep = min(per_batch(s.draw, nb) for _ in range(reps))
    t_plain = min(per_batch(plain.draw, nb) for _ in range(reps))
    print(f"  per batch, draw with repeats: {t_rep * 1e6:6.2f} us (without: {t_plain * 1e6:.2f} us, "
          f"ratio {t_rep / t_plain:.2f}x)")
    times = []
    for p in (1, 50, 5000):
        s._memo.clear()
        s._pass_blocks.clear()
        t0 = time.perf_counter()
        s.load_state_dict(s.state_at(p, 7))
        s.draw()
        times.append(time.perf_counter() - t0)
    print(f"  resume (load state + first draw) at pass 1 / 50 / 5000: "
          f"{_spread(times, 1e3)} ms (one pass's multiset + permutation, whatever the pass)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run")
    ap.add_argument("--repeat-factors", action="store_true",
                    help="only the repeat-factor rows (see the module doc)")
    ap.add_argument("--d2-src", default=None, help="Detectron2 source checkout (not installed)")
    ap.add_argument("--images", type=int, default=1_700_000,
                    help="images for --repeat-factors (default 1.7M)")
    ap.add_argument("--anns-per-image", type=float, default=4.0,
                    help="mean annotations per image for --repeat-factors (Detectron2's dicts "
                         "hold one Python dict per annotation: ~1.5 GB at 1.7M x 4)")
    args = ap.parse_args()
    if args.repeat_factors:
        repeat_factor_rows(args)
        return
    n_images = 20_000 if args.quick else 236_574  # COCO train2017 + flipped
    mb, n_batches = 2, (20_000 if args.quick else 250_000)  # > 2 passes in full mode
    rng = np.random.default_rng(0)
    widths = rng.integers(300, 641, n_images)
    heights = rng.integers(300, 641, n_images)

    # Interleaved repetitions, best of 3: the machine is shared, so take the least-disturbed.
    t_det = t_ours = t_ddp = float("inf")
    for _ in range(3):
        det = DetectronCursor(widths, heights, mb, seed=3)
        ours = RoIBatchSampler(widths, heights, mb, seed=3, infinite=True)
        ddp = RoIBatchSampler(widths, heights, mb, seed=3, infinite=True, rank=3, world_size=8)
        t_det = min(t_det, per_batch(det.next_inds, n_batches))
        t_ours = min(t_ours, per_batch(ours.draw, n_batches))
        t_ddp = min(t_ddp, per_batch(ddp.draw, n_batches // 8))
    print(f"roidb {n_images} images, IMS_PER_BATCH {mb}, {n_batches} batches "
          f"({n_batches * mb / n_images:.1f} passes)")
    print(f"per batch  Detectron deque+lock: {t_det * 1e6:8.2f} us")
    print(f"per batch  RoIBatchSampler.draw: {t_ours * 1e6:8.2f} us   "
          f"(ratio Detectron/ours {t_det / t_ours:.2f}x)")
    print(f"per batch  rank 3 of 8 (DDP):    {t_ddp * 1e6:8.2f} us   "
          f"(a reshuffle every B/8 draws; ratio Detectron/ours {t_det / t_ddp:.2f}x)")

    repeats = 5 if args.quick else 15
    r_small = resume_time(ours, 1_000, repeats)
    r_big = resume_time(ours, 1_000_000, repeats)
    r_huge = resume_time(ours, 10**12, repeats)
    print(f"resume at step 1,000:      {r_small * 1e3:8.2f} ms")
    print(f"resume at step 1,000,000:  {r_big * 1e3:8.2f} ms   (ratio to step 1,000: "
          f"{r_big / r_small:.2f}x)")
    print(f"resume at step 10^12:      {r_huge * 1e3:8.2f} ms   (ratio to step 1,000: "
          f"{r_huge / r_small:.2f}x)")
    replay_n = 1_000 if args.quick else 100_000
    replay = RoIBatchSampler(widths, heights, mb, seed=3, infinite=True)
    t0 = time.perf_counter()
    for _ in range(replay_n):
        replay.draw()
    t_replay = time.perf_counter() - t0
    print(f"replay baseline, {replay_n:,} steps: {t_replay * 1e3:8.1f} ms -> ~"
          f"{t_replay * 1_000_000 / replay_n:.1f} s at step 1,000,000 (sampler only, no "
          f"image loading; ratio replay/ours at 1e6: "
          f"{t_replay * 1_000_000 / replay_n / r_big:,.0f}x)")


if __name__ == "__main__":
    main()
