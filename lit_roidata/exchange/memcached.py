"""The memcached backend (pymemcache), done the way spec §8.4.2/§8.4.6 asks.

What differs from the fork (spec §8.1, §8.3):

* Values are raw bytes in our wire format (no pickle), sent with ``noreply`` off so that
  every store returns a status that is checked.
* A payload is written once under a sequence-specific key with ``add``. Payloads larger
  than the server's item limit (``stats settings`` → ``item_size_max``, set with
  ``memcached -I``) are split into chunk items ``<key>#<i>`` stored first, then a small
  descriptor (``LRXC``: chunk count, total length) is ``add``-ed under ``<key>``: the
  descriptor is the atomic publish. A missing chunk is reported as lost state, never
  assembled into a wrong payload (the wire CRC would catch a mix-up as well).
* Leases use ``add`` with an expiry and ``gets``/``cas`` heart-beats (atomic).
* Connection failures raise :class:`StoreUnavailable` so callers retry within their
  deadline; a server restart is detected one level up, by the run's incarnation key.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
import socket
import struct

from pymemcache.client.base import Client
from pymemcache.exceptions import (
    MemcacheError,
    MemcacheServerError,
    MemcacheUnexpectedCloseError,
)

from lit_roidata.exchange.errors import ExchangeError, ExchangeStateLostError
from lit_roidata.exchange.store import Store, StoreUnavailable
from lit_roidata.exchange.wire import Encoded

__all__ = ["MemcachedStore", "parse_address"]

_DESCRIPTOR = struct.Struct("<4sIQ")  # magic, chunk count, total length
_DESC_MAGIC = b"LRXC"
_KEY_OK = re.compile(rb"^[\x21-\x7e]{1,250}$")
_CHUNK_MARGIN = 4096  # room for the item header and key inside item_size_max
_TRANSIENT = (OSError, socket.timeout, MemcacheUnexpectedCloseError)


def parse_address(address: str | None) -> tuple[str, int]:
    """``"host:port"`` (or ``"host"``, port 11211) → ``(host, port)``."""
    if not address:
        raise ValueError("the memcached backend needs address='host:port' "
                         "(e.g. '127.0.0.1:11211')")
    host, sep, port = address.rpartition(":")
    if not sep:
        return address, 11211
    try:
        return host.strip("[]"), int(port)
    except ValueError as exc:
        raise ValueError(f"bad memcached address {address!r}: expected 'host:port'") from exc


@functools.lru_cache(maxsize=8192)
def _memcached_key(key: str) -> bytes:
    """Logical key → memcached key (``lrx:`` prefix; hashed if too long or unsafe)."""
    raw = ("lrx:" + key.replace("/", ":")).encode()
    if not _KEY_OK.match(raw):
        raw = b"lrx:h:" + hashlib.sha1(raw).hexdigest().encode()
    return raw


class MemcachedStore(Store):
    """:class:`~lit_roidata.exchange.store.Store` on one memcached server.

    Args:
        address: ``"host:port"``.
        timeout: socket timeout in seconds for one request.
        chunk_size: bytes per chunk item; default: the server's ``item_size_max`` minus a
            margin for the item header.
    """

    def __init__(self, address: str, *, timeout: float = 30.0,
                 chunk_size: int | None = None) -> None:
        self.address = address
        self._server = parse_address(address)
        self._timeout = timeout
        self.describe = f"memcached at {address}"
        self._client = Client(self._server, connect_timeout=min(timeout, 5.0), timeout=timeout,
                              no_delay=True, default_noreply=False)
        if chunk_size is None:
            chunk_size = self.item_size_max() - _CHUNK_MARGIN
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self._chunks: dict[str, int] = {}  # chunk counts of payloads read, for delete

    # -- plumbing ------------------------------------------------------------------------
    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _TRANSIENT as exc:
            self._client.close()
            raise StoreUnavailable(f"{self.describe} is unreachable ({exc!r}); is the server "
                                   f"running? start it with `memcached -p "
                                   f"{self._server[1]} -I 16m`") from exc
        except MemcacheServerError as exc:
            hint = ""
            if b"too large" in str(exc).encode() or "too large" in str(exc):
                hint = "; lower chunk_size or raise the server's item size (-I)"
            elif "memory" in str(exc):
                hint = "; give memcached more memory (-m) so items are not refused/evicted"
            raise ExchangeError(f"{self.describe} refused a request: {exc}{hint}") from exc
        except MemcacheError as exc:
            raise ExchangeError(f"{self.describe}: {exc}") from exc

    def _k(self, key: str) -> bytes:
        return _memcached_key(key)

    @staticmethod
    def _ttl(ttl: float) -> int:
        # memcached expiry is in whole seconds on a clock that ticks once a second, so a
        # relative expiry of n lives between n-1 and n seconds: add one so an item lives
        # at least ``ttl`` seconds (a lease must not lapse between two heartbeats).
        return 0 if not ttl else math.ceil(ttl) + 1

    def item_size_max(self) -> int:
        """The server's item size limit in bytes (``memcached -I``)."""
        stats = self._call(self._client.stats, "settings")
        value = stats.get(b"item_size_max", stats.get("item_size_max"))
        if value is None:
            return 1 << 20
        return int(value)

    # -- small values --------------------------------------------------------------------
    def add(self, key: str, value: bytes, ttl: float = 0) -> bool:
        return bool(self._call(self._client.add, self._k(key), value, self._ttl(ttl)))

    def set(self, key: str, value: bytes, ttl: float = 0) -> None:
        if not self._call(self._client.set, self._k(key), value, self._ttl(ttl)):
            raise ExchangeError(f"{self.describe} did not store {key!r}")

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        mapped = {self._k(k): k for k in keys}
        got = self._call(self._client.get_many, list(mapped))
        return {mapped[k]: v for k, v in got.items()}

    def cas(self, key: str, expected: bytes, new: bytes, ttl: float = 0) -> bool:
        k = self._k(key)
        value, token = self._call(self._client.gets, k)
        if value is None or value != expected:
            return False
        return bool(self._call(self._client.cas, k, new, token, self._ttl(ttl)))

    def delete(self, key: str) -> None:
        self._call(self._client.delete, self._k(key))

    def exists(self, key: str) -> bool:
        # touch with expiry 0 keeps "never expire" and transfers no data.
        return bool(self._call(self._client.touch, self._k(key), 0))

    # -- payloads ------------------------------------------------------------------------
    def put_payload(self, key: str, encoded: Encoded) -> None:
        k = self._k(key)
        data = encoded.tobytes()
        if len(data) <= self.chunk_size:
            head = data
        else:
            view = memoryview(data)
            n = math.ceil(len(data) / self.chunk_size)
            chunks = {self._k(f"{key}#{i}"): bytes(view[i * self.chunk_size:
                                                         (i + 1) * self.chunk_size])
                      for i in range(n)}
            failed = self._call(self._client.set_many, chunks, 0)
            if failed:
                raise ExchangeError(f"{self.describe} did not store {len(failed)} chunk(s) "
                                    f"of {key!r}; give it more memory (-m)")
            head = _DESCRIPTOR.pack(_DESC_MAGIC, n, len(data))
        if not self._call(self._client.add, k, head, 0):
            raise ExchangeError(f"{self.describe}: payload {key!r} already exists: a second "
                                "writer published the same sequence number")

    def get_payload(self, key: str) -> bytearray | None:
        head = self.get_many([key]).get(key)
        return None if head is None else self.resolve_payload(key, head)

    def read_message(self, small_keys: list[str],
                     payload_key: str) -> tuple[dict[str, bytes], bytearray | None]:
        got = self.get_many([*small_keys, payload_key])  # one round trip, keys in order
        head = got.pop(payload_key, None)
        return got, None if head is None else self.resolve_payload(payload_key, head)

    def resolve_payload(self, key: str, head: bytes) -> bytearray:
        """Turn a payload item (whole message or chunk descriptor) into the message bytes."""
        if not head.startswith(_DESC_MAGIC):
            self._chunks[key] = 0
            return bytearray(head)
        _, n, total = _DESCRIPTOR.unpack_from(head)
        self._chunks[key] = n
        names = [f"{key}#{i}" for i in range(n)]
        got = self.get_many(names)
        buf, pos = bytearray(total), 0
        for i, name in enumerate(names):
            part = got.get(name)
            if part is None:
                raise ExchangeStateLostError(
                    f"chunk {i}/{n} of {key!r} is missing from {self.describe}: evicted or "
                    "the server restarted; give memcached more memory (-m) and restart "
                    "both processes with a new run id")
            buf[pos:pos + len(part)] = part
            pos += len(part)
        if pos != total:
            raise ExchangeStateLostError(f"chunks of {key!r} hold {pos} bytes, descriptor "
                                         f"says {total}: mixed chunks on {self.describe}")
        return buf

    def delete_payload(self, key: str) -> None:
        n = self._chunks.pop(key, None)
        if n is None:
            head = self.get_many([key]).get(key)
            n = 0
            if head is not None and head.startswith(_DESC_MAGIC):
                n = _DESCRIPTOR.unpack_from(head)[1]
        keys = [self._k(key)] + [self._k(f"{key}#{i}") for i in range(n)]
        # Clean-up only (the ack already moved the stream on): no need to wait for replies.
        self._call(self._client.delete_many, keys, noreply=True)

    def clone(self) -> MemcachedStore:
        return MemcachedStore(self.address, timeout=self._timeout, chunk_size=self.chunk_size)

    def close(self) -> None:
        self._client.close()
