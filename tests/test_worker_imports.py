"""What a DataLoader worker imports: nothing it does not use (Lightning, matplotlib, the
exchange subpackage, torchvision).

With the default start method on Linux (``fork``) a worker inherits the parent's modules,
so a check inside a forked worker only repeats the parent's imports. Two checks are
meaningful: the worker-side modules import none of these at module level (a fresh
interpreter), and a ``spawn`` worker (which re-imports only what unpickling the dataset
needs, as ``forkserver``, Python 3.14's default, does) has none of them loaded.
"""

from __future__ import annotations

import gc
import subprocess
import sys

import numpy as np
import pytest
import torch

from lit_roidata.dataset import RoIBlockDataset
from lit_roidata.loader import StatefulRoIDataLoader
from lit_roidata.sampler import RoIBatchSampler

UNUSED = ("pytorch_lightning", "lightning", "lightning_fabric", "matplotlib",
          "lit_roidata.exchange", "torchvision")


def test_worker_side_modules_import_nothing_unused() -> None:
    code = ("import sys\n"
            "import lit_roidata.dataset, lit_roidata.loader, lit_roidata.sampler\n"
            "import lit_roidata.minibatch, lit_roidata.minibatch.decode\n"
            "import lit_roidata.minibatch.rpn, lit_roidata.minibatch.retinanet\n"
            "import lit_roidata.minibatch.fast_rcnn, lit_roidata.minibatch.transport\n"
            "import lit_roidata.minibatch.shm_pool, lit_roidata.roidb\n"
            f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {UNUSED!r} "
            f"or any(m == u or m.startswith(u + '.') for u in {UNUSED!r}))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


class _ModulesDataset(RoIBlockDataset):
    """Returns the worker's ``sys.modules`` instead of a minibatch."""

    def __getitems__(self, block):  # noqa: ANN001, ANN204 - test double
        return sorted(sys.modules)


def test_a_spawned_worker_loads_nothing_unused(tmp_path) -> None:
    from test_minibatch_helpers import small_cfg

    cfg = small_cfg()
    roidb = [dict(image=str(tmp_path / "x.jpg"), id=1, width=8, height=6, flipped=False)]
    ds = _ModulesDataset(roidb, cfg)
    sampler = RoIBatchSampler(np.array([6]), np.array([8]), ims_per_batch=1, seed=0,
                              infinite=True)
    loader = StatefulRoIDataLoader(ds, sampler, num_workers=1, multiprocessing_context="spawn")
    modules = next(iter(loader))
    assert "lit_roidata.dataset" in modules  # it is the worker's list
    bad = [m for m in modules if any(m == u or m.startswith(u + ".") for u in UNUSED)]
    assert not bad, bad
    assert torch.utils.data.get_worker_info() is None


class _ForkStateDataset(RoIBlockDataset):
    """Returns what a forked worker inherited: the GC's frozen count and the anchor cache."""

    def __getitems__(self, block):  # noqa: ANN001, ANN204 - test double
        from lit_roidata.minibatch import anchors

        return gc.get_freeze_count(), anchors._concat.cache_info().currsize


@pytest.mark.parametrize("rpn", [True, False])
def test_forked_workers_share_the_frozen_heap_and_the_anchor_arrays(tmp_path, rpn) -> None:
    from test_minibatch_helpers import small_cfg

    from lit_roidata.minibatch import anchors

    if torch.multiprocessing.get_context().get_start_method() != "fork":
        pytest.skip("the default start method does not fork")
    over = ({"MODEL.RPN_ONLY": True, "RPN.RPN_ON": True, "FPN.FPN_ON": True,
             "FPN.MULTILEVEL_RPN": True} if rpn else {})
    cfg = small_cfg(**over)
    anchors._concat.cache_clear()
    roidb = [dict(image=str(tmp_path / "x.jpg"), id=1, width=8, height=6, flipped=False)]
    sampler = RoIBatchSampler(np.array([6]), np.array([8]), ims_per_batch=1, seed=0,
                              infinite=True)
    loader = StatefulRoIDataLoader(_ForkStateDataset(roidb, cfg), sampler, num_workers=1)
    frozen, cached = next(iter(loader))
    assert frozen > 1000  # the parent's objects, never walked by the worker's GC
    assert gc.get_freeze_count() == 0  # thawed in the parent
    assert cached == (1 if rpn else 0)  # built before the fork (the worker built none)
