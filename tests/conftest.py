"""Fixtures shared by several test files."""

from __future__ import annotations

import uuid

import pytest

from lit_roidata.exchange import BlobExchange

try:
    from memcached_server import memcached_server  # noqa: F401  (pytest fixture)
except ImportError:  # tests/ imported as a package
    from tests.memcached_server import memcached_server  # noqa: F401


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
