"""Fixtures shared by several test files."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hypothesis import settings

from lit_roidata.exchange import BlobExchange

try:
    from memcached_server import memcached_server  # noqa: F401  (pytest fixture)
except ImportError:  # tests/ imported as a package
    from tests.memcached_server import memcached_server  # noqa: F401

# --- hypothesis profiles (test infrastructure) -------------------------------------------
# "ci": the same examples on every run (derandomize), no per-example deadline on a loaded
# runner, and the reproduction blob printed on failure. Chosen when CI=true (.ci/run sets
# it) or explicitly with HYPOTHESIS_PROFILE=ci|dev; local runs default to "dev" (random
# examples, Hypothesis' usual settings). Loaded here, before the test modules are imported,
# so each test's own @settings(...) inherits the profile for what it does not set itself.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev")
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE")
                      or ("ci" if os.environ.get("CI", "").lower() in ("1", "true") else "dev"))
# --- end hypothesis profiles ---------------------------------------------------------------

class LightningNamespace:
    """One Lightning namespace for the Trainer-level tests: ``ns.Trainer``,
    ``ns.LightningModule``, ``ns.Callback``, ``ns.callbacks``, ``ns.seed_everything``, ...
    are that namespace's; ``ns.lit(cls)`` is a lit_roidata class bound to it
    (``lit_roidata.X`` for ``pytorch_lightning``, ``lit_roidata.lightning.X`` else)."""

    def __init__(self, name: str) -> None:
        from lit_roidata._lightning import import_namespace

        self.name = name
        self.module = import_namespace(name)

    def __getattr__(self, attr: str):
        return getattr(self.module, attr)

    def lit(self, cls: type) -> type:
        from lit_roidata._lightning import bind

        return bind(cls, self.name)

    def callback(self, mixin: type) -> type:
        """A test's plain hook class (no ``super()`` calls) made a Callback of this
        namespace."""
        key = (mixin, self.name)
        if key not in _CALLBACKS:
            _CALLBACKS[key] = type(mixin.__name__, (mixin, self.module.Callback), {})
        return _CALLBACKS[key]

    def __repr__(self) -> str:
        return f"LightningNamespace({self.name!r})"


_CALLBACKS: dict = {}


def _namespace_param(name: str):
    from lit_roidata._lightning import available

    marks = [] if available(name) else [pytest.mark.skip(
        reason=f"{name.split('.')[0]} is not installed (pip install 'lit_roidata[lightning]')")]
    return pytest.param(name, id=name.split(".")[0], marks=marks)


#: Both Lightning namespaces, for ``@pytest.mark.parametrize`` outside fixtures.
LIGHTNING_NAMESPACES = [_namespace_param("pytorch_lightning"),
                        _namespace_param("lightning.pytorch")]


@pytest.fixture(params=LIGHTNING_NAMESPACES)
def lightning_ns(request) -> LightningNamespace:
    """The Trainer/LightningModule/Callback classes of each Lightning namespace in turn
    (``pytorch_lightning``, then ``lightning.pytorch``: ``import lightning as L``)."""
    return LightningNamespace(request.param)



@pytest.fixture(params=["embedded", pytest.param("memcached", marks=pytest.mark.slow)])
def make_exchange(request, tmp_path):
    """Factory of exchanges sharing one run id on the parametrised backend."""
    if request.param == "memcached":
        address = request.getfixturevalue("memcached_server").address
    else:
        address = str(tmp_path / "exchange")
    run_id = f"t{uuid.uuid4().hex[:12]}"
    made: list[BlobExchange] = []

    def make(**kw) -> BlobExchange:
        kw.setdefault("run_id", run_id)
        kw.setdefault("lease_ttl", 3.0)
        ex = BlobExchange(request.param, address, **kw)
        made.append(ex)
        return ex

    make.backend, make.address, make.run_id = request.param, address, run_id
    yield make
    for ex in made:
        ex.close()


# --- shared fixtures (test infrastructure) -------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny demo's folder (data and roidb caches), one per pytest session."""
    from datamodule_support import shared_root

    return shared_root(tmp_path_factory)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch intra-op thread for the test (tiny tensors: faster on a shared box)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

@pytest.fixture(scope="session")
def demo_roidb(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., dict]:
    """Factory: the demo datasets, registered in a private catalog, and their roidbs.

    ``demo_roidb(num_images, overrides, proposals=True)`` generates the demo images under a
    fresh folder, builds the Detectron config with ``overrides`` (dotted keys) and returns
    ``{"cfg", "train", "val", "catalog", "demo"}``: the combined training roidb and the
    evaluation roidb, with the demo's precomputed proposals unless ``proposals=False``.
    """

    def build(num_images: dict[str, int], overrides: dict[str, Any], *,
              proposals: bool = True) -> dict:
        from lit_roidata.catalog import Catalog
        from lit_roidata.config import get_cfg
        from lit_roidata.demo import register_demo_datasets
        from lit_roidata.roidb import combined_roidb_for_training, roidb_for_evaluation

        folder = tmp_path_factory.mktemp("demo")
        cat = Catalog(builtins=False)
        demo = register_demo_datasets(folder, cat, num_images=num_images)
        cfg = get_cfg()
        cfg.merge_from_dict(overrides)
        cache = str(folder / "cache")
        train = combined_roidb_for_training(
            list(demo.train_datasets), list(demo.train_proposal_files) if proposals else [],
            cfg, cache_dir=cache, catalog=cat)
        val = roidb_for_evaluation(
            list(demo.val_datasets), cfg, cache_dir=cache, catalog=cat,
            proposal_files=list(demo.val_proposal_files) if proposals else ())
        return {"cfg": cfg, "train": train, "val": val, "catalog": cat, "demo": demo}

    return build
# --- end shared fixtures -------------------------------------------------------------------
