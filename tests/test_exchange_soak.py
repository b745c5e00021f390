"""Soak: 10,000 messages between two processes while the producer is SIGKILLed and
restarted and (memcached) the server is restarted mid-stream.

Checked: 0 lost, 0 duplicated, order kept, every payload intact, and nothing left behind
(no files in the store directory; none of the channel's keys on memcached). Marked
``slow``; bounded by a wall-clock limit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

try:
    from memcached_server import MemcachedServer, memcached_path
except ImportError:  # tests/ imported as a package
    from tests.memcached_server import MemcachedServer, memcached_path

REPO = Path(__file__).resolve().parents[1]
N = 10_000
LIMIT_S = 170  # wall-clock bound of one soak (well under it unloaded)

# Message seq s carries v = [s, s*7 % 1000, ...] and meta {"i": s}: payloads are checked.
PRODUCER = r"""
import json, sys
import numpy as np
from lit_roidata.exchange import BlobExchange
o = json.loads(sys.argv[1])
ex = BlobExchange(o["backend"], o["address"], run_id=o["run_id"], capacity=8, lease_ttl=2.0,
                  resume=True, on_state_lost="recover", timeout=60)
ch = ex.channel("soak", "producer")
print("start", ch.next_seq, flush=True)
for s in range(ch.next_seq, o["n"] + 1):
    ch.put({"v": np.arange(s, s + 1 + s % 13, dtype=np.int64)}, meta={"i": s}, timeout=60)
    if s % 250 == 0:
        print("sent", s, flush=True)
ch.close()
ex.close()
print("done", flush=True)
"""

CONSUMER = r"""
import json, sys, time
import numpy as np
from lit_roidata.exchange import BlobExchange, PeerDeadError
o = json.loads(sys.argv[1])
ex = BlobExchange(o["backend"], o["address"], run_id=o["run_id"], lease_ttl=2.0,
                  on_state_lost="recover", timeout=60)
ch = ex.channel("soak", "consumer")
got, bad, dead = [], 0, 0
while len(got) < o["n"]:
    try:
        tensors, meta = ch.get(timeout=60)
    except PeerDeadError:  # the producer was killed: wait for its successor
        dead += 1
        time.sleep(0.02)
        continue
    s = meta["i"]
    if not np.array_equal(tensors["v"], np.arange(s, s + 1 + s % 13)):
        bad += 1
    got.append(s)
    if len(got) % 250 == 0:
        print("got", len(got), flush=True)
ch.close()
ex.close()
print(json.dumps({"got": got, "bad": bad, "dead": dead}), flush=True)
"""


def _spawn(code: str, opts: dict) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(opts)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(proc: subprocess.Popen, word: str, at_least: int, deadline: float) -> int:
    """Read ``proc``'s lines until ``word n`` with n >= at_least; return n."""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"process ended early: {proc.stderr.read()}")
        parts = line.split()
        if len(parts) == 2 and parts[0] == word and int(parts[1]) >= at_least:
            return int(parts[1])
    raise AssertionError(f"no '{word} >= {at_least}' in time")


def _drain(proc: subprocess.Popen, deadline: float) -> tuple[str, str]:
    out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    assert proc.returncode == 0, err
    return out, err


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["embedded", "memcached"])
def test_soak_10k_messages_with_killed_producer_and_restarted_server(backend, tmp_path):
    if backend == "memcached" and memcached_path() is None:
        pytest.skip("memcached is not installed")
    server = MemcachedServer(item_size="1m").start() if backend == "memcached" else None
    root = tmp_path / "store"
    address = server.address if server else str(root)
    opts = {"backend": backend, "address": address, "run_id": f"soak{uuid.uuid4().hex[:8]}",
            "n": N}
    deadline = time.monotonic() + LIMIT_S
    procs: list[subprocess.Popen] = []
    try:
        consumer = _spawn(CONSUMER, opts)
        producer = _spawn(PRODUCER, opts)
        procs += [consumer, producer]
        _wait_for(producer, "sent", 3000, deadline)
        os.kill(producer.pid, signal.SIGKILL)  # mid-stream, possibly inside put()
        producer.wait()
        producer = _spawn(PRODUCER, opts)  # restarted: resumes where the stream is
        procs.append(producer)
        first = producer.stdout.readline().split()
        assert first[0] == "start" and 3000 < int(first[1]) <= N, first
        if server is not None:
            _wait_for(consumer, "got", 6000, deadline)
            server.restart()  # every key is gone; both ends rejoin
        try:
            out, p_err = _drain(producer, deadline)
        except AssertionError as exc:
            consumer.kill()
            raise AssertionError(f"{exc}\nconsumer: {consumer.communicate()[1]}") from None
        assert out.strip().endswith("done"), out
        out, c_err = _drain(consumer, deadline)
        result = json.loads(out.strip().splitlines()[-1])
        if server is not None:  # both ends really went through a recovery
            assert "rejoined as incarnation" in p_err and "rejoined as incarnation" in c_err
        assert result["dead"] >= 0
        got = result["got"]
        assert len(got) == N and len(set(got)) == N, "lost or duplicated messages"
        assert got == list(range(1, N + 1)), "order not kept"
        assert result["bad"] == 0, "corrupted payloads"
        if server is None:
            assert not [p for p in root.rglob("*") if p.is_file()], "files left behind"
        else:
            from lit_roidata.exchange.memcached import MemcachedStore

            store = MemcachedStore(server.address)
            ns = f"{opts['run_id']}/0/soak"
            keys = [f"{ns}/{k}" for k in ("head", "ack", "gen", "lease.producer",
                                          "lease.consumer", "closed.producer",
                                          "closed.consumer")]
            keys += [f"{ns}/msg.{s:012d}" for s in range(N - 20, N + 2)]
            assert store.get_many(keys) == {}, "channel keys left behind"
            store.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        if server is not None:
            server.stop()
