"""BlobExchange under real faults: full file systems, stalled and killed owners, server
restarts, close races, busy peers, checkpoints, leftovers and forged messages.

Every fault is produced for real: a child process with ``RLIMIT_FSIZE``, a small tmpfs
(when this process may mount one), ``SIGSTOP``/``SIGKILL``, a memcached server restarted
on its port. The soak test (two processes, 10,000 messages, producer killed and
restarted, memcached restarted) is marked ``slow``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np
import pytest

from lit_roidata.exchange import (
    BlobExchange,
    ChannelClosedError,
    ExchangeError,
    ExchangeStateLostError,
    ExchangeTimeoutError,
    LeaseLostError,
    MessageAuthError,
    wire,
)
from lit_roidata.exchange.embedded import EmbeddedStore, rename_noreplace

from memcached_server import MemcachedServer, memcached_path

REPO = Path(__file__).resolve().parents[1]
needs_memcached = pytest.mark.skipif(memcached_path() is None, reason="memcached not installed")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


class BlockingExpect(Mapping):
    """An ``expect=`` mapping whose iteration blocks until released: it holds a ``get``
    between decoding its message and acknowledging it (the window of the close race)."""

    def __init__(self, fields: dict) -> None:
        self.fields, self.entered, self.release = fields, threading.Event(), threading.Event()

    def __getitem__(self, key):
        return self.fields[key]

    def __iter__(self) -> Iterator:
        return iter(self.fields)

    def __len__(self) -> int:
        return len(self.fields)

    def items(self):
        self.entered.set()
        assert self.release.wait(60)
        return self.fields.items()


# -- embedded store: write failures -------------------------------------------------------
FSIZE_CHILD = r"""
import json, os, resource, signal, sys
import numpy as np
from lit_roidata.exchange import BlobExchange, ExchangeError
root = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # exceeding the limit: EFBIG, not a kill
ex = BlobExchange("embedded", run_id="fsize", shm_dir=root)
prod, cons = ex.channel("c", "producer"), ex.channel("c", "consumer")
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # files of at most 1 MB
out = {}
try:
    prod.put({"x": np.zeros(4 << 20, np.uint8)})
except ExchangeError as exc:
    out["error"], out["type"] = str(exc), type(exc).__name__
except OSError as exc:
    out["error"], out["type"] = str(exc), "OSError"
