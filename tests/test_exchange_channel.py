"""BlobExchange channel semantics in one process (threads), on both backends (Detectron semantics:
cross-process exchange).

The cross-process versions (separate producer/consumer processes, killed peers, server
restarts) are in ``test_exchange_ipc.py``.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import numpy as np
import orjson
import pytest

from lit_roidata.exchange import (
    AlignmentError,
    BlobExchange,
    ChannelBusyError,
    ChannelClosedError,
    ExchangeError,
    ExchangeStateLostError,
    ExchangeTimeoutError,
    LeaseLostError,
    PeerDeadError,
    SequenceError,
    check_alignment,
)
from lit_roidata.exchange import wire

try:
    from memcached_server import memcached_server  # noqa: F401  (pytest fixture)
except ImportError:  # tests/ imported as a package
    from tests.memcached_server import memcached_server  # noqa: F401


def _producer_thread(ch, k, start=0, **put_kw):
    def run():
        for i in range(start, start + k):
            ch.put({"i": np.array(i), "v": np.arange(i % 7, dtype=np.float32)},
                   meta={"step": i}, **put_kw)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("capacity", [1, 3])
def test_k_messages_arrive_in_order_exactly_once(make_exchange, capacity):
    ex = make_exchange(capacity=capacity)
    prod, cons = ex.channel("c", "producer"), ex.channel("c", "consumer")
    t = _producer_thread(prod, 40)
    got = []
    for _ in range(40):
        tensors, meta = cons.get(timeout=20)
        assert int(tensors["i"]) == meta["step"]
        np.testing.assert_array_equal(tensors["v"], np.arange(meta["step"] % 7))
        got.append(meta["step"])
    t.join()
    assert got == list(range(40))
    with pytest.raises(ExchangeTimeoutError):
        cons.get(timeout=0.2)  # nothing duplicated after the last one


def test_producer_waits_for_ack_when_capacity_is_full(make_exchange):
    ex = make_exchange()
    prod, cons = ex.channel("c", "producer"), ex.channel("c", "consumer")
    assert prod.put({"x": np.zeros(1)}) == 1
    with pytest.raises(ExchangeTimeoutError, match="acknowledgement of seq 1"):
        prod.put({"x": np.zeros(1)}, timeout=0.2)
    cons.get(timeout=5)
    assert prod.put({"x": np.ones(1)}, timeout=5) == 2
    assert cons.get(timeout=5)[0]["x"][0] == 1.0


def test_second_producer_or_consumer_is_rejected(make_exchange):
    ex = make_exchange()
    ex.channel("c", "producer")
    cons = ex.channel("c", "consumer")
    with pytest.raises(ChannelBusyError, match="already has a producer"):
        make_exchange().channel("c", "producer")
    with pytest.raises(ChannelBusyError, match="already has a consumer"):
        ex.channel("c", "consumer")
    cons.close()
    ex.channel("c", "consumer")  # a closed end can be reopened


def test_namespaces_do_not_collide(make_exchange):
    a, b = make_exchange(rank=0), make_exchange(rank=1)
    other_run = make_exchange(run_id=f"o{uuid.uuid4().hex[:8]}")
    for ex, v in ((a, 0), (b, 1), (other_run, 2)):
        ex.channel("c", "producer").put({"x": np.array(v)})
    for ex, v in ((a, 0), (b, 1), (other_run, 2)):
        assert int(ex.channel("c", "consumer").get(timeout=5)[0]["x"]) == v


def test_consumer_without_producer_times_out_within_bound(make_exchange):
    cons = make_exchange().channel("c", "consumer")
    start = time.monotonic()
    with pytest.raises(ExchangeTimeoutError) as err:
        cons.get(timeout=0.5)
    elapsed = time.monotonic() - start
    assert 0.5 <= elapsed < 10.0
    assert "channel 'c'" in str(err.value) and "no producer is connected" in str(err.value)


@pytest.mark.parametrize("how", ["close", "stop_event"])
def test_shutdown_wakes_a_waiting_consumer(make_exchange, how):
    stop = threading.Event()
    ex = make_exchange(stop_event=stop)
    cons = ex.channel("c", "consumer")
    errors = []

    def wait():
        try:
            cons.get(timeout=60)
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.2)
    cons.close() if how == "close" else stop.set()
    t.join(timeout=10)
    assert not t.is_alive(), "get() did not wake up"
    assert len(errors) == 1 and isinstance(errors[0], ChannelClosedError)


def test_reinitialising_keeps_a_pending_message(make_exchange):
    ex = make_exchange(capacity=2)
    prod = ex.channel("c", "producer")
    prod.put({"x": np.array(1)})
    prod.close()
    with pytest.raises(ExchangeError, match=f"run id '{ex.run_id}' already has a stream.*"
                                            "resume=True"):
        make_exchange(capacity=2).channel("c", "producer")  # reuse is never silent
    prod = make_exchange(capacity=2, resume=True).channel("c", "producer")  # restarted
    assert prod.next_seq == 2
    prod.put({"x": np.array(2)})
    cons = make_exchange().channel("c", "consumer")
    assert int(cons.get(timeout=5)[0]["x"]) == 1
    cons.close()
    cons = make_exchange(resume=True).channel("c", "consumer")  # a restarted consumer
    assert int(cons.get(timeout=5)[0]["x"]) == 2


def test_consumer_sees_producer_close_after_draining(make_exchange):
    ex = make_exchange(capacity=2)
    prod, cons = ex.channel("c", "producer"), ex.channel("c", "consumer")
    prod.put({"x": np.array(1)})
    prod.close()
    assert int(cons.get(timeout=5)[0]["x"]) == 1  # pending message still delivered
    with pytest.raises(ChannelClosedError, match="closed the channel after seq 1"):
        cons.get(timeout=5)


def test_alignment_mismatch_names_the_field_and_keeps_the_message(make_exchange):
    ex = make_exchange()
    prod, cons = ex.channel("c", "producer"), ex.channel("c", "consumer")
    meta = {"step": 4, "image_ids": [11, 12], "flipped": [False, True], "im_scales": [1.5, 2.0]}
    prod.put({"x": np.zeros((2, 3))}, meta=meta)
    bad = dict(meta, flipped=[False, False])
    with pytest.raises(AlignmentError, match=r"'flipped\[1\]'"):
        cons.get(timeout=5, expect=bad)
    tensors, got = cons.get(timeout=5, expect=dict(meta, shapes={"x": (2, 3)}))
    assert got == meta and tensors["x"].shape == (2, 3)


def test_check_alignment_rules():
    meta = {"step": 3, "im_scales": [1.2000001], "image_ids": [1, 2], "flipped": [True]}
    check_alignment(meta, {"step": 3, "im_scales": np.array([1.2]), "flipped": (True,)})
    for expected, field in [({"step": 4}, "'step'"), ({"image_ids": [1, 3]}, r"'image_ids\[1\]'"),
                            ({"image_ids": [1]}, "'image_ids'"),
                            ({"im_scales": [1.3]}, r"'im_scales\[0\]'"),
                            ({"flipped": [1]}, r"'flipped\[0\]'")]:
        with pytest.raises(AlignmentError, match=field):
            check_alignment(meta, expected, where="channel 'c'")
    with pytest.raises(AlignmentError, match="no alignment field 'rank'"):
        check_alignment(meta, {"rank": 0})
    with pytest.raises(AlignmentError, match="shapes.x"):
        check_alignment({}, {"shapes": {"x": [2]}}, tensors={"x": np.zeros(3)})


def test_cross_wired_payload_is_a_sequence_error(make_exchange):
    ex = make_exchange()
    cons = ex.channel("c", "consumer")
    prod = ex.channel("c", "producer")
    # A payload stamped for another channel appears under this channel's next key.
    stray = wire.encode({"x": np.zeros(1)}, envelope={"seq": 1, "channel": "other",
                                                       "run_id": ex.run_id, "rank": 0})
    prod._store.put_payload(prod._msg(1), stray)
    prod._fenced_set(prod._k_head, 1, None)  # published as far as head is concerned
    with pytest.raises(SequenceError, match="cross-wired"):
        cons.get(timeout=5)


@pytest.mark.slow
def test_dead_owner_lease_is_taken_over(make_exchange, caplog):
    ex = make_exchange()
    ch = ex.channel("c", "producer")
    # Forge the lease of a process that has exited (same host, so the PID check applies).
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rec = orjson.loads(ch._lease)
    rec.update(pid=dead.pid, token="dead", create_time=0.0)
    key = ch._k_lease["producer"]
    ch._ex.forget(ch)  # stop our heartbeat so the forged record stays
    ch._store.set(key, orjson.dumps(rec), ttl=30)
    with caplog.at_level(logging.WARNING):
        ex2 = make_exchange()
        ex2.channel("c", "producer")
    assert "took over the lease" in caplog.text


def test_stalled_owner_loses_its_lease(make_exchange):
    ex = make_exchange(lease_ttl=0.5)
    ch = ex.channel("c", "producer")
    ch._store.set(ch._k_lease["producer"], b'{"not": "ours"}', ttl=30)
    deadline = time.monotonic() + 10
    while ch._lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(LeaseLostError, match="lost its lease"):
        ch.put({"x": np.zeros(1)})


def test_own_rejoin_during_a_heartbeat_is_not_a_lost_lease(make_exchange):
    # Recover mode: this end replaces its lease (a rejoin after a state loss) between the
    # heartbeat's refresh of the old one and its check; that is no take-over.
    ex = make_exchange(on_state_lost="recover")
    ch = ex.channel("c", "producer")
    store, lease = ex.store.clone(), ch._lease

    def cas(key, expected, new, ttl=0):
        ch._lease = b"the rejoined lease"
        return False

    store.cas = cas
    ch.heartbeat(store)
    ch._lease = lease
    assert ch._lost is None
    store.close()


def test_expired_peer_lease_is_reported_as_dead(make_exchange):
    ex = make_exchange(lease_ttl=1.0)
    prod = ex.channel("c", "producer")
    cons = make_exchange(lease_ttl=1.0).channel("c", "consumer")
    with pytest.raises(ExchangeTimeoutError, match="alive but sent nothing"):
        cons.get(timeout=0.3)
    ex.forget(prod)  # the producer stops heart-beating, as if frozen on another host
    with pytest.raises(PeerDeadError, match="stopped heart-beating"):
        cons.get(timeout=30)


def test_wrong_role_and_bad_arguments(make_exchange):
    ex = make_exchange()
    with pytest.raises(TypeError):
        ex.channel("c", "consumer").put({})
    with pytest.raises(TypeError):
        ex.channel("c", "producer").get(0.1)
    with pytest.raises(ValueError, match="role"):
        ex.channel("d", "reader")
    with pytest.raises(ValueError, match="channel name"):
        ex.channel("a b", "producer")
    with pytest.raises(ValueError, match="run_id"):
        BlobExchange("embedded", run_id="has space")
    with pytest.raises(ValueError, match="backend"):
        BlobExchange("redis", run_id="x")


def test_large_payload_roundtrip_5mb(make_exchange):
    ex = make_exchange()
    prod, cons = ex.channel("big", "producer"), ex.channel("big", "consumer")
    blob = np.random.default_rng(0).standard_normal((1, 12, 200, 530)).astype(np.float32)
    assert blob.nbytes > 5_000_000
    prod.put({"rpn_cls_probs_fpn2": blob, "small": np.arange(3)}, meta={"step": 0})
    tensors, _ = cons.get(timeout=20)
    np.testing.assert_array_equal(tensors["rpn_cls_probs_fpn2"], blob)
    if make_exchange.backend == "memcached":
        assert prod._store.chunk_size < blob.nbytes  # it really was chunked (-I 1m)


def test_memcached_eviction_is_detected_not_waited_on(make_exchange):
    if make_exchange.backend != "memcached":
        pytest.skip("eviction is a memcached property")
    ex = make_exchange()
    prod, cons = ex.channel("c", "producer"), ex.channel("c", "consumer")
    prod.put({"x": np.zeros(10)})
    prod._store.delete_payload(prod._msg(1))  # as if LRU-evicted before the consumer read
    with pytest.raises(ExchangeStateLostError, match="seq 1 was published"):
        cons.get(timeout=20)
    # A lost chunk of a chunked payload is reported too.
    big = np.zeros(3_000_000, np.uint8)
    cons.close()
    prod._store.set(prod._k_ack, b"1")
    prod.put({"x": big}, timeout=5)
    desc = prod._store.get(prod._msg(2))
    writer = desc[-8:].hex()  # the descriptor names the writer's chunk keys
    prod._store.delete(prod._msg(2) + f"#{writer}#1")
    cons = make_exchange(resume=True).channel("c", "consumer")
    with pytest.raises(ExchangeStateLostError, match="chunk 1/"):
        cons.get(timeout=5)


@pytest.mark.parametrize("drop", ["after_payload_write", "at_head_update"])
def test_put_retries_a_dropped_connection_without_duplicates(make_exchange, monkeypatch, drop):
    from lit_roidata.exchange.backend import StoreUnavailable

    ex = make_exchange(capacity=2)
    prod, cons = ex.channel("c", "producer"), ex.channel("c", "consumer")
    store, dropped = prod._store, []
    real_put = store.put_payload

    def put_payload(key, encoded, ttl=0):
        real_put(key, encoded, ttl)  # the write reaches the server, the reply is lost
        if drop == "after_payload_write" and not dropped:
            dropped.append(key)
            raise StoreUnavailable("simulated connection drop")

    real_cas = store.cas

    def cas(key, expected, new, ttl=0):
        ok = real_cas(key, expected, new, ttl)  # the write reaches the server ...
        if drop == "at_head_update" and key.endswith("/head") and not dropped:
            dropped.append(key)
            raise StoreUnavailable("simulated connection drop")  # ... the reply is lost
        return ok

    real_fence = store.fence

    def fence(key, new, gen):  # the embedded store's one-step fenced write
        out = real_fence(key, new, gen)
        if drop == "at_head_update" and key.endswith("/head") and not dropped:
            dropped.append(key)
            raise StoreUnavailable("simulated connection drop")
        return out

    monkeypatch.setattr(store, "put_payload", put_payload)
    monkeypatch.setattr(store, "cas", cas)
    monkeypatch.setattr(store, "fence", fence)
    assert prod.put({"x": np.array(1)}, timeout=10) == 1
    assert prod.put({"x": np.array(2)}, timeout=10) == 2
    assert dropped
    assert [int(cons.get(timeout=5)[0]["x"]) for _ in range(2)] == [1, 2]
    with pytest.raises(ExchangeTimeoutError):
        cons.get(timeout=0.2)
