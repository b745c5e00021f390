"""BlobExchange latency and throughput vs a plain pymemcache set/get loop (same run).

For payloads of 1 KB, 1 MB and 8 MB it measures:

* **baseline**: ``client.set(key, payload); client.get(key)`` with pymemcache on a local
  memcached (``-I 16m``, so nothing is chunked): the raw cost of moving the bytes
  through the server and back, with none of the exchange's guarantees.
* **exchange, one process**: ``producer.put(...)`` then ``consumer.get(...)`` on the
  embedded backend (``/dev/shm`` or tmp), on memcached ``-I 16m`` and on memcached
  ``-I 1m`` (payloads above 1 MB chunked). Same unit of work as the baseline (one write
  and one read of the payload), plus the exactly-once protocol (sequence numbers, ack,
  lease checks, incarnation check, CRC-32 of the wire format).
* **exchange, two processes**: ping-pong round-trip latency with an echo peer process
  (two messages per round trip, each with its full protocol).
* **+ HMAC**: the in-process cases again with a run secret set (every message carries an
  HMAC-SHA256 over header and payload, checked on receipt): the cost of authentication.

Throughput is payload bytes per put+get pair (MB/s, 10^6 bytes); ratios are exchange time
/ baseline time (lower is better). It starts its own memcached servers.

Usage::

    python benchmarks/exchange.py            # full run
    python benchmarks/exchange.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from memcached_server import MemcachedServer  # noqa: E402
from pymemcache.client.base import Client  # noqa: E402

from lit_roidata.exchange import BlobExchange  # noqa: E402

SIZES = {"1 KB": 1_000, "1 MB": 1_000_000, "8 MB": 8_000_000}
ECHO = r"""
import json, sys
from lit_roidata.exchange import BlobExchange, ChannelClosedError
o = json.loads(sys.argv[1])
ex = BlobExchange(o["backend"], o["address"], run_id=o["run_id"])
ping, pong = ex.channel("ping", "consumer"), ex.channel("pong", "producer")
print("ready", flush=True)
try:
    while True:
        tensors, meta = ping.get(timeout=120)
        pong.put(tensors, meta, timeout=120)
except ChannelClosedError:
    pass
ex.close()
"""


def _iters(size: int, quick: bool) -> int:
    n = {1_000: 2000, 1_000_000: 60, 8_000_000: 12}[size]
    return max(3, n // 10) if quick else n


def _timed(fn, n: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_baseline(address: str, payload: bytes, n: int) -> list[float]:
    host, port = address.split(":")
    client = Client((host, int(port)), no_delay=True, default_noreply=False)
    key = f"baseline:{uuid.uuid4().hex}"

    def once():
        if not client.set(key, payload):
            raise RuntimeError("baseline set failed")
        if client.get(key) is None:
            raise RuntimeError("baseline get failed")

    try:
        return _timed(once, n)
    finally:
        client.close()


def bench_in_process(backend: str, address: str, arr: np.ndarray, n: int,
                     secret: str | None = None) -> list[float]:
    kw = {"secret": secret} if secret else {}
    ex = BlobExchange(backend, address, run_id=f"bench{uuid.uuid4().hex[:8]}", **kw)
    prod, cons = ex.channel("c", "producer"), ex.channel("c", "consumer")

    def once():
        prod.put({"x": arr}, {"step": 0})
        cons.get(timeout=60)

    try:
        return _timed(once, n)
    finally:
        ex.close()


def bench_ping_pong(backend: str, address: str, arr: np.ndarray, n: int) -> list[float]:
    run_id = f"pp{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    peer = subprocess.Popen([sys.executable, "-c", ECHO, json.dumps(
        {"backend": backend, "address": address, "run_id": run_id})], env=env,
        stdout=subprocess.PIPE, text=True)
    try:
        if peer.stdout.readline().strip() != "ready":
            raise RuntimeError("echo peer failed to start")
        ex = BlobExchange(backend, address, run_id=run_id)
        ping, pong = ex.channel("ping", "producer"), ex.channel("pong", "consumer")

        def once():
            ping.put({"x": arr}, {"step": 0}, timeout=60)
            pong.get(timeout=60)

        times = _timed(once, n)
        ex.close()
        peer.wait(timeout=30)
        return times
    finally:
        if peer.poll() is None:
            peer.kill()


def _fmt(times: list[float], size: int) -> tuple[str, str, float]:
    med = statistics.median(times)
    return f"{med * 1e6:10.0f}", f"{size / med / 1e6:9.1f}", med


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--no-hmac", dest="hmac", action="store_false",
                        help="skip the authenticated (HMAC) rows")
    parser.add_argument("--no-ping-pong", dest="ping_pong", action="store_false",
                        help="skip the two-process rows")
    args = parser.parse_args()
    os.environ.pop("LIT_ROIDATA_EXCHANGE_SECRET", None)  # rows without HMAC are plain
    os.environ.pop("LIT_ROIDATA_EXCHANGE_SECRET_FILE", None)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    embedded_dir = tempfile.mkdtemp(prefix="lrx_bench_", dir=shm)
    print(f"embedded directory: {embedded_dir}; median of N put+get pairs per row")
    with MemcachedServer(item_size="16m", memory_mb=1024) as big, \
            MemcachedServer(item_size="1m", memory_mb=1024) as small:
        rows = []
        for label, size in SIZES.items():
            n = _iters(size, args.quick)
            arr = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
            base = bench_baseline(big.address, arr.tobytes(), n)
            cases = [("embedded", "embedded", embedded_dir),
                     ("memcached -I 16m", "memcached", big.address),
                     ("memcached -I 1m (chunked)", "memcached", small.address)]
            b_us, b_mbs, b_med = _fmt(base, size)
            rows.append((label, "baseline pymemcache set+get", n, b_us, b_mbs, "1.00"))
            for name, backend, address in cases:
                us, mbs, med = _fmt(bench_in_process(backend, address, arr, n), size)
                rows.append((label, f"exchange {name}", n, us, mbs, f"{med / b_med:.2f}"))
            if args.hmac:
                for name, backend, address in cases[:2]:
                    us, mbs, med = _fmt(bench_in_process(backend, address, arr, n,
                                                         secret="bench-secret"), size)
                    rows.append((label, f"exchange {name} + HMAC", n, us, mbs,
                                 f"{med / b_med:.2f}"))
            for name, backend, address in cases[:2] if args.ping_pong else ():
                pp = bench_ping_pong(backend, address, arr, max(3, n // 2))
                med = statistics.median(pp)
                rows.append((label, f"ping-pong RTT 2 procs, {name}", max(3, n // 2),
                             f"{med * 1e6:10.0f}", f"{2 * size / med / 1e6:9.1f}",
                             f"{med / b_med:.2f}"))
    print(f"{'payload':8} {'case':42} {'N':>5} {'median us':>10} {'MB/s':>9} {'x base':>7}")
    for label, case, n, us, mbs, ratio in rows:
        print(f"{label:8} {case:42} {n:5d} {us} {mbs} {ratio:>7}")
    print("x base = median time / baseline median (same payload); ping-pong moves the "
          "payload twice per round trip (MB/s counts both).")


if __name__ == "__main__":
    main()
