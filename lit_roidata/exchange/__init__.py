"""``BlobExchange``: an exactly-once mailbox between training processes.

The Detectron fork's 13 global memcached keys with a "read/unread" status each (Detectron
semantics: cross-process exchange), without their lost, duplicated or cross-wired messages:
exactly-once, in-order delivery per named channel, over files (``"embedded"``) or memcached.

>>> ex = BlobExchange("embedded", run_id="distill-1", rank=0)      # doctest: +SKIP
>>> out = ex.channel("teacher_rpn", role="producer")                # doctest: +SKIP
>>> out.put({"rpn_cls_probs_fpn2": probs}, meta={"step": 0})        # doctest: +SKIP
>>> # in the other process, with the same run id and rank:
>>> tensors, meta = ex.channel("teacher_rpn", role="consumer").get()  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import re
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lit_roidata._optional import require
from lit_roidata.exchange.alignment import check_alignment
from lit_roidata.exchange.channel import ROLES, Channel
from lit_roidata.exchange.errors import (AlignmentError, ChannelBusyError, ChannelClosedError,
                                         ExchangeError, ExchangeStateLostError,
                                         ExchangeTimeoutError, LeaseLostError, MessageAuthError,
                                         PeerDeadError, SequenceError, WireFormatError)
from lit_roidata.exchange.backend import Store, StoreUnavailable

__all__ = [
    "AlignmentError", "BlobExchange", "Channel", "ChannelBusyError", "ChannelClosedError",
    "ExchangeError", "ExchangeStateLostError", "ExchangeTimeoutError", "LeaseLostError",
    "MessageAuthError", "PeerDeadError", "SequenceError", "WireFormatError", "check_alignment",
]

log = logging.getLogger(__name__)
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,100}$")
BACKENDS = ("embedded", "memcached")
SECRET_ENV, SECRET_FILE_ENV = "LIT_ROIDATA_EXCHANGE_SECRET", "LIT_ROIDATA_EXCHANGE_SECRET_FILE"


def load_secret(secret: str | bytes | None = None,
                secret_file: str | os.PathLike | None = None) -> bytes | None:
    """The exchange secret: ``secret``, else the file ``secret_file``, else
    ``$LIT_ROIDATA_EXCHANGE_SECRET``, else the file ``$LIT_ROIDATA_EXCHANGE_SECRET_FILE``;
    ``None`` if none is set. ValueError if it (or its file) is empty or unreadable."""
    source = "secret="
    if secret is None and secret_file is None:
        secret, source = os.environ.get(SECRET_ENV) or None, f"${SECRET_ENV}"
        if secret is None:
            secret_file = os.environ.get(SECRET_FILE_ENV) or None
    if secret is None and secret_file is not None:
        source = f"secret file {secret_file}"
        try:
            secret = Path(secret_file).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the exchange secret file {secret_file}: {exc}") from exc
    if secret is None:
        return None
    value = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not value:
        raise ValueError(f"the exchange secret from {source} is empty")
    return value


def _check_name(what: str, value: Any) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{what} must be 1-100 characters of A-Z a-z 0-9 _ . -, got {value!r}")
    return value


class BlobExchange:
    """Named producer/consumer channels between processes that share a run id and rank.

    Channels are namespaced by ``(run_id, rank, name)``; docs/exchange.md ("API") describes
    every argument. ``address``: the embedded directory (default ``$LIT_ROIDATA_EXCHANGE_DIR``
    or ``/dev/shm``) or memcached's ``"host:port"``. Raises ValueError (bad argument, empty
    secret) or ExchangeError (the backend cannot be reached or initialised).
    """

    def __init__(self, backend: str = "embedded", address: str | None = None,
                 run_id: str | None = None, rank: int = 0, *, timeout: float = 60.0,
                 capacity: int = 1, lease_ttl: float = 10.0, stop_event: Any = None,
                 poll_min: float = 5e-5, poll_max: float = 0.002,
                 chunk_size: int | None = None, resume: bool = False,
                 secret: str | bytes | None = None, secret_file: str | os.PathLike | None = None,
                 authenticate: bool | None = None, shm_dir: str | os.PathLike | None = None,
                 stale_after: float | None = 3600.0, key_ttl: float = 7 * 24 * 3600.0,
                 busy_timeout: float = 3600.0, on_state_lost: str = "raise") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if on_state_lost not in ("raise", "recover"):
            raise ValueError(f"on_state_lost must be 'raise' or 'recover', got {on_state_lost!r}")
        self.recover = on_state_lost == "recover"
        run_id = run_id if run_id is not None else os.environ.get("LIT_ROIDATA_RUN_ID")
        if run_id is None:
            raise ValueError("BlobExchange needs run_id (equal in both processes, e.g. the "
                             "experiment name) or $LIT_ROIDATA_RUN_ID")
        self.run_id = _check_name("run_id", run_id)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if lease_ttl <= 0 or timeout < 0:
            raise ValueError("lease_ttl must be > 0 and timeout >= 0")
        if shm_dir is not None:
            if backend != "embedded" or (address is not None and str(address) != str(shm_dir)):
                raise ValueError("shm_dir is the embedded backend's directory; pass it or "
                                 "address, not both")
            address = str(shm_dir)
        key = load_secret(secret, secret_file)
        if authenticate is True and key is None:
            raise ValueError(f"authenticate=True needs a secret (secret=, secret_file=, "
                             f"${SECRET_ENV} or ${SECRET_FILE_ENV})")
        self.authenticated = key is not None and authenticate is not False
        #: Per-run HMAC key (``None``: messages are not authenticated).
        self.auth_key = (hmac.new(key, b"lit_roidata.exchange/" + self.run_id.encode(),
                                  hashlib.sha256).digest() if self.authenticated else None)
        self.backend, self.address, self.rank = backend, address, rank
        self.timeout, self.capacity, self.lease_ttl = timeout, capacity, lease_ttl
        self.stop_event, self.resume, self.busy_timeout = stop_event, resume, busy_timeout
        self.poll_min, self.poll_max = poll_min, poll_max
        #: ``(activity, busy, since)``: what this process told its peers (:meth:`set_activity`).
        self.activity: tuple[str, bool, float] = ("opened", False, time.time())
        #: The backend's store (each channel and the heartbeat use their own clone).
        self.store: Store
        if backend == "embedded":
            from lit_roidata.exchange.embedded import EmbeddedStore

            self.store = EmbeddedStore(address)
            if stale_after is not None:
                if removed := self.store.sweep_stale_runs(stale_after, keep=self.run_id):
                    log.info("removed %d stale exchange run(s) from %s: %s", len(removed),
                             self.store.root, ", ".join(removed))
        else:
            require("pymemcache", "memcached", "the memcached BlobExchange backend")
            from lit_roidata.exchange.memcached import MemcachedStore

            try:
                self.store = MemcachedStore(address, chunk_size=chunk_size, key_ttl=key_ttl)
            except StoreUnavailable as exc:
                raise ExchangeError(f"cannot start the memcached exchange: {exc}") from exc
        #: The store key whose value names the run's incarnation (lost on a restart).
        self.incarnation_key = f"{self.run_id}/incarnation"
        self._join_lock = threading.Lock()
        #: Every incarnation this process joined (a producer may re-publish after a recovery).
        self.incarnations: set[str] = set()
        try:
            self.rejoin(self.store)
        except StoreUnavailable as exc:
            raise ExchangeError(f"cannot start the exchange: {exc}") from exc
        self._channels: weakref.WeakSet[Channel] = weakref.WeakSet()
        self._lock, self._hb_stop = threading.Lock(), threading.Event()
        self._hb_thread: threading.Thread | None = None

    def rejoin(self, store: Store) -> bytes:
        """Create (or adopt) the run's incarnation key (lost by a server restart or
        eviction): on opening and after a state loss."""
        with self._join_lock:
            if (value := store.get(self.incarnation_key)) is None:
                store.add(self.incarnation_key, uuid.uuid4().hex.encode())  # key_ttl
                value = store.get(self.incarnation_key)
            if value is None:
                raise ExchangeStateLostError(f"{store.describe} does not keep the incarnation "
                                             f"key of run {self.run_id!r}; out of memory?")
            self.incarnation = value
            self.incarnations.add(value.decode())
            return value

    def channel(self, name: str, role: str = "producer", *, capacity: int | None = None,
                timeout: float | None = None, start_seq: int | None = None,
                delivery: str = "at_most_once") -> Channel:
        """Open one end (``role``: ``"producer"`` or ``"consumer"``) of channel ``name``.

        Consumer only: ``start_seq`` resumes from the application's checkpoint (needs
        ``resume=True`` and ``delivery="exactly_once"``, which keeps payloads until
        :meth:`Channel.commit`). Raises ChannelBusyError (another live process holds this
        end) or ExchangeError (this end made progress under this run id, no ``resume``).
        """
        _check_name("channel name", name)
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        ch = Channel(self, name, role, capacity=capacity or self.capacity,
                     timeout=self.timeout if timeout is None else timeout,
                     start_seq=start_seq, delivery=delivery)
        with self._lock:
            self._channels.add(ch)
            if self._hb_thread is None:
                self._hb_thread = threading.Thread(target=self._heartbeat, daemon=True,
                                                   name=f"lit_roidata-exchange-{self.run_id}")
                self._hb_thread.start()
        return ch

    def set_activity(self, activity: str, busy: bool = False) -> None:
        """Tell the peers what this process is doing; while ``busy``, their waits do not
        count the time against their timeouts (up to ``busy_timeout``)."""
        self.activity = (str(activity), bool(busy), time.time())
        for ch in self._open_channels():
            ch.publish_activity()

    @contextlib.contextmanager
    def busy(self, activity: str) -> Iterator[None]:
        """Context manager: mark this process busy with ``activity`` (e.g.
        ``"validation"``) so that waiting peers extend their timeouts meanwhile."""
        previous = self.activity[0]
        self.set_activity(activity, busy=True)
        try:
            yield
        finally:
            self.set_activity(f"{previous} (after {activity})", busy=False)

    def _heartbeat(self) -> None:
        store = self.store.clone()
        try:
            while not self._hb_stop.wait(self.lease_ttl / 5):
                with contextlib.suppress(Exception):  # keep the run's keys from expiring
                    store.cas(self.incarnation_key, self.incarnation, self.incarnation)
                for ch in self._open_channels():
                    try:
                        ch.heartbeat(store)
                    except Exception as exc:  # keep beating for the other channels
                        log.warning("heartbeat of %s failed: %s", ch.where, exc)
        finally:
            store.close()

    def _open_channels(self) -> list[Channel]:
        with self._lock:
            return list(self._channels)

    def forget(self, ch: Channel) -> None:
        """Stop the heartbeat of ``ch`` (its ``close`` calls it)."""
        with self._lock:
            self._channels.discard(ch)

    def close(self, finished: bool = True) -> None:
        """Close every open channel (waking waiters) and stop the heartbeat thread;
        ``finished=False`` keeps every stream for a later resume."""
        for ch in self._open_channels():
            ch.close(finished)
        self._hb_stop.set()
        if self._hb_thread is not None and self._hb_thread is not threading.current_thread():
            self._hb_thread.join(timeout=5)
        if finished and self.backend == "embedded" and self._hb_thread is not None:
            self.store.remove_run_if_unused(self.run_id)  # incarnation and lock files
        self.store.close()

    def __enter__(self) -> BlobExchange:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"BlobExchange({self.backend!r}, run_id={self.run_id!r}, rank={self.rank}, "
                f"{self.store.describe})")