out["files_after_failure"] = sorted(os.listdir(os.path.join(root, "fsize", "0", "c")))
out["seq"] = prod.put({"x": np.arange(10)})           # the store still works afterwards
out["got"] = cons.get(timeout=10)[0]["x"].tolist()
ex.close()
print(json.dumps(out))
"""


@pytest.mark.slow
def test_full_file_system_write_cleans_up_and_names_the_directory(tmp_path):
    root = tmp_path / "shm"
    proc = subprocess.run([sys.executable, "-c", FSIZE_CHILD, str(root)], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["type"] == "ExchangeError", out
    assert str(root / "fsize" / "0" / "c") in out["error"]
    assert "4.2 MB needed" in out["error"] and "MB free" in out["error"]
    assert "shm_dir" in out["error"] and "LIT_ROIDATA_EXCHANGE_DIR" in out["error"]
    assert not [f for f in out["files_after_failure"] if f.endswith(".tmp")], out
    assert not [f for f in out["files_after_failure"] if f.startswith("msg.")], out
    assert out["seq"] == 1 and out["got"] == list(range(10))


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True)
    return res.returncode == 0


@pytest.mark.slow
def test_full_tmpfs_write_cleans_up(tmp_path):
    mnt = tmp_path / "small_shm"
    if not _mount_tmpfs(mnt, "2m"):
        pytest.skip("cannot mount a tmpfs here (needs root); RLIMIT_FSIZE test covers it")
    try:
        ex = BlobExchange("embedded", run_id="full", shm_dir=mnt)
        prod = ex.channel("c", "producer")
        with pytest.raises(ExchangeError, match=f"{mnt}.*No space left.*MB free.*shm_dir"):
            prod.put({"x": np.ones(3 << 20, np.uint8)})
        assert not [f for f in _files(mnt) if f.endswith(".tmp") or "/msg." in f]
        assert prod.put({"x": np.arange(3)}) == 1  # smaller messages still fit
        ex.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# -- embedded store: publishing without hard links ----------------------------------------
def _race_publish(root: str, key: str, who: int, start: float, out) -> None:
    store = EmbeddedStore(root, hard_links=False)
    while time.time() < start:
        pass
    enc = wire.encode({"who": np.array(who)})
    out.put((who, store.put_payload(key, enc)))


@pytest.mark.slow
def test_no_hard_link_publish_is_exclusive_under_a_race(tmp_path):
    root = str(tmp_path / "nolink")
    ctx = mp.get_context("fork")
    for round_ in range(8):
        key, out = f"r/0/c/msg.{round_:012d}", ctx.Queue()
        start = time.time() + 0.3
        procs = [ctx.Process(target=_race_publish, args=(root, key, who, start, out))
                 for who in range(4)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=60) for _ in procs)
        for p in procs:
            p.join()
        winners = [who for who, ok in results.items() if ok]
        assert len(winners) == 1, results  # exactly one writer published
        got = wire.decode(EmbeddedStore(root).get_payload(key)).tensors["who"]
        assert int(got) == winners[0]  # and its payload is the one visible
    assert not [f for f in _files(Path(root)) if f.endswith(".tmp")]
    with pytest.raises(FileExistsError):
        src = tmp_path / "src"
        src.write_bytes(b"x")
        rename_noreplace(str(src), str(Path(root) / "r/0/c/msg.000000000000"))


# -- memcached: exists keeps the TTL ------------------------------------------------------
@pytest.mark.slow
@needs_memcached
def test_memcached_exists_keeps_the_expiry(memcached_server):
    from lit_roidata.exchange.memcached import MemcachedStore

    store = MemcachedStore(memcached_server.address)
    key = f"ttl{uuid.uuid4().hex[:8]}"
    store.set(key, b"v", ttl=1)
    assert store.put_payload(key + "/p", wire.encode({"x": np.zeros(3)}), ttl=1)
    assert store.exists(key) and store.exists(key + "/p")  # (touch(key, 0) kept them forever)
    time.sleep(3.2)
    assert not store.exists(key) and not store.exists(key + "/p")
    assert store.get(key) is None
    store.close()


@pytest.mark.slow
@needs_memcached
def test_memcached_cas_with_its_own_token_sees_every_foreign_write(memcached_server):
    """A compare-and-swap right after this handle's own write reuses the CAS token the
    server returned (no read first); a write by another client in between, even of the
    same value, a delete or an expiry must still be seen."""
    from lit_roidata.exchange.memcached import MemcachedStore

    mine, other = MemcachedStore(memcached_server.address), MemcachedStore(
        memcached_server.address)
    key = f"cas{uuid.uuid4().hex[:8]}"
    mine.set(key, b"1 5")
    assert mine.cas(key, b"1 5", b"2 5")  # token from a read, then its own token
    assert mine.cas(key, b"2 5", b"3 5")
    assert mine.cas(key, b"3 5", b"4 5")
    other.set(key, b"4 9")  # a newer owner took over
    assert not mine.cas(key, b"4 5", b"5 5")
    assert mine.get(key) == b"4 9"
    assert mine.cas(key, b"4 9", b"5 5")
    other.set(key, b"5 5")  # rewritten with the very value this handle expects: allowed
    assert mine.cas(key, b"5 5", b"6 5")
    assert not mine.cas(key, b"5 5", b"7 5")  # stale expectation, own token is current
    other.delete(key)
    assert not mine.cas(key, b"6 5", b"7 5") and mine.get(key) is None
    mine.set(key, b"1 1", ttl=1)
    assert mine.cas(key, b"1 1", b"2 1", ttl=1)
    time.sleep(3.2)
    assert not mine.cas(key, b"2 1", b"3 1", ttl=1)  # expired
    assert mine.add(key + "/a", b"x") and not mine.add(key + "/a", b"y")
    assert mine.put_payload(key + "/p", wire.encode({"x": np.zeros(3)}))
    assert not mine.put_payload(key + "/p", wire.encode({"x": np.ones(3)}))
    mine.close()
    other.close()


# -- fencing tokens -----------------------------------------------------------------------
def test_stalled_producer_is_fenced_out_after_a_takeover(make_exchange):
    ex_a = make_exchange(lease_ttl=1.0)
    a = ex_a.channel("c", "producer")
    cons = make_exchange().channel("c", "consumer")
    a.put({"who": np.array(1)})
    assert int(cons.get(timeout=10)[0]["who"]) == 1
    ex_a.forget(a)  # A's heartbeat stops: it stalls (as under a long GC or swap)
    time.sleep(2.6)  # its lease expires
    b = make_exchange(lease_ttl=1.0, resume=True).channel("c", "producer")  # takes over
    with pytest.raises(LeaseLostError, match="fenced out"):
        a.put({"who": np.array(666)})  # A wakes up: its write of head is refused
    head = b._store.get(b._k_head)
    assert head == b"1 %d" % b._gen  # head still carries B's generation
    with pytest.raises(LeaseLostError):
        a.put({"who": np.array(667)})
    assert b.put({"who": np.array(2)}, timeout=10) == 2  # A's stray payload is replaced
    tensors, _ = cons.get(timeout=10)
    assert int(tensors["who"]) == 2


STALL_PRODUCER = r"""
import json, sys
import numpy as np
from lit_roidata.exchange import BlobExchange, LeaseLostError
o = json.loads(sys.argv[1])
ex = BlobExchange(o["backend"], o["address"], run_id=o["run_id"], lease_ttl=1.0)
ch = ex.channel("c", "producer")
ch.put({"who": np.array(1)})
print("ready", flush=True)
try:
    ch.put({"who": np.array(666)}, timeout=60)  # waits for the ack; SIGSTOPped meanwhile
    print("wrote", flush=True)
