"""One producer → one consumer channel with exactly-once, in-order delivery.

Keys live under ``<run_id>/<rank>/<name>/``; docs/exchange.md describes the protocol, the
lease fencing and the recovery.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson

import lit_roidata.exchange.wire as wire
from lit_roidata.exchange.alignment import check_alignment
from lit_roidata.exchange.errors import (ChannelBusyError, ChannelClosedError, ExchangeError,
                                         ExchangeStateLostError, ExchangeTimeoutError,
                                         LeaseLostError, MessageAuthError, PeerDeadError,
                                         SequenceError, WireFormatError)
from lit_roidata.exchange.lease import LeaseRecord, peer_liveness
from lit_roidata.exchange.backend import Store, StoreUnavailable

__all__ = ["Channel"]

log = logging.getLogger(__name__)
ROLES = ("producer", "consumer")
DELIVERY = ("at_most_once", "exactly_once")
_PEER_CHECK_EVERY = 0.05  # seconds between lease/pid checks of the peer while waiting


def _seq(raw: bytes) -> int:
    return int(raw.split(b" ", 1)[0])


def _gen(raw: bytes) -> int:
    return int(raw.split(b" ", 1)[1]) if b" " in raw else 0


class _Rejoined(Exception):
    """Raised inside a poll after a recovery from a state loss: poll again at once."""


class Channel:
    """One end (producer or consumer) of a named channel, made (and its arguments and
    errors documented) by :meth:`BlobExchange.channel`."""

    def __init__(self, exchange: Any, name: str, role: str, *, capacity: int,
                 timeout: float, start_seq: int | None = None,
                 delivery: str = "at_most_once") -> None:
        if delivery not in DELIVERY:
            raise ValueError(f"delivery must be one of {DELIVERY}, got {delivery!r}")
        if start_seq is not None and (role != "consumer" or start_seq < 1):
            raise ValueError("start_seq is a consumer's next sequence number (>= 1)")
        self.name, self.role, self.peer_role = name, role, ROLES[1 - ROLES.index(role)]
        self.capacity, self.timeout, self.delivery = capacity, timeout, delivery
        self._ex = exchange
        self._store: Store = exchange.store.clone()
        self._io, self._wake = threading.Lock(), threading.Event()
        self._closing, self._lost, self._lost_type = False, None, LeaseLostError
        self._peer_seen: LeaseRecord | None = None
        self._peer_activity: dict[str, Any] | None = None
        self._peer_checked, self._resend, self._committed = 0.0, False, 0
        #: Messages rejected by this consumer: ``forged`` (no/bad HMAC) and ``replayed``
        #: (authentic, but stamped for another position, channel, run or incarnation).
        self.rejected = {"forged": 0, "replayed": 0}
        self._ns = ns = f"{exchange.run_id}/{exchange.rank}/{name}"
        self._k_head, self._k_ack, self._k_gen, self._k_commit = (
            f"{ns}/{k}" for k in ("head", "ack", "gen", "commit"))
        self._k_lease, self._k_closed, self._k_activity = (
            {r: f"{ns}/{k}.{r}" for r in ROLES} for k in ("lease", "closed", "activity"))
        self._k_inc, self._incarnation = exchange.incarnation_key, exchange.incarnation
        self._pending: dict[int, wire.Encoded] = {}  # recover mode: unacknowledged messages
        #: head/ack value this end wrote last: the expected value of its next fenced write
        #: (a write by anyone else in between fails the compare-and-swap: then it is re-read).
        self._written: dict[str, bytes] = {}
        self.where = (f"channel {name!r} ({role}; run {exchange.run_id!r}, rank "
                      f"{exchange.rank}, {self._store.describe})")
        with self._io:
            self._lease, self._gen = self._acquire_lease()
            try:
                self._next = self._init_position(start_seq)
                self._write_activity(self._store)
            except BaseException:
                self._release()
                self._store.close()
                raise

    def _acquire_lease(self, old: bytes | None = None) -> tuple[bytes, int]:
        """Take this end's lease with a new generation: ``(record, gen)``. ``old``: this
        end's own record from before a state loss (replaced, not a rival)."""
        key, ttl, s = self._k_lease[self.role], self._ex.lease_ttl, self._store
        gen = s.incr(self._k_gen)
        mine = LeaseRecord.mine(self.role, gen).dumps()
        for _ in range(10):
            if s.add(key, mine, ttl):
                return mine, gen
            raw = s.get(key)
            if raw is None:
                continue  # expired between add and get
            owner = LeaseRecord.loads(raw)
            if raw != old and owner is not None and peer_liveness(owner) == "alive":
                if old is not None:
                    raise ChannelBusyError(f"{self.where}: after the state loss, "
                                           f"{owner.describe()} holds this end's lease")
                raise ChannelBusyError(
                    f"{self.where}: this channel already has a {self.role}: {owner.describe()}, "
                    f"opened {time.time() - owner.opened_at:.1f}s ago. A channel has exactly one "
                    "producer and one consumer: use another channel name, rank or run id. If that "
                    f"process is gone, its lease expires within {ttl:g}s.")
            if s.cas(key, raw, mine, ttl):
                if raw != old:
                    log.warning("%s: took over the lease of %s, which is no longer running",
                                self.where, owner.describe() if owner else "an unreadable owner")
                return mine, gen
        raise ChannelBusyError(f"{self.where}: could not acquire the {self.role} lease "
                               "(contention with other processes opening it)")

    def _init_position(self, start_seq: int | None) -> int:
        s = self._store
        s.add(self._k_head, b"0 0")
        s.add(self._k_ack, b"0 0")
        got = s.get_many([self._k_inc, self._k_head, self._k_ack, self._k_closed[self.role],
                          self._k_commit])
        self._check_incarnation(got)
        head, ack = self._int(got, self._k_head), self._int(got, self._k_ack)
        prior = ack if self.role == "consumer" else max(head, ack)
        if prior and not self._ex.resume:
            raise ExchangeError(
                f"{self.where}: run id {self._ex.run_id!r} already has a stream on this "
                f"channel (producer head {head}, consumer ack {ack}), left by an earlier "
                f"{self.role}. Pass resume=True to BlobExchange to continue that stream, or "
                "use a new run id for a new one")
        s.delete(self._k_closed[self.role])
        if self.role == "consumer":
            self._committed = int(got.get(self._k_commit, b"0"))
            if start_seq is None:
                if ack and self.delivery == "at_most_once":
                    s.delete_payload(self._msg(ack))  # taken, but a crash kept it
                self._fenced_set(self._k_ack, ack, got[self._k_ack])
                return ack + 1
            if start_seq - 1 > ack:
                raise SequenceError(
                    f"{self.where}: the checkpoint says seq {start_seq - 1} was consumed, "
                    f"but the stream's ack is {ack}: the checkpoint belongs to another "
                    "stream (run id) or the exchange state was reset")
            for seq in range(start_seq, min(ack, head) + 1):
                if not s.exists(self._msg(seq)):
                    raise ExchangeStateLostError(
                        f"{self.where}: resuming from the checkpoint needs message seq {seq} "
                        f"again, but it is gone (the stream acknowledged up to {ack}). "
                        "Exactly-once resume needs delivery='exactly_once' on the consumer "
                        "that wrote the checkpoint")
            self._fenced_set(self._k_ack, start_seq - 1, got[self._k_ack])
            return start_seq
        last = max(head, ack)
        while self._orphan_is_valid(last + 1):  # published, but a crash kept head behind
            last += 1
        self._fenced_set(self._k_head, last, got[self._k_head])
        return last + 1

    def _orphan_is_valid(self, seq: int) -> bool:
        """Whether an unpublished payload at ``seq`` is a well-formed message of this
        channel (adopted by a restarted producer); anything else there is removed."""
        key = self._msg(seq)
        if not self._store.exists(key):
            return False
        env = self._payload_envelope(key)
        if env is not None and env.get("seq") == seq and env.get("channel") == self.name:
            return True
        self._store.delete_payload(key)
        return False

    def _payload_envelope(self, key: str) -> dict[str, Any] | None:
        buf = self._store.get_payload(key)
        try:
            return None if buf is None else wire.read_envelope(buf, key=self._ex.auth_key)
        except WireFormatError:
            return None

    def _msg(self, seq: int) -> str:
        return f"{self._ns}/msg.{seq:012d}"

    def _int(self, got: Mapping[str, bytes], key: str) -> int:
        raw = got.get(key)
        if raw is None:
            raise ExchangeStateLostError(
                f"{self.where}: key {key!r} vanished from {self._store.describe} (evicted, or "
                "the server restarted); the stream position is lost. Restart both processes "
                "with a new run id and give memcached enough memory (-m)")
        return _seq(raw)

    def _incarnation_lost(self, value: bytes | None) -> str:
        return (f"{self.where}: the run's incarnation key "
                f"{'is missing' if value is None else 'changed'} on {self._store.describe}: the "
                "server restarted (or evicted this run's keys) after this process joined, so "
                "messages may have been lost and old data must not be trusted. Restart both "
                "processes with a new run id, or open the exchange with on_state_lost='recover'")

    def _check_incarnation(self, got: Mapping[str, bytes]) -> None:
        if got.get(self._k_inc) != self._incarnation:
            raise ExchangeStateLostError(self._incarnation_lost(got.get(self._k_inc)))

    def _check_or_recover(self, got: Mapping[str, bytes]) -> None:
        """Check the incarnation (volatile stores only); in recover mode rejoin instead of
        raising, then raise :class:`_Rejoined` (the poll retries at once)."""
        if not self._store.volatile or got.get(self._k_inc) == self._incarnation:
            return
        if not self._ex.recover:
            self._check_incarnation(got)
        self._recover()
        raise _Rejoined

    def _recover(self) -> None:
        """Rejoin after a state loss: new incarnation and lease; the consumer re-states its
        ``ack``, the producer re-publishes what is unacknowledged before its next message."""
        with self._io:
            self._check_usable()
            s = self._store
            incarnation = self._ex.rejoin(s)
            self._lease, self._gen = self._acquire_lease(old=self._lease)
            # (the new incarnation only now: the heartbeat must never see it with the old
            # lease, or it would take the old lease's absence for a take-over)
            self._incarnation = incarnation
            self._peer_seen = None
            self._written.clear()
            s.add(self._k_head, b"0 0")
            if self.role == "consumer":
                if not s.add(self._k_ack, b"%d %d" % (self._next - 1, self._gen)):
                    self._fenced_set(self._k_ack, self._next - 1, None)
            else:
                self._resend = True
        log.warning("%s: %s lost this run's state (restart or eviction); rejoined as "
                    "incarnation %s at seq %d", self.where, s.describe,
                    self._incarnation.decode(), self._next)

    def _republish(self, ack: int) -> None:
        """Producer after a recovery: write again every message after the consumer's
        ``ack`` (kept in memory until acknowledged), then ``head``."""
        missing = [q for q in range(ack + 1, self._next) if q not in self._pending]
        if missing:
            raise ExchangeStateLostError(
                f"{self.where}: after the store lost its state the consumer is at seq {ack}, "
                f"but this producer no longer holds seq {missing[0]}..{missing[-1]} (it keeps "
                "only unacknowledged messages): they are lost")
        for q in range(ack + 1, self._next):
            self._store.put_payload(self._msg(q), self._pending[q])  # False: already there
        self._fenced_set(self._k_head, max(self._next - 1, 0), None)
        self._resend = False

    def _fenced_set(self, key: str, seq: int, raw: bytes | None) -> None:
        """Set ``key`` (head or ack) to ``seq`` if no newer lease generation wrote it;
        ``raw``: the value read last (``None``: read it now)."""
        new = b"%d %d" % (seq, self._gen)
        if self._store.local_fence:  # one locked read-check-write, no prior read needed
            done, cur = self._store.fence(key, new, self._gen)
            if done:
                return
            if cur is None:
                self._int({}, key)  # raises: the key vanished
            raw = cur
        for _ in range(16):
            if raw is None:
                got = self._store.get_many([self._k_inc, key])
                self._check_incarnation(got)
                self._int(got, key)
                raw = got[key]
            if raw is not self._written.get(key) and _gen(raw) > self._gen:
                # (a value this end wrote itself carries its own generation: no parse)
                raise self._lose(LeaseLostError, (
                    f"{self.where}: this end (lease generation {self._gen}) was fenced out: "
                    f"generation {_gen(raw)} took the {self.role} lease over (this process "
                    f"stalled for more than lease_ttl={self._ex.lease_ttl:g}s), so its "
                    f"write of seq {seq} was refused; stop using this channel"))
            if raw == new or self._store.cas(key, raw, new):
                self._written[key] = new
                return
            self._written.pop(key, None)
            raw = None
        raise LeaseLostError(f"{self.where}: could not update {key!r} (contention)")

    def _check_usable(self) -> None:
        if self._closing:
            raise ChannelClosedError(f"{self.where}: this end was closed")
        if self._lost:
            raise self._lost_type(self._lost)
        if self._ex.stop_event is not None and self._ex.stop_event.is_set():
            raise ChannelClosedError(f"{self.where}: stop requested (the exchange's stop "
                                     "event is set)")

    def _check_peer(self, waiting_for: str) -> None:
        """While waiting (at most every 50 ms): raise if the peer closed or died. (A peer
        that closes writes its tombstone, then drops its lease: neither means it died.)"""
        now = time.monotonic()
        if now - self._peer_checked < _PEER_CHECK_EVERY:
            return
        keys = [k[self.peer_role] for k in (self._k_lease, self._k_closed, self._k_activity)]
        with self._io:
            self._check_usable()
            got = self._store.get_many(keys)
        raw, closed, act = (got.get(k) for k in keys)
        rec = LeaseRecord.loads(raw)
        if closed is not None and rec is None:
            info = orjson.loads(closed)
            raise ChannelClosedError(
                f"{self.where}: the {self.peer_role} (pid {info.get('pid')} on "
                f"{info.get('hostname')}) closed the channel after seq {info.get('last_seq')} "
                f"while this end waited for {waiting_for}")
        self._peer_checked = time.monotonic()
        try:
            self._peer_activity = orjson.loads(act)
        except orjson.JSONDecodeError:  # (also None: no activity)
            self._peer_activity = None
        state = peer_liveness(rec)
        if state == "alive":
            self._peer_seen = rec
        elif state == "dead":
            raise PeerDeadError(f"{self.where}: the {rec.describe()} is no longer running "
                                f"(its process is gone){self._activity_text()}; this end "
                                f"waited for {waiting_for}")
        elif self._peer_seen is not None:
            raise PeerDeadError(
                f"{self.where}: the {self._peer_seen.describe()} stopped heart-beating (its "
                f"lease expired after {self._ex.lease_ttl:g}s){self._activity_text()}; this "
                f"end waited for {waiting_for}")

    def _activity_text(self) -> str:
        act = self._peer_activity
        if not act:
            return ""
        ago = time.time() - float(act.get("since", time.time()))
        state = "busy with" if act.get("busy") else "last reported"
        return f"; it was {state} {act.get('activity')!r} (since {ago:.1f}s ago)"

    def _wait(self, w: dict[str, float], what: str, timeout: float,
              unreachable: str | None) -> None:
        """Sleep one back-off step; raise ExchangeTimeoutError once the deadline passed
        (time while the peer is busy does not count, up to ``busy_timeout``)."""
        self._check_usable()
        now = time.monotonic()
        if (self._peer_activity or {}).get("busy") and w["paused"] < self._ex.busy_timeout:
            step = min(now - w["last"], self._ex.busy_timeout - w["paused"])
            w["paused"] += step
            w["deadline"] += step
        w["last"] = now
        if now >= w["deadline"]:
            if unreachable:
                peer = f"{self._store.describe} was unreachable: {unreachable}"
            elif self._peer_seen is not None:
                peer = (f"the {self._peer_seen.describe()} is alive but sent nothing"
                        f"{self._activity_text()}")
                if w["paused"]:
                    peer += f"; the wait was extended by {w['paused']:.1f}s while it was busy"
                    if w["paused"] >= self._ex.busy_timeout:
                        peer += f" (at most busy_timeout={self._ex.busy_timeout:g}s)"
            else:
                peer = (f"no {self.peer_role} is connected (none has opened channel "
                        f"{self.name!r} with run id {self._ex.run_id!r} and rank "
                        f"{self._ex.rank}; start it with the same values)")
            if any(self.rejected.values()):
                peer += (f"; rejected {self.rejected['forged']} forged and "
                         f"{self.rejected['replayed']} replayed message(s)")
            raise ExchangeTimeoutError(f"{self.where}: no {what} within {timeout:g}s; {peer}")
        self._wake.wait(min(w["backoff"], w["deadline"] - now))
        w["backoff"] = min(w["backoff"] * 2, self._ex.poll_max)
        self._check_usable()

    def put(self, tensors: Mapping[str, Any], meta: Mapping[str, Any] | None = None, *,
            timeout: float | None = None) -> int:
        """Publish one message (name → array/tensor, JSON ``meta``); return its seq (1, 2,
        ...). Waits (bounded by ``timeout``, less the peer's busy time) while ``capacity``
        messages are unacknowledged. Errors: see docs/exchange.md."""
        seq, timeout = self._begin("put", "producer", timeout)
        encoded = wire.encode(tensors, meta, envelope={
            "seq": seq, "channel": self.name, "run_id": self._ex.run_id, "rank": self._ex.rank,
            "gen": self._gen, "inc": self._incarnation.decode()}, key=self._ex.auth_key)
        if self._ex.recover:  # kept for a re-publish: must not alias the caller's arrays
            encoded = wire.Encoded([encoded.tobytes()], encoded.nbytes)
        what = f"acknowledgement of seq {seq - self.capacity} from the consumer"
        keys = self._poll_keys(self._k_ack, self._k_head)
        # No CAS tokens needed unless head is read: otherwise its token is this end's own.
        read = self._store.get_many if self._k_head in keys else self._store.peek_many
        state = {"stored": False, "failed": False}  # survives retries of this message

        def attempt() -> int | str | None:
            with self._io:
                self._check_usable()
                got = read(keys)
            self._check_or_recover(got)
            if self._resend:
                if self._k_ack not in got:  # the consumer has not re-joined yet
                    what_r = "the consumer to re-join after the store lost its state"
                    self._check_peer(what_r)
                    return what_r
                with self._io:
                    self._republish(_seq(got[self._k_ack]))
                return attempt()
            ack = self._int(got, self._k_ack)
            for q in [q for q in self._pending if q <= ack]:
                del self._pending[q]
            if ack < seq - self.capacity:
                self._check_peer(what)
                return None
            with self._io:
                self._check_usable()
                self._publish(seq, encoded, state,
                              got.get(self._k_head, self._written.get(self._k_head)))
            if self._ex.recover:
                self._pending[seq] = encoded
            self._next = seq + 1
            return seq

        # After a recovery the payload must be written again (it went to the lost state).
        return self._poll(what, timeout, attempt,
                          on_recover=lambda: state.update(stored=False, failed=False))

    def _begin(self, op: str, role: str, timeout: float | None) -> tuple[int, float]:
        if self.role != role:
            raise TypeError(f"{self.where}: {op}() needs a {role} channel")
        self._check_usable()
        return self._next, self.timeout if timeout is None else timeout

    def _poll_keys(self, theirs: str, mine: str) -> list[str]:
        """What a poll reads: the incarnation (volatile stores), the peer's position and its
        own unless this end wrote it last (its CAS token makes the fenced write 1 RTT)."""
        keys = [self._k_inc, theirs] if self._store.volatile else [theirs]
        return keys if self._store.local_fence or mine in self._written else [*keys, mine]

    def _waiter(self, timeout: float) -> dict[str, float]:
        now = time.monotonic()
        return dict(deadline=now + timeout, backoff=self._ex.poll_min, last=now, paused=0.0)

    def _poll(self, what: str, timeout: float, attempt: Callable[[], Any],
              w: dict[str, float] | None = None,
              on_recover: Callable[[], object] = lambda: None, writes: bool = True) -> Any:
        """Call ``attempt`` until it returns a result, sleeping a back-off step after each
        ``None`` (or str: what it waits for instead) or unreachable store. In recover mode a
        state loss seen by a poll's read or (``writes``) before its write is rejoined, then
        ``on_recover()`` and ``attempt`` again at once."""
        w = w or self._waiter(timeout)
        while True:
            unreachable, waiting_for = None, what
            try:
                result = attempt()
                if result is not None and not isinstance(result, str):
                    return result
                waiting_for = result or what
            except StoreUnavailable as exc:
                unreachable = str(exc)
            except (_Rejoined, ExchangeStateLostError) as exc:
                if not isinstance(exc, _Rejoined):
                    if not writes or not self._ex.recover or not self._incarnation_moved():
                        raise
                    self._recover()  # the state was lost between a read and a write
                on_recover()
                continue
            self._wait(w, waiting_for, timeout, unreachable)

    def _incarnation_moved(self) -> bool:
        """Whether the incarnation moved (a restart, not a lost message)."""
        try:
            with self._io:
                return self._store.get(self._k_inc) != self._incarnation
        except StoreUnavailable:
            return False

    def _publish(self, seq: int, encoded: wire.Encoded, state: dict[str, bool],
                 head_raw: bytes | None) -> None:
        """Write the payload once, then advance ``head`` (fenced); safe to retry."""
        key = self._msg(seq)
        if not state["stored"] and state["failed"]:  # did the lost request get through?
            state["stored"] = self._is_own(self._payload_envelope(key), seq)
        if not state["stored"]:
            try:
                if not self._store.put_payload(key, encoded):
                    self._replace_foreign_payload(key, seq, encoded)
            except StoreUnavailable:
                state["failed"] = True
                raise
            state["stored"] = True
        self._fenced_set(self._k_head, seq, head_raw)

    def _is_own(self, env: dict[str, Any] | None, seq: int) -> bool:
        return env is not None and env.get("seq") == seq and env.get("gen") == self._gen

    def _replace_foreign_payload(self, key: str, seq: int, encoded: wire.Encoded) -> None:
        """``msg.<seq>`` exists but ``head`` has not reached it, so no consumer has read it:
        it was left by a fenced-out (stalled) producer, or forged. Replace it."""
        env = self._payload_envelope(key)
        if self._is_own(env, seq):
            return  # our own earlier write
        forged = env is None and self._ex.auth_key is not None  # fails authentication
        if self._int(self._store.get_many([self._k_head]), self._k_head) >= seq and not forged:
            raise SequenceError(f"{self.where}: seq {seq} is already published by another "
                                "writer: a second producer used this channel")
        log.warning("%s: replacing an unpublished payload at seq %d left by another writer "
                    "(a producer that lost its lease, or a forgery)", self.where, seq)
        self._store.delete_payload(key)
        if not self._store.put_payload(key, encoded):
            raise SequenceError(f"{self.where}: another writer keeps writing seq {seq}")

    def get(self, timeout: float | None = None, *, expect: Mapping[str, Any] | None = None,
            as_torch: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """Take the next message, in order and exactly once: ``(tensors, meta)``.

        ``expect``: alignment fields checked (:func:`check_alignment`) before the message is
        acknowledged; ``as_torch``: torch tensors (bfloat16/float8 always are). Forged or
        replayed messages are counted in :attr:`rejected` and skipped. Errors: see
        docs/exchange.md.
        """
        seq, timeout = self._begin("get", "consumer", timeout)
        w, what = self._waiter(timeout), f"message seq {seq} from the producer"
        small = self._poll_keys(self._k_head, self._k_ack)
        where = f"{self.where}, seq {seq}"
        rejected = sum(self.rejected.values())

        def attempt() -> tuple[wire.Message, Mapping[str, bytes]] | None:
            with self._io:
                self._check_usable()
                got, buf = self._store.read_message(small, self._msg(seq))
            self._check_or_recover(got)
            head = self._int(got, self._k_head)
            if buf is not None and head >= seq:
                msg = self._accept(buf, seq, as_torch, where)
                if msg is not None:
                    return msg, got
            elif buf is None and head >= seq and rejected == sum(self.rejected.values()):
                raise ExchangeStateLostError(
                    f"{self.where}: message seq {seq} was published (producer head is "
                    f"{head}) but is gone from {self._store.describe}: evicted or deleted. "
                    "Give memcached more memory (-m) and restart with a new run id")
            self._check_peer(what)  # not yet published (or, after a forgery, not again)
            return None

        msg, got = self._poll(what, timeout, attempt, w, writes=False)
        if expect is not None:
            check_alignment(msg.meta, expect, where=where, tensors=msg.tensors)
        raws = [got.get(self._k_ack, self._written.get(self._k_ack))]

        def acknowledge() -> bool:
            """Set ``ack`` (fenced) and drop the payload; a ``close()`` that started
            meanwhile wins (the message stays pending). A retry re-reads ``ack``."""
            with self._io:
                self._check_usable()
                self._fenced_set(self._k_ack, seq, raws.pop() if raws else None)
                self._next = seq + 1
                if self.delivery == "at_most_once":
                    try:
                        self._store.delete_payload(self._msg(seq))
                    except StoreUnavailable:
                        log.warning("%s: could not delete the payload of seq %d (server "
                                    "unreachable); it is removed when the channel reopens",
                                    self.where, seq)
            return True

        # (after a recovery, which re-states ack = seq - 1, seq is acknowledged as usual)
        self._poll(f"the acknowledgement write of seq {seq}", timeout, acknowledge, w)
        return msg.tensors, msg.meta

    def _accept(self, buf: bytearray, seq: int, as_torch: bool, where: str) -> wire.Message | None:
        """Decode a payload; ``None`` (after counting and deleting it) if it is forged or
        replayed under authentication."""
        key = self._ex.auth_key
        try:
            msg = wire.decode(buf, as_torch=as_torch, where=f" on {where}", key=key)
        except MessageAuthError as exc:
            if key is None:
                raise  # an authenticated message and no secret here: a configuration error
            self._reject("forged", seq, str(exc))
            return None
        env = msg.envelope
        if (env.get("seq"), env.get("channel"), env.get("run_id"), env.get("rank")) != \
                (seq, self.name, self._ex.run_id, self._ex.rank) or \
                (key is not None and env.get("inc") not in self._ex.incarnations):
            if key is not None:
                self._reject("replayed", seq, f"an authentic message stamped {env}")
                return None
            raise SequenceError(f"{where}: the payload is stamped {env}, expected seq {seq} of "
                                "this channel: duplicate, gap or cross-wired message")
        return msg

    def _reject(self, kind: str, seq: int, why: str) -> None:
        self.rejected[kind] += 1
        log.warning("%s: rejected a %s message at seq %d (%s); %d forged and %d replayed so "
                    "far", self.where, kind, seq, why, self.rejected["forged"],
                    self.rejected["replayed"])
        with self._io:
            self._store.delete_payload(self._msg(seq))

    def commit(self, seq: int) -> None:
        """Exactly-once consumers: the (durable) checkpoint now covers ``seq``, so payloads
        up to ``seq`` are deleted."""
        if self.role != "consumer":
            raise TypeError(f"{self.where}: commit() needs a consumer channel")
        seq = min(seq, self._next - 1)
        if seq <= self._committed:
            return
        with self._io:
            self._check_usable()
            for s in range(self._committed + 1, seq + 1):
                self._store.delete_payload(self._msg(s))
            self._store.set(self._k_commit, str(seq).encode())
            self._committed = seq

    @property
    def next_seq(self) -> int:
        """The sequence number of the next message this end will put or get."""
        return self._next

    def peer_activity(self) -> dict[str, Any] | None:
        """What the peer last reported doing (``{"activity", "busy", "since", "pid"}``)."""
        with self._io:
            raw = self._store.get(self._k_activity[self.peer_role])
        return None if raw is None else orjson.loads(raw)

    def _write_activity(self, store: Store) -> None:
        activity, busy, since = self._ex.activity
        store.set(self._k_activity[self.role], orjson.dumps(
            {"activity": activity, "busy": busy, "since": since, "pid": os.getpid()}),
            ttl=self._ex.lease_ttl)

    def publish_activity(self) -> None:
        """Write the exchange's activity for the peer now (the heartbeat repeats it)."""
        with self._io:
            if self._closing or self._lost:
                return
            try:
                self._write_activity(self._store)
            except Exception as exc:  # the heartbeat retries
                log.warning("%s: could not publish the activity: %s", self.where, exc)

    def heartbeat(self, store: Store) -> None:
        """Refresh this end's lease and activity (the exchange's heartbeat thread)."""
        if self._closing or self._lost:
            return
        lease = self._lease
        try:
            if store.cas(self._k_lease[self.role], lease, lease, self._ex.lease_ttl):
                self._write_activity(store)
                return
            if self._closing:
                return
            incarnation = store.get(self._k_inc)
        except StoreUnavailable:
            return
        if incarnation != self._incarnation:  # a restart, not a take-over: say so
            if not self._ex.recover:  # (recover mode: put/get rejoin on their next poll)
                self._lose(ExchangeStateLostError, self._incarnation_lost(incarnation))
            return
        if lease is not self._lease:
            return  # this end rejoined meanwhile (a new lease, refreshed by the next beat)
        self._lose(LeaseLostError, f"{self.where}: this end lost its lease (it expired or "
                   "another process took it over, e.g. after this process stalled for more "
                   f"than {self._ex.lease_ttl:g}s); stop using this channel")

    def _lose(self, error: type[ExchangeError], text: str) -> ExchangeError:
        """Make every later call raise ``error(text)`` and wake a waiting put/get."""
        self._lost_type = error  # (before _lost: another thread raises once _lost is set)
        self._lost = text
        self._wake.set()
        return error(text)

    def _release(self) -> None:
        if self._store.get(self._k_lease[self.role]) == self._lease:
            self._store.delete(self._k_lease[self.role])

    def close(self, finished: bool = True) -> None:
        """Leave a tombstone, release the lease and wake a waiting ``get``/``put`` (safe
        from another thread, idempotent). Once both ends closed, the channel's state is
        removed unless ``finished=False`` (the stream stays resumable)."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        self._ex.forget(self)
        with self._io:
            try:
                if not self._lost:
                    tomb = orjson.dumps({"last_seq": self._next - 1, "pid": os.getpid(),
                                         "hostname": LeaseRecord.loads(self._lease).hostname,
                                         "gen": self._gen, "time": time.time()})
                    self._store.set(self._k_closed[self.role], tomb)
                    self._store.delete(self._k_activity[self.role])
                    self._release()
                    if finished:
                        self._cleanup_if_finished()
            except Exception as exc:  # closing must not raise on a dead backend
                log.warning("%s: could not close cleanly: %s", self.where, exc)
            finally:
                self._store.close()

    def _cleanup_if_finished(self) -> None:
        """Both ends closed cleanly: remove payloads and bookkeeping of this channel."""
        peer = self.peer_role
        got = self._store.get_many([self._k_lease[peer], self._k_closed[peer], self._k_head,
                                    self._k_ack, self._k_commit])
        if self._k_closed[peer] not in got or self._k_lease[peer] in got:
            return
        head = _seq(got.get(self._k_head, b"0"))
        # (exactly-once: payloads after the commit were kept)
        low = (int(got[self._k_commit]) if self._k_commit in got
               else max(_seq(got.get(self._k_ack, b"0")) - 1, 0))
        keys = [self._k_head, self._k_ack, self._k_gen, self._k_commit, *self._k_lease.values(),
                *self._k_closed.values(), *self._k_activity.values()]
        payloads = [self._msg(s) for s in range(low + 1, head + 2)]
        self._store.delete_namespace(self._ns, keys, payloads)
        log.debug("%s: both ends closed; removed the channel's state", self.where)

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Channel {self.where}, next seq {self._next}>"
