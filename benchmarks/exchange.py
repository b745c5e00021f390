"""BlobExchange latency and throughput vs a plain pymemcache set/get loop (same run).

For payloads of 1 KB, 1 MB and 35 MB (an RPN message) it measures:

* **baseline**: ``client.set(key, payload); client.get(key)`` with pymemcache on a local
  memcached (``-I 64m``, so nothing is chunked): the raw cost of moving the bytes
  through the server and back, with none of the exchange's guarantees.
* **exchange, one process**: ``producer.put(...)`` then ``consumer.get(...)`` on the
  embedded backend (``/dev/shm`` or tmp), on memcached ``-I 64m`` and on memcached
  ``-I 1m`` (payloads above 1 MB chunked). Same unit of work as the baseline (one write
  and one read of the payload), plus the exactly-once protocol (sequence numbers, ack,
  lease checks, incarnation check, CRC-32 of the wire format).
* **exchange, two processes**: ping-pong round-trip latency with an echo peer process
  (two messages per round trip, each with its full protocol).
* **+ HMAC**: the in-process cases again with a run secret set (every message carries an
  HMAC-SHA256 over header and payload, checked on receipt): the cost of authentication.

* **before** (``--baseline-src DIR``): the same in-process put+get with another copy of
  the package (``DIR/lit_roidata``, e.g. the release before lease fencing, extracted with
  ``git archive 874f482 lit_roidata | tar -x -C DIR``), loaded into this process under its
  own module table and run interleaved with the current code (old, new, new + HMAC, old,
  ...), so the machine's load hits both alike. ``now/before`` is the ratio of medians.

Each row is measured ``--repeats`` times (interleaved); it prints the median of the
repeats' medians and their range (min..max).

Throughput is payload bytes per put+get pair (MB/s, 10^6 bytes); ratios are exchange time
/ baseline time (lower is better). It starts its own memcached servers.

Usage::

    python benchmarks/exchange.py            # full run
    python benchmarks/exchange.py --quick    # smoke run
    git archive 874f482 lit_roidata | tar -x -C /tmp/fence-old
    python benchmarks/exchange.py --baseline-src /tmp/fence-old --no-ping-pong
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
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

SIZES = {"1 KB": 1_000, "1 MB": 1_000_000, "35 MB": 35_000_000}
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
    n = {1_000: 1000, 1_000_000: 40, 35_000_000: 5}[size]
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
                     secret: str | None = None, version: Version | None = None) -> list[float]:
    kw = {"secret": secret} if secret else {}
    with version or contextlib.nullcontext():
        return _bench_in_process(version.exchange if version else BlobExchange, backend,
                                 address, arr, n, kw)


def _bench_in_process(cls, backend, address, arr, n, kw) -> list[float]:
    ex = cls(backend, address, run_id=f"bench{uuid.uuid4().hex[:8]}", **kw)
    prod, cons = ex.channel("c", "producer"), ex.channel("c", "consumer")

    def once():
        prod.put({"x": arr}, {"step": 0})
        cons.get(timeout=60)

    try:
        return _timed(once, n)
    finally:
        ex.close()


class Version:
    """One copy of the ``lit_roidata`` package, loaded under its own module table.

    ``with version:`` puts its modules into ``sys.modules`` (so imports done lazily inside
    its functions resolve to the same copy) and puts the previous ones back afterwards.
    """

    def __init__(self, src: Path | None) -> None:
        saved = _take_modules()
        if src is not None:
            sys.path.insert(0, str(src))
        try:
            import lit_roidata.exchange as mod

            self.exchange = mod.BlobExchange
            self.where = Path(mod.__file__).parents[1]
        finally:
            if src is not None:
                sys.path.remove(str(src))
            self.modules = _take_modules()
            sys.modules.update(saved)
        self._saved: dict = {}

    def __enter__(self) -> Version:
        self._saved = _take_modules()
        sys.modules.update(self.modules)
        return self

    def __exit__(self, *exc: object) -> None:
        _take_modules()
        sys.modules.update(self._saved)


def _take_modules() -> dict:
    names = [k for k in sys.modules if k == "lit_roidata" or k.startswith("lit_roidata.")]
    return {k: sys.modules.pop(k) for k in names}


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


def _stat(medians: list[float]) -> tuple[float, float, float]:
    return statistics.median(medians), min(medians), max(medians)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measure every row this many times, interleaved (default 3)")
    parser.add_argument("--baseline-src", type=Path, default=None, metavar="DIR",
                        help="a directory holding another copy of the package "
                             "(DIR/lit_roidata), measured side by side as 'before'")
    parser.add_argument("--sizes", default=",".join(SIZES),
                        help="comma-separated payload sizes to run (default: all)")
    parser.add_argument("--no-hmac", dest="hmac", action="store_false",
                        help="skip the authenticated (HMAC) rows")
    parser.add_argument("--no-chunked", dest="chunked", action="store_false",
                        help="skip memcached -I 1m (chunked payloads)")
    parser.add_argument("--no-ping-pong", dest="ping_pong", action="store_false",
                        help="skip the two-process rows")
    args = parser.parse_args()
    os.environ.pop("LIT_ROIDATA_EXCHANGE_SECRET", None)  # rows without HMAC are plain
    os.environ.pop("LIT_ROIDATA_EXCHANGE_SECRET_FILE", None)
    before = None
    if args.baseline_src is not None:
        if not (args.baseline_src / "lit_roidata" / "exchange").is_dir():
            parser.error(f"--baseline-src {args.baseline_src}: no lit_roidata/exchange there")
        before = Version(args.baseline_src.resolve())
        print(f"before: {before.where}")
    print(f"now:    {Path(sys.modules['lit_roidata'].__file__).parent}")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    embedded_dir = tempfile.mkdtemp(prefix="lrx_bench_", dir=shm)
    print(f"embedded directory: {embedded_dir}; each row: median over --repeats "
          f"{args.repeats} of the median of N put+get pairs (range min..max)")
    try:
        with MemcachedServer(item_size="64m", memory_mb=1024) as big, \
                MemcachedServer(item_size="1m", memory_mb=1024) as small:
            rows = _run(args, before, embedded_dir, big, small)
    finally:
        shutil.rmtree(embedded_dir, ignore_errors=True)
    print(f"{'payload':8} {'case':50} {'N':>4} {'median us':>10} {'range us':>17} "
          f"{'MB/s':>8} {'x base':>6} {'now/before':>10}")
    for label, case, n, (med, lo, hi), size, b_med, rel in rows:
        if "HMAC cost" in case:  # a difference of times: no throughput or ratio
            mbs_txt, x_txt = f"{'':8}", f"{'':6}"
        else:
            mbs = (2 if "ping-pong" in case else 1) * size / med / 1e6
            mbs_txt, x_txt = f"{mbs:8.1f}", f"{med / b_med:6.2f}"
        print(f"{label:8} {case:50} {n:4d} {med * 1e6:10.0f} {lo * 1e6:8.0f}..{hi * 1e6:<8.0f}"
              f" {mbs_txt} {x_txt} {rel:>10}")
    print("x base = median / pymemcache baseline median (same payload). now/before = "
          "median of the per-repeat ratios [min..max]. HMAC cost = (+HMAC) - (plain), same "
          "repeat. ping-pong moves the payload twice per round trip (MB/s counts both).")


def _run(args, before, embedded_dir, big, small) -> list:
    cases = [("embedded", "embedded", embedded_dir),
             ("memcached -I 64m", "memcached", big.address)]
    if args.chunked:
        cases.append(("memcached -I 1m (chunked)", "memcached", small.address))
    rows = []
    for label in args.sizes.split(","):
        size = SIZES[label.strip()]
        n = _iters(size, args.quick)
        arr = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        base = [statistics.median(bench_baseline(big.address, arr.tobytes(), n))
                for _ in range(args.repeats)]
        b_med = statistics.median(base)
        rows.append((label, "baseline pymemcache set+get", n, _stat(base), size, b_med, ""))
        for name, backend, address in cases:
            variants = [("before", None, before)] if before is not None else []
            variants.append(("now", None, None))
            if args.hmac and "chunked" not in name:
                variants.append(("now + HMAC", "bench-secret", None))
            meds: dict[str, list[float]] = {v[0]: [] for v in variants}
            for _ in range(args.repeats):  # interleaved: before, now, now + HMAC, before, ...
                for tag, secret, version in variants:
                    meds[tag].append(statistics.median(bench_in_process(
                        backend, address, arr, n, secret=secret, version=version)))
            for tag, _, _ in variants:
                rel = ""
                if before is not None and tag != "before":
                    ratios = [a / b for a, b in zip(meds[tag], meds["before"])]
                    rel = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}..{max(ratios):.2f}]"
                rows.append((label, f"exchange {name}, {tag}", n, _stat(meds[tag]), size,
                             b_med, rel))
            if "now + HMAC" in meds:
                cost = [a - b for a, b in zip(meds["now + HMAC"], meds["now"])]
                c_med = statistics.median(cost)
                rows.append((label, f"  HMAC cost, {name} (us, +HMAC - plain)", n,
                             _stat(cost), size, b_med,
                             f"{c_med / statistics.median(meds['now']) * 100:+.0f}%"))
        for name, backend, address in cases[:2] if args.ping_pong else ():
            npp = max(3, n // 2)
            pp = [statistics.median(bench_ping_pong(backend, address, arr, npp))
                  for _ in range(args.repeats)]
            rows.append((label, f"ping-pong RTT 2 procs, {name}", npp, _stat(pp), size,
                         b_med, ""))
    return rows


if __name__ == "__main__":
    main()
