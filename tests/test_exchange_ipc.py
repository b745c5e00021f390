"""BlobExchange between separately started processes, on both backends (Detectron semantics:
cross-process exchange; tested invariants).

Each peer is an unrelated ``python -c`` process that only shares the run id (and, for
memcached, the server address) with the test process. memcached is the real server,
started on a free port by ``tests/memcached_server.py``.
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

import numpy as np
import pytest

from lit_roidata.exchange import (
    AlignmentError,
    BlobExchange,
    ChannelBusyError,
    ExchangeStateLostError,
    PeerDeadError,
)

from memcached_server import MemcachedServer, memcached_path

pytestmark = pytest.mark.slow  # peer processes / DDP launches

REPO = Path(__file__).resolve().parents[1]

# The peer process. argv[1] is a JSON dict of options; it prints "ready" when its channel
# is open, then "done" (or a traceback on stderr).
PEER = r"""
import json, sys, time
import numpy as np
from lit_roidata.exchange import BlobExchange
o = json.loads(sys.argv[1])
ex = BlobExchange(o["backend"], o["address"], run_id=o["run_id"], rank=o.get("rank", 0),
                  capacity=o.get("capacity", 1), lease_ttl=o.get("lease_ttl", 5.0))
if o.get("aligned"):  # two channels: "good" follows the stream, "bad" slips one block
    from lit_roidata.demo.exchange_streams import demo_alignment_stream
    for name, skip_at in (("good", None), ("bad", o["skip_at"])):
        ch = ex.channel(name, "producer")
        stream = demo_alignment_stream(o["seed"])
        for step in range(o["k"]):
            if step == skip_at:
                next(stream)  # deliberately slip one block: the streams are misaligned
            ch.put({"x": np.zeros(2)}, meta=dict(next(stream), step=step), timeout=30)
    print("done", flush=True)
    sys.exit(0)