except LeaseLostError as exc:
    print("fenced", exc, flush=True)
"""


@pytest.mark.slow
def test_sigstopped_producer_cannot_write_after_a_takeover(make_exchange):
    opts = {"backend": make_exchange.backend, "address": make_exchange.address,
            "run_id": make_exchange().run_id}
    proc = subprocess.Popen([sys.executable, "-c", STALL_PRODUCER, json.dumps(opts)],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        os.kill(proc.pid, signal.SIGSTOP)  # stalls inside put(), waiting for the ack
        cons = make_exchange().channel("c", "consumer")
        time.sleep(2.6)  # the stalled producer's lease expires
        b = make_exchange(lease_ttl=1.0, resume=True).channel("c", "producer")
        assert int(cons.get(timeout=10)[0]["who"]) == 1  # the ack the stalled put awaits
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
        assert out.startswith("fenced"), (out, err)
        assert b.put({"who": np.array(2)}, timeout=10) == 2
        assert int(cons.get(timeout=10)[0]["who"]) == 2  # never the stalled one's 666
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.communicate()


# -- close racing an acknowledgement ------------------------------------------------------
def test_close_during_get_leaves_the_message_pending(make_exchange):
    ex = make_exchange()
    prod, cons = ex.channel("c", "producer"), ex.channel("c", "consumer")
    prod.put({"x": np.array(7)}, meta={"step": 0})
    expect, errors = BlockingExpect({"step": 0}), []

    def consume():
        try:
            cons.get(timeout=30, expect=expect)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=consume)
    t.start()
    assert expect.entered.wait(30)  # decoded, not yet acknowledged
    cons.close()  # races the acknowledgement
    expect.release.set()
    t.join(30)
    assert len(errors) == 1 and isinstance(errors[0], ChannelClosedError), errors
    got = prod._store.get_many([cons._k_ack, cons._k_closed["consumer"]])
    tomb = json.loads(got[cons._k_closed["consumer"]])
    assert tomb["last_seq"] == int(got[cons._k_ack].split()[0]) == 0
    again = make_exchange().channel("c", "consumer")  # the message is still pending
    assert int(again.get(timeout=10)[0]["x"]) == 7


# -- memcached restart, consumer side -----------------------------------------------------
@pytest.mark.slow
@needs_memcached
@pytest.mark.parametrize("when", ["before_ack", "while_waiting"])
def test_memcached_restart_gives_the_consumer_the_documented_error(when):
    with MemcachedServer(item_size="1m") as server:
        for attempt in range(3):  # every restart, not "about 2 in 3"
            run_id = f"rc{uuid.uuid4().hex[:8]}"
            ex = BlobExchange("memcached", server.address, run_id=run_id, lease_ttl=30)
            prod, cons = ex.channel("c", "producer"), ex.channel("c", "consumer")
            prod.put({"x": np.array(attempt)}, meta={"step": 0})
            if when == "before_ack":
                expect, errors = BlockingExpect({"step": 0}), []
                t = threading.Thread(target=lambda: errors.append(
                    _catch(lambda: cons.get(timeout=30, expect=expect))))
                t.start()
                assert expect.entered.wait(30)
                server.restart()  # between reading the message and acknowledging it
                expect.release.set()
                t.join(60)
                assert isinstance(errors[0], ExchangeStateLostError), errors
            else:
                cons.get(timeout=10)
                server.restart()
                with pytest.raises(ExchangeStateLostError, match="incarnation"):
                    cons.get(timeout=30)
            with pytest.raises(ExchangeStateLostError):  # the producer: the same error
                prod.put({"x": np.array(0)}, timeout=30)
            ex.close()


def _catch(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


# -- busy peers ---------------------------------------------------------------------------
BUSY_PRODUCER = r"""
import json, sys, time
import numpy as np
from lit_roidata.exchange import BlobExchange
o = json.loads(sys.argv[1])
ex = BlobExchange(o["backend"], o["address"], run_id=o["run_id"], lease_ttl=1.0)
ch = ex.channel("c", "producer")
print("ready", flush=True)
with ex.busy("validation"):
    time.sleep(4.0)  # longer than the consumer's timeout
