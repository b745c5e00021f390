"""One producer → one consumer channel with exactly-once, in-order delivery (spec §8.4).

Keys of a channel live under ``<run_id>/<rank>/<name>/`` (spec §8.4.3):

=================  ==============================================================
``head``           last sequence number the producer published (bookkeeping)
``ack``            last sequence number the consumer took (the acknowledgement)
``msg.<seq>``      the payload of message ``seq``, written once (§8.4.2)
``lease.<role>``   the owner of each end, with a TTL refreshed by a heartbeat
``closed.<role>``  tombstone left by a clean ``close()`` (§8.4.9)
=================  ==============================================================

Protocol (§8.4.1): the producer writes ``msg.<s>`` only when ``ack >= s - capacity``
(capacity 1 by default: the fork's one-slot mailbox), then sets ``head``. The consumer
reads ``head`` and then ``msg.<ack+1>``, checks the sequence number inside the payload,
sets ``ack`` and deletes the payload. Opening a channel creates ``head``/``ack`` with
``add`` (never overwrites), so a restarted end resumes where the stream is and a pending
message is never discarded (§8.4.4). Waiting backs off exponentially, is bounded by a
timeout, and wakes on ``close()`` or a stop event (§8.4.5, §8.4.9).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import orjson

from lit_roidata.exchange import wire
from lit_roidata.exchange.alignment import check_alignment
from lit_roidata.exchange.errors import (
    ChannelBusyError,
    ChannelClosedError,
    ExchangeStateLostError,
    ExchangeTimeoutError,
    LeaseLostError,
    PeerDeadError,
    SequenceError,
)
from lit_roidata.exchange.lease import LeaseRecord, peer_liveness
from lit_roidata.exchange.store import Store, StoreUnavailable

if TYPE_CHECKING:
    from lit_roidata.exchange import BlobExchange

__all__ = ["Channel"]

log = logging.getLogger(__name__)
ROLES = ("producer", "consumer")
_PEER_CHECK_EVERY = 0.05  # seconds between lease/pid checks of the peer while waiting


class Channel:
    """One end (producer or consumer) of a named channel; made by ``BlobExchange.channel``.

    Args:
        exchange: the owning exchange (run id, rank, backend, timing settings).
        name: channel name, e.g. ``"teacher_rpn"``.
        role: ``"producer"`` or ``"consumer"``.
        capacity: messages the producer may publish ahead of the consumer's ack.
        timeout: default timeout in seconds of ``put``/``get``.

    Raises:
        ChannelBusyError: another live process (or object) holds this end of the channel.
    """

    def __init__(self, exchange: BlobExchange, name: str, role: str, *, capacity: int,
                 timeout: float) -> None:
        self.name, self.role = name, role
        self.peer_role = ROLES[1 - ROLES.index(role)]
        self.capacity, self.timeout = capacity, timeout
        self._ex = exchange
        self._store: Store = exchange._store.clone()
        self._io = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._lost: str | None = None
        self._lost_type: type[Exception] = LeaseLostError
        self._peer_seen: LeaseRecord | None = None
        self._peer_checked = 0.0
        ns = f"{exchange.run_id}/{exchange.rank}/{name}"
        self._k_head, self._k_ack = f"{ns}/head", f"{ns}/ack"
        self._k_lease = {r: f"{ns}/lease.{r}" for r in ROLES}
        self._k_closed = {r: f"{ns}/closed.{r}" for r in ROLES}
        self._k_inc = exchange._incarnation_key
        self._ns = ns
        self.where = (f"channel {name!r} ({role}; run {exchange.run_id!r}, rank "
                      f"{exchange.rank}, {self._store.describe})")
        with self._io:
            self._lease = self._acquire_lease()
            try:
                self._next = self._init_position()
            except BaseException:
                self._release()
                raise

    # -- opening -------------------------------------------------------------------------
    def _acquire_lease(self) -> bytes:
        mine = LeaseRecord.mine(self.role).dumps()
        key, ttl, s = self._k_lease[self.role], self._ex.lease_ttl, self._store
        for _ in range(10):
            if s.add(key, mine, ttl):
                return mine
            raw = s.get(key)
            if raw is None:
                continue  # expired between add and get
            owner = LeaseRecord.loads(raw)
            if owner is not None and peer_liveness(owner) == "alive":
                raise ChannelBusyError(
                    f"{self.where}: this channel already has a {self.role}: "
                    f"{owner.describe()}, opened {time.time() - owner.opened_at:.1f}s ago. "
                    f"A channel has exactly one producer and one consumer (spec §8.4.3): use "
                    f"another channel name, rank or run id. If that process is gone, its "
                    f"lease expires within {ttl:g}s.")
            if s.cas(key, raw, mine, ttl):
                log.warning("%s: took over the lease of %s, which is no longer running",
                            self.where, owner.describe() if owner else "an unreadable owner")
                return mine
        raise ChannelBusyError(f"{self.where}: could not acquire the {self.role} lease "
                               "(contention with other processes opening it)")

    def _init_position(self) -> int:
        s = self._store
        s.add(self._k_head, b"0")
        s.add(self._k_ack, b"0")
        s.delete(self._k_closed[self.role])
        got = s.get_many([self._k_inc, self._k_head, self._k_ack])
        self._check_incarnation(got)
        head, ack = self._int(got, self._k_head), self._int(got, self._k_ack)
        if self.role == "consumer":
            if ack:
                s.delete_payload(self._msg(ack))  # taken, but a crash kept it from deletion
            return ack + 1
        last = max(head, ack)
        while s.exists(self._msg(last + 1)):  # published, but a crash kept head behind
            last += 1
        if last != head:
            s.set(self._k_head, str(last).encode())
        return last + 1

    # -- helpers ---------------------------------------------------------------------------
    def _msg(self, seq: int) -> str:
        return f"{self._ns}/msg.{seq:012d}"

    def _int(self, got: Mapping[str, bytes], key: str) -> int:
        raw = got.get(key)
        if raw is None:
            raise ExchangeStateLostError(
                f"{self.where}: key {key!r} vanished from {self._store.describe} (evicted, or "
                "the server restarted); the stream position is lost. Restart both processes "
                "with a new run id and give memcached enough memory (-m)")
        return int(raw)

    def _check_incarnation(self, got: Mapping[str, bytes]) -> None:
        value = got.get(self._k_inc)
        if value != self._ex.incarnation:
            state = "is missing" if value is None else "changed"
            raise ExchangeStateLostError(
                f"{self.where}: the run's incarnation key {state} on {self._store.describe}: "
                "the server restarted (or evicted this run's keys) after this process joined, "
                "so messages may have been lost and old data must not be trusted. Restart "
                "both processes with a new run id (spec §8.4.6)")

    def _check_usable(self) -> None:
        if self._closing:
            raise ChannelClosedError(f"{self.where}: this end was closed")
        if self._lost:
            raise self._lost_type(self._lost)
        stop = self._ex.stop_event
        if stop is not None and stop.is_set():
            raise ChannelClosedError(f"{self.where}: stop requested (the exchange's stop "
                                     "event is set)")

    def _check_peer(self, waiting_for: str) -> None:
        """While waiting (at most every 50 ms): raise if the peer closed or died.

        The lease is read before the tombstone: a peer that closes writes the tombstone
        first and then drops its lease, so "no lease and no tombstone" means it died.
        """
        now = time.monotonic()
        if now - self._peer_checked < _PEER_CHECK_EVERY:
            return
        with self._io:
            self._check_usable()
            got = self._store.get_many([self._k_lease[self.peer_role],
                                        self._k_closed[self.peer_role]])
        self._peer_state(got, waiting_for)

    def _peer_state(self, got: Mapping[str, bytes], waiting_for: str) -> None:
        """Raise if the peer closed or died; remember it when it is alive."""
        closed = got.get(self._k_closed[self.peer_role])
        raw = got.get(self._k_lease[self.peer_role])
        rec = LeaseRecord.loads(raw) if raw is not None else None
        if closed is not None and rec is None:
            info = orjson.loads(closed)
            raise ChannelClosedError(
                f"{self.where}: the {self.peer_role} (pid {info.get('pid')} on "
                f"{info.get('hostname')}) closed the channel after seq {info.get('last_seq')} "
                f"while this end waited for {waiting_for}")
        self._peer_checked = time.monotonic()
        state = peer_liveness(rec)
        if state == "alive":
            self._peer_seen = rec
        elif state == "dead":
            raise PeerDeadError(f"{self.where}: the {rec.describe()} is no longer running "
                                f"(its process is gone); this end waited for {waiting_for}")
        elif self._peer_seen is not None:
            raise PeerDeadError(
                f"{self.where}: the {self._peer_seen.describe()} stopped heart-beating (its "
                f"lease expired after {self._ex.lease_ttl:g}s); this end waited for "
                f"{waiting_for}")

    def _wait(self, backoff: list[float], deadline: float, what: str, timeout: float,
              unreachable: str | None) -> None:
        self._check_usable()
        now = time.monotonic()
        if now >= deadline:
            if unreachable:
                peer = f"{self._store.describe} was unreachable: {unreachable}"
            elif self._peer_seen is not None:
                peer = f"the {self._peer_seen.describe()} is alive but sent nothing"
            else:
                peer = (f"no {self.peer_role} is connected (none has opened channel "
                        f"{self.name!r} with run id {self._ex.run_id!r} and rank "
                        f"{self._ex.rank}; start it with the same values)")
            raise ExchangeTimeoutError(f"{self.where}: no {what} within {timeout:g}s; {peer}")
        self._wake.wait(min(backoff[0], deadline - now))
        backoff[0] = min(backoff[0] * 2, self._ex.poll_max)
        self._check_usable()

    # -- public API ------------------------------------------------------------------------
    def put(self, tensors: Mapping[str, Any], meta: Mapping[str, Any] | None = None, *,
            timeout: float | None = None) -> int:
        """Publish one message; wait (bounded) while ``capacity`` messages are unacknowledged.

        Args:
            tensors: name → NumPy array / torch tensor (any dtype and shape, see
                :mod:`lit_roidata.exchange.wire`).
            meta: JSON-serialisable metadata, e.g. alignment fields (step, image ids,
                flipped, scales).
            timeout: seconds to wait for the consumer's acknowledgement; default: the
                channel's timeout.

        Returns:
            The message's sequence number (1, 2, ...).

        Raises:
            ExchangeTimeoutError, PeerDeadError, ChannelClosedError, LeaseLostError,
            ExchangeStateLostError, WireFormatError: see :mod:`~lit_roidata.exchange.errors`.
        """
        if self.role != "producer":
            raise TypeError(f"{self.where}: put() needs a producer channel")
        self._check_usable()
        seq = self._next
        encoded = wire.encode(tensors, meta, envelope={
            "seq": seq, "channel": self.name, "run_id": self._ex.run_id, "rank": self._ex.rank})
        timeout = self.timeout if timeout is None else timeout
        deadline, backoff, unreachable = time.monotonic() + timeout, [self._ex.poll_min], None
        what = f"acknowledgement of seq {seq - self.capacity} from the consumer"
        keys = [self._k_inc, self._k_ack]
        state = {"stored": False, "failed": False}  # survives retries of this message
        while True:
            try:
                with self._io:
                    self._check_usable()
                    got = self._store.get_many(keys)
                self._check_incarnation(got)
                if self._int(got, self._k_ack) >= seq - self.capacity:
                    with self._io:
                        self._check_usable()
                        self._publish(seq, encoded, state)
                    self._next = seq + 1
                    return seq
                self._check_peer(what)
                unreachable = None
            except StoreUnavailable as exc:
                unreachable = str(exc)
            self._wait(backoff, deadline, what, timeout, unreachable)

    def _publish(self, seq: int, encoded: wire.Encoded, state: dict[str, bool]) -> None:
        """Write the payload once, then advance ``head``; safe to retry after a failure."""
        key = self._msg(seq)
        if not state["stored"] and state["failed"]:
            state["stored"] = self._store.exists(key)  # did the lost request get through?
        if not state["stored"]:
            try:
                self._store.put_payload(key, encoded)
            except StoreUnavailable:
                state["failed"] = True
                raise
            state["stored"] = True
        self._store.set(self._k_head, str(seq).encode())

    def get(self, timeout: float | None = None, *, expect: Mapping[str, Any] | None = None,
            as_torch: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """Take the next message, in order and exactly once.

        Args:
            timeout: seconds to wait; default: the channel's timeout.
            expect: alignment fields this process expects (see
                :func:`~lit_roidata.exchange.alignment.check_alignment`); a mismatch raises
                before the message is acknowledged, so it stays pending.
            as_torch: return torch tensors instead of NumPy arrays (bfloat16/float8 are
                always tensors, NumPy has no such dtype).

        Returns:
            ``(tensors, meta)``.

        Raises:
            ExchangeTimeoutError: nothing arrived in time (names the channel and the peer).
            PeerDeadError / ChannelClosedError: the producer died / closed the channel
                (after every pending message was delivered).
            SequenceError, WireFormatError, AlignmentError, ExchangeStateLostError,
            LeaseLostError: see :mod:`~lit_roidata.exchange.errors`.
        """
        if self.role != "consumer":
            raise TypeError(f"{self.where}: get() needs a consumer channel")
        self._check_usable()
        seq = self._next
        timeout = self.timeout if timeout is None else timeout
        deadline, backoff, unreachable = time.monotonic() + timeout, [self._ex.poll_min], None
        what = f"message seq {seq} from the producer"
        small = [self._k_inc, self._k_head]
        while True:
            try:
                with self._io:
                    self._check_usable()
                    got, buf = self._store.read_message(small, self._msg(seq))
                self._check_incarnation(got)
                if buf is not None:
                    break
                head = self._int(got, self._k_head)
                if head >= seq:
                    raise ExchangeStateLostError(
                        f"{self.where}: message seq {seq} was published (producer head is "
                        f"{head}) but is gone from {self._store.describe}: evicted or deleted. "
                        "Give memcached more memory (-m) and restart with a new run id")
                self._check_peer(what)
                unreachable = None
            except StoreUnavailable as exc:
                unreachable = str(exc)
            self._wait(backoff, deadline, what, timeout, unreachable)
        where = f"{self.where}, seq {seq}"
        msg = wire.decode(buf, as_torch=as_torch, where=f" on {where}")
        env = msg.envelope
        if (env.get("seq"), env.get("channel"), env.get("run_id"), env.get("rank")) != \
                (seq, self.name, self._ex.run_id, self._ex.rank):
            raise SequenceError(f"{where}: the payload is stamped {env}, expected seq {seq} of "
                                "this channel: duplicate, gap or cross-wired message")
        if expect is not None:
            check_alignment(msg.meta, expect, where=where, tensors=msg.tensors)
        with self._io:
            self._store.set(self._k_ack, str(seq).encode())
            self._next = seq + 1
            try:
                self._store.delete_payload(self._msg(seq))
            except StoreUnavailable:
                log.warning("%s: could not delete the payload of seq %d (server "
                            "unreachable); it is removed when the channel reopens", where, seq)
        return msg.tensors, msg.meta

    @property
    def next_seq(self) -> int:
        """The sequence number of the next message this end will put or get."""
        return self._next

    def _beat(self, store: Store) -> None:
        """Refresh this end's lease (called by the exchange's heartbeat thread)."""
        if self._closing or self._lost:
            return
        key = self._k_lease[self.role]
        try:
            if store.cas(key, self._lease, self._lease, self._ex.lease_ttl):
                return
        except StoreUnavailable:
            return
        if self._closing:
            return
        try:
            incarnation = store.get(self._k_inc)
        except StoreUnavailable:
            return
        if incarnation != self._ex.incarnation:  # a restart, not a take-over: say so
            self._lost_type = ExchangeStateLostError
            self._lost = (f"{self.where}: the run's incarnation key is "
                          f"{'missing' if incarnation is None else 'changed'} on "
                          f"{self._store.describe}: the server restarted (or evicted this "
                          "run's keys); messages may be lost. Restart both processes with a "
                          "new run id (spec §8.4.6)")
            self._wake.set()
            return
        self._lost = (f"{self.where}: this end lost its lease (it expired or another process "
                      f"took it over, e.g. after this process stalled for more than "
                      f"{self._ex.lease_ttl:g}s); stop using this channel")
        self._wake.set()

    def _release(self) -> None:
        key = self._k_lease[self.role]
        if self._store.get(key) == self._lease:
            self._store.delete(key)

    def close(self) -> None:
        """Leave a tombstone, release the lease and wake a waiting ``get``/``put``.

        Safe to call from another thread (a blocked ``get`` then raises
        :class:`ChannelClosedError`) and more than once.
        """
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        self._ex._forget(self)
        with self._io:
            try:
                if not self._lost:
                    tomb = orjson.dumps({"last_seq": self._next - 1, "pid": os.getpid(),
                                         "hostname": LeaseRecord.loads(self._lease).hostname,
                                         "time": time.time()})
                    self._store.set(self._k_closed[self.role], tomb)
                    self._release()
            except Exception as exc:  # closing must not raise on a dead backend
                log.warning("%s: could not close cleanly: %s", self.where, exc)
            finally:
                self._store.close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Channel {self.where}, next seq {self._next}>"

