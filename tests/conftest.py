"""Fixtures shared by several test files."""

from __future__ import annotations

import uuid

import pytest

from lit_roidata.exchange import BlobExchange

try:
    from memcached_server import memcached_server  # noqa: F401  (pytest fixture)
except ImportError:  # tests/ imported as a package
    from tests.memcached_server import memcached_server  # noqa: F401


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


@pytest.fixture(params=["embedded", "memcached"])
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

    make.backend, make.address = request.param, address
    yield make
    for ex in made:
        ex.close()