ch.put({"x": np.array(1)})
time.sleep(60)  # idle: sends nothing more
"""


@pytest.mark.slow
def test_busy_peer_pauses_the_timeout_and_is_named_in_the_error(make_exchange):
    opts = {"backend": make_exchange.backend, "address": make_exchange.address,
            "run_id": make_exchange().run_id}
    cons = make_exchange().channel("c", "consumer")
    proc = subprocess.Popen([sys.executable, "-c", BUSY_PRODUCER, json.dumps(opts)],
                            env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        tensors, _ = cons.get(timeout=1.5)  # the producer is busy for 4 s: no timeout
        assert int(tensors["x"]) == 1 and time.monotonic() - t0 > 2.5
        with pytest.raises(ExchangeTimeoutError,
                           match=r"alive but sent nothing; it was last reported "
                                 r"'opened \(after validation\)' \(since"):
            cons.get(timeout=1.0)  # idle now: the timeout applies
    finally:
        proc.kill()
        proc.communicate()


def test_busy_timeout_bounds_the_extension(make_exchange):
    ex = make_exchange(lease_ttl=1.0)
    prod = ex.channel("c", "producer")  # noqa: F841  (kept open)
    cons = make_exchange(busy_timeout=1.0).channel("c", "consumer")
    ex.set_activity("coco evaluation", busy=True)
    t0 = time.monotonic()
    with pytest.raises(ExchangeTimeoutError,
                       match=r"busy with 'coco evaluation'.*extended by 1\.0s.*busy_timeout"):
        cons.get(timeout=0.5)
    assert time.monotonic() - t0 >= 1.4


# -- leftovers, expiries and reuse ----------------------------------------------------------
def test_clean_close_of_both_ends_leaves_no_files(tmp_path):
    root = tmp_path / "exchange"
    ex = BlobExchange("embedded", shm_dir=root, run_id="clean", capacity=3)
    prod, cons = ex.channel("c", "producer"), ex.channel("c", "consumer")
    for i in range(3):
        prod.put({"x": np.array(i)})
    cons.get(timeout=5)  # two messages stay unconsumed
    prod.close()
    assert _files(root)  # the consumer may still drain
    cons.close()
    ex.close()
    assert _files(root) == [] and list(root.iterdir()) == []
    # The run id is free again: a new stream starts at seq 1 without resume=True.
    with BlobExchange("embedded", shm_dir=root, run_id="clean") as ex2:
        assert ex2.channel("c", "producer").next_seq == 1


KILLED_PRODUCER = r"""
import sys
import numpy as np
from lit_roidata.exchange import BlobExchange
ex = BlobExchange("embedded", shm_dir=sys.argv[1], run_id=sys.argv[2], capacity=4,
                  stale_after=None)