ch = ex.channel(o.get("channel", "c"), o["role"])
print("ready", flush=True)
if o["role"] == "producer":
    for step in range(o["k"]):
        if o.get("big"):
            x = np.random.default_rng(step).standard_normal(o["big"] // 4).astype(np.float32)
        else:
            x = np.arange(step % 50, dtype=np.int64)
        ch.put({"x": x, "step": np.array(step)}, meta={"step": step}, timeout=30)
print("done", flush=True)
if o.get("hold"):
    time.sleep(600)
ch.close()
ex.close()
"""


def _spawn(**opts) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", PEER, json.dumps(opts)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc


def _expect_line(proc: subprocess.Popen, word: str) -> None:
    line = proc.stdout.readline().strip()
    if line != word:
        proc.kill()
        raise AssertionError(f"peer printed {line!r}, expected {word!r}; stderr:\n"
                             f"{proc.stderr.read()}")


def _finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err


@pytest.fixture
def setup(make_exchange):
    """(exchange factory, peer-process spawner) on make_exchange's backend and run id."""

    def exchange(**kw) -> BlobExchange:
        kw.setdefault("lease_ttl", 10.0)  # BlobExchange's default (make_exchange uses 3 s)
        return make_exchange(**kw)

    base = {"backend": make_exchange.backend, "address": make_exchange.address,
            "run_id": make_exchange.run_id}
    procs: list[subprocess.Popen] = []

    def spawn(**opts) -> subprocess.Popen:
        proc = _spawn(**base, **opts)
        procs.append(proc)
        return proc

    yield exchange, spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_k_messages_across_processes_in_order_exactly_once(setup):
    exchange, spawn = setup
    k = 30
    proc = spawn(role="producer", k=k)
    cons = exchange().channel("c", "consumer")
    steps = []
    for _ in range(k):
        tensors, meta = cons.get(timeout=60)
        assert int(tensors["step"]) == meta["step"]
        np.testing.assert_array_equal(tensors["x"], np.arange(meta["step"] % 50))
        steps.append(meta["step"])
    assert steps == list(range(k))
    code, err = _finish(proc)
    assert code == 0, err


def test_second_producer_process_is_rejected_then_takes_over_when_it_dies(setup):
    exchange, spawn = setup
    proc = spawn(role="producer", k=0, hold=True)
    _expect_line(proc, "ready")
    with pytest.raises(ChannelBusyError, match=f"pid {proc.pid}"):
        exchange().channel("c", "producer")
    proc.kill()
    proc.wait()
    exchange().channel("c", "producer")  # the dead owner's lease is taken over at once


def test_killed_producer_is_detected(setup):
    exchange, spawn = setup
    proc = spawn(role="producer", k=1, hold=True)
    cons = exchange().channel("c", "consumer")
    assert cons.get(timeout=60)[1] == {"step": 0}
    _expect_line(proc, "ready")
    _expect_line(proc, "done")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    start = time.monotonic()
    with pytest.raises(PeerDeadError, match=f"producer pid {proc.pid}.*no longer running"):
        cons.get(timeout=60)
    assert time.monotonic() - start < 30  # detected, not timed out


def test_killed_consumer_is_detected_by_a_waiting_producer(setup):
    exchange, spawn = setup
    prod = exchange().channel("c", "producer")
    prod.put({"x": np.zeros(1)})
    proc = spawn(role="consumer", hold=True)
    _expect_line(proc, "ready")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with pytest.raises(PeerDeadError, match="consumer pid"):
        prod.put({"x": np.zeros(1)}, timeout=60)


def test_5mb_payload_across_processes(setup):
    exchange, spawn = setup
    size = 5 * 1024 * 1024
    proc = spawn(role="producer", k=2, big=size)
    cons = exchange().channel("c", "consumer")
    for step in range(2):
        tensors, _ = cons.get(timeout=60)
        expected = np.random.default_rng(step).standard_normal(size // 4).astype(np.float32)
        np.testing.assert_array_equal(tensors["x"], expected)
    assert _finish(proc)[0] == 0


def test_aligned_processes_detect_a_misaligned_stream(setup, request):
    if request.node.callspec.params["make_exchange"] != "embedded":
        pytest.skip("alignment is backend-independent (in-process tests cover memcached); "
                    "the peer imports torch, which is slow")
    from lit_roidata.demo.exchange_streams import demo_alignment_stream as _demo_alignment_stream

    exchange, spawn = setup
    ex = exchange()
    # One peer process (importing torch for the sampler is slow on a loaded machine).
    proc = spawn(role="producer", aligned=True, seed=7, k=5, skip_at=3, capacity=5)
    for name in ("good", "bad"):
        cons = ex.channel(name, "consumer")
        mine = _demo_alignment_stream(7)
        for step in range(5):
            expect = dict(next(mine), step=step)
            if name == "bad" and step == 3:
                with pytest.raises(AlignmentError, match=r"field 'image_ids\[0\]' differs"):
                    cons.get(timeout=60, expect=expect)
                break
            cons.get(timeout=60, expect=expect)
        cons.close()
    code, err = _finish(proc)
    assert code == 0, err


@pytest.mark.skipif(memcached_path() is None, reason="memcached is not installed")
def test_memcached_restart_mid_stream_is_a_clear_error(tmp_path):
    with MemcachedServer(item_size="1m") as server:
        run_id = f"rs{uuid.uuid4().hex[:8]}"
        proc = _spawn(backend="memcached", address=server.address, run_id=run_id,
                      role="producer", k=1000)
        # A short lease: the heartbeat notices the restart before the next get does.
        ex = BlobExchange("memcached", server.address, run_id=run_id, lease_ttl=1.0)
        cons = ex.channel("c", "consumer")
        for step in range(3):
            assert cons.get(timeout=60)[1]["step"] == step
        server.restart()
        time.sleep(1.0)
        with pytest.raises(ExchangeStateLostError, match="incarnation key is missing"):
            cons.get(timeout=60)
        code, err = _finish(proc)
        assert code != 0 and "ExchangeStateLostError" in err, err
        # A process joining after the restart gets a new incarnation; the old one still
        # refuses to read, so no state from before the restart is ever mixed in.
        BlobExchange("memcached", server.address, run_id=run_id).channel("c", "producer")
        with pytest.raises(ExchangeStateLostError, match="incarnation key (is missing|changed)"):
            cons.get(timeout=10)
        ex.close()
