"""The test helpers' race-free ports (tests/ports.py)."""

from __future__ import annotations

import errno
import socket

import pytest

from ports import ddp_rendezvous_env


def test_ddp_rendezvous_port_stays_bound_until_the_launch_ends() -> None:
    with ddp_rendezvous_env() as env:
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        port = int(env["MASTER_PORT"])
        # held by this process for the whole launch: nobody else can take it
        with socket.socket() as s, pytest.raises(OSError) as info:
            s.bind((env["MASTER_ADDR"], port))
        assert info.value.errno == errno.EADDRINUSE
        with socket.create_connection((env["MASTER_ADDR"], port), timeout=5):
            pass  # and it answers


def test_memcached_moves_to_another_port_when_its_candidate_is_taken(monkeypatch) -> None:
    import memcached_server as ms

    if ms.memcached_path() is None:
        pytest.skip("memcached is not installed (.ci/run installs it with apt-get)")
    with ms.MemcachedServer() as first:
        # the race, forced: the next server's candidate port is already taken by `first`
        candidates = iter([first.port])
        real = ms.port_candidate
        monkeypatch.setattr(ms, "port_candidate", lambda: next(candidates, None) or real())
        with ms.MemcachedServer() as second:
            assert second.port != first.port
            for server in (first, second):
                with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                    assert ms._server_pid(s) == server.proc.pid