ch = ex.channel("c", "producer")
for i in range(3):
    ch.put({"x": np.zeros(1000)})
print("ready", flush=True)
import time; time.sleep(600)
"""


@pytest.mark.slow
def test_start_up_removes_runs_of_dead_owners(tmp_path):
    root = tmp_path / "exchange"
    dead = subprocess.Popen([sys.executable, "-c", KILLED_PRODUCER, str(root), "deadrun"],
                            env=_env(), stdout=subprocess.PIPE, text=True)
    live = subprocess.Popen([sys.executable, "-c", KILLED_PRODUCER, str(root), "liverun"],
                            env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert dead.stdout.readline().strip() == "ready"
        assert live.stdout.readline().strip() == "ready"
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait()
        assert any(f.startswith("deadrun/0/c/msg.") for f in _files(root))
        BlobExchange("embedded", shm_dir=root, run_id="other").close()  # default: 1 h
        assert (root / "deadrun").exists()  # dead, but touched less than an hour ago
        BlobExchange("embedded", shm_dir=root, run_id="other", stale_after=0).close()
        assert not (root / "deadrun").exists()  # payloads and bookkeeping are gone
        assert any(f.startswith("liverun/0/c/msg.") for f in _files(root))  # owner alive
    finally:
        for p in (dead, live):
            p.kill()
            p.communicate()


@pytest.mark.slow
@needs_memcached
def test_memcached_keys_expire(memcached_server):
    ex = BlobExchange("memcached", memcached_server.address, run_id=f"x{uuid.uuid4().hex[:8]}",
                      key_ttl=1)
    prod = ex.channel("c", "producer")
    prod.put({"x": np.zeros(5_000_000, np.uint8)})  # chunked (-I 1m): chunks expire too
    desc = prod._store.get(prod._msg(1))
    chunk0 = prod._msg(1) + f"#{desc[-8:].hex()}#0"
    keys = [ex.incarnation_key, prod._k_head, prod._k_ack, prod._k_gen, prod._msg(1), chunk0,
            prod._k_closed["producer"]]
    ex.close()  # the consumer never came: nothing is deleted, everything expires
    store = prod._store.clone()
    assert store.get_many(keys)
    time.sleep(3.2)
    assert store.get_many(keys) == {}
    store.close()


def test_reusing_a_run_id_needs_resume(make_exchange):
    ex = make_exchange()
    prod = ex.channel("c", "producer")
    prod.put({"x": np.array(1)})
    prod.close()  # no consumer ever came: the stream (one pending message) stays
    with pytest.raises(ExchangeError, match=rf"run id '{ex.run_id}' already has a stream.*"
                                            "resume=True"):
        make_exchange().channel("c", "producer")
    assert make_exchange(resume=True).channel("c", "producer").next_seq == 2


# -- authenticated messages -----------------------------------------------------------------
def test_authenticated_messages_reject_and_count_forgeries_and_replays(make_exchange,
                                                                       monkeypatch):
    monkeypatch.setenv("LIT_ROIDATA_EXCHANGE_SECRET", "s3cret-run-key")
    ex = make_exchange()
    assert ex.authenticated
    prod, cons = ex.channel("c", "producer"), ex.channel("c", "consumer")
    prod.put({"x": np.array(1)}, meta={"step": 0})
    raw = prod._store.get_payload(prod._msg(1))
    assert wire._PREFIX.unpack_from(raw)[2] & wire.FLAG_HMAC
    assert int(cons.get(timeout=5)[0]["x"]) == 1
    attacker = prod._store.clone()  # anyone who can reach the store, without the secret
    # 1. a well-formed unauthenticated message, made visible by bumping head
    attacker.put_payload(prod._msg(2), wire.encode(
        {"x": np.array(666)}, envelope={"seq": 2, "channel": "c", "run_id": ex.run_id,
                                        "rank": 0, "gen": prod._gen}))
    attacker.set(prod._k_head, b"2 0")
    with pytest.raises(ExchangeTimeoutError, match="rejected 1 forged and 0 replayed"):
        cons.get(timeout=0.5)
    # 2. an authentic message replayed at the next position
    attacker.put_payload(prod._msg(2), wire.Encoded([bytes(raw)], len(raw)))
    with pytest.raises(ExchangeTimeoutError, match="rejected 1 forged and 1 replayed"):
        cons.get(timeout=0.5)
    # 3. the same message signed with another run's key (another secret, or another run)
    other = BlobExchange(make_exchange.backend, make_exchange.address, run_id="another",
                         secret="s3cret-run-key")
    attacker.put_payload(prod._msg(2), wire.encode(
        {"x": np.array(667)}, envelope={"seq": 2, "channel": "c", "run_id": ex.run_id,
                                        "rank": 0}, key=other.auth_key))
    other.close()
    with pytest.raises(ExchangeTimeoutError):
        cons.get(timeout=0.5)
    assert cons.rejected == {"forged": 2, "replayed": 1}
    # the real message still goes through (a forged payload in its slot is replaced)
    attacker.put_payload(prod._msg(2), wire.encode({"x": np.array(668)}))
    assert prod.put({"x": np.array(2)}, timeout=5) == 2
    assert int(cons.get(timeout=5)[0]["x"]) == 2
    attacker.close()


def test_secret_settings(make_exchange, tmp_path, monkeypatch):
    monkeypatch.delenv("LIT_ROIDATA_EXCHANGE_SECRET", raising=False)
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-a-file\n")
    monkeypatch.setenv("LIT_ROIDATA_EXCHANGE_SECRET_FILE", str(secret_file))
    signed = make_exchange()
    plain = make_exchange(authenticate=False)
    assert signed.authenticated and not plain.authenticated
    signed.channel("c", "producer").put({"x": np.array(1)})
    with pytest.raises(MessageAuthError, match="no secret to check it"):
        plain.channel("c", "consumer").get(timeout=5)
    monkeypatch.delenv("LIT_ROIDATA_EXCHANGE_SECRET_FILE")
    with pytest.raises(ValueError, match="needs a secret"):
        make_exchange(authenticate=True)
    secret_file.write_text("")
    with pytest.raises(ValueError, match="empty"):
        make_exchange(secret_file=secret_file)


@pytest.mark.slow
@needs_memcached
def test_memcached_restart_with_recover_loses_and_duplicates_nothing():
    with MemcachedServer(item_size="1m") as server:
        kw = {"run_id": f"rv{uuid.uuid4().hex[:8]}", "lease_ttl": 30,
              "on_state_lost": "recover", "capacity": 3}
        ex_p = BlobExchange("memcached", server.address, **kw)
        ex_c = BlobExchange("memcached", server.address, **kw)
        prod, cons = ex_p.channel("c", "producer"), ex_c.channel("c", "consumer")
        big = np.arange(600_000, dtype=np.int32)  # 2.4 MB: chunked, re-sent chunked
        for i in range(1, 4):
            prod.put({"i": np.array(i), "big": big + i})
        assert int(cons.get(timeout=10)[0]["i"]) == 1
        server.restart()  # messages 2 and 3 were only in the server
        got: list[int] = []
        t = threading.Thread(target=lambda: got.extend(
            int(cons.get(timeout=30)[0]["i"]) for _ in range(3)))
        t.start()
        assert prod.put({"i": np.array(4), "big": big + 4}, timeout=30) == 4
        t.join(60)
        assert got == [2, 3, 4]
        with pytest.raises(ExchangeTimeoutError):
            cons.get(timeout=0.3)  # nothing twice
        assert ex_p.incarnation == ex_c.incarnation and len(ex_c.incarnations) == 2
        ex_p.close()
        ex_c.close()
