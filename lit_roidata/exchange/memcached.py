"""The memcached backend (pymemcache): raw wire-format bytes (no pickle), statuses checked.

Payloads are written once with ``add``, split into chunk items ``<key>#<writer>#<i>`` above
the item size and published by an ``LRXD`` descriptor; leases and positions use meta
compare-and-swap (memcached >= 1.6) with remembered CAS tokens; every key expires after
``key_ttl``. Connection failures raise :class:`StoreUnavailable`.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import socket
import struct
import time
from typing import Any

from pymemcache.client.base import Client
from pymemcache.exceptions import (MemcacheError, MemcacheServerError, MemcacheUnexpectedCloseError,
                                   MemcacheUnknownCommandError)

from lit_roidata.exchange.errors import ExchangeError, ExchangeStateLostError
from lit_roidata.exchange.backend import Store, StoreUnavailable
from lit_roidata.exchange.wire import Encoded

__all__ = ["MemcachedStore", "parse_address"]

_DESCRIPTOR = struct.Struct("<4sIQ8s")  # magic, chunk count, total length, writer id
_DESC_MAGIC = b"LRXD"  # "LRXC" (no writer id) was version 1; chunk keys are "<key>#<w>#<i>"
_MAX_RELATIVE_TTL = 30 * 24 * 3600  # memcached reads larger expiries as unix times
_KEY_OK = re.compile(rb"^[\x21-\x7e]{1,250}$")
_CHUNK_MARGIN = 4096  # room for the item header and key inside item_size_max
_TRANSIENT = (OSError, socket.timeout, MemcacheUnexpectedCloseError)
_HINTS = (("too large", "; lower chunk_size or raise the server's item size (-I)"),
          ("memory", "; give memcached more memory (-m) so items are not refused/evicted"))


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


def _chunk_names(key: str, head: bytes) -> list[str]:
    """The chunk keys a payload item names (``[]``: the item is the whole message)."""
    if not head.startswith(_DESC_MAGIC) or len(head) != _DESCRIPTOR.size:
        return []
    _, n, _, writer = _DESCRIPTOR.unpack(head)
    return [f"{key}#{writer.hex()}#{i}" for i in range(n)]


class MemcachedStore(Store):
    """:class:`~lit_roidata.exchange.backend.Store` on one memcached server.

    ``timeout``: socket timeout of one request; ``chunk_size``: bytes per chunk item
    (default: the server's ``item_size_max`` less a margin); ``key_ttl``: expiry of every
    key stored without its own (at most 30 days; refreshed by every write).
    """

    def __init__(self, address: str, *, timeout: float = 30.0,
                 chunk_size: int | None = None, key_ttl: float = 7 * 24 * 3600) -> None:
        self.address, self.key_ttl, self._timeout = address, key_ttl, timeout
        self._server = parse_address(address)
        self.describe = f"memcached at {address}"
        self._client = Client(self._server, connect_timeout=min(timeout, 5.0), timeout=timeout,
                              no_delay=True, default_noreply=False)
        chunk_size = self.item_size_max() - _CHUNK_MARGIN if chunk_size is None else chunk_size
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self._chunks: dict[str, list[str]] = {}  # chunk keys of payloads read, for delete
        self._tokens: dict[bytes, tuple[bytes, bytes]] = {}  # key -> (value, cas token)

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except _TRANSIENT as exc:
            self._client.close()
            raise StoreUnavailable(f"{self.describe} is unreachable ({exc!r}); is the server "
                                   f"running? start it with `memcached -p "
                                   f"{self._server[1]} -I 16m`") from exc
        except MemcacheServerError as exc:
            hint = next((h for word, h in _HINTS if word in str(exc)), "")
            raise ExchangeError(f"{self.describe} refused a request: {exc}{hint}") from exc
        except MemcacheError as exc:
            raise ExchangeError(f"{self.describe}: {exc}") from exc

    _k = staticmethod(_memcached_key)

    def _ttl(self, ttl: float) -> int:
        # A relative expiry of n (whole seconds) lives between n-1 and n seconds: add one so
        # a lease cannot lapse between two heartbeats. 0: the store's key_ttl.
        ttl = ttl or self.key_ttl
        return 0 if not ttl else min(math.ceil(ttl) + 1, _MAX_RELATIVE_TTL)

    def item_size_max(self) -> int:
        """The server's item size limit in bytes (``memcached -I``)."""
        stats = self._call(self._client.stats, "settings")
        return int(stats.get(b"item_size_max", stats.get("item_size_max", 1 << 20)))

    def add(self, key: str, value: bytes, ttl: float = 0) -> bool:
        return bool(self._call(self._client.add, self._k(key), value, self._ttl(ttl)))

    def set(self, key: str, value: bytes, ttl: float = 0) -> None:
        if not self._call(self._client.set, self._k(key), value, self._ttl(ttl)):
            raise ExchangeError(f"{self.describe} did not store {key!r}")

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        mapped = {self._k(k): k for k in keys}
        got = self._call(self._client.gets_many, list(mapped))
        # Only small (bookkeeping) values are cas-ed: remember their tokens.
        self._remember((k, vt) for k, vt in got.items() if len(vt[0]) <= 256)
        return {mapped[k]: value for k, (value, _) in got.items()}

    def peek_many(self, keys: list[str]) -> dict[str, bytes]:
        mapped = {self._k(k): k for k in keys}
        return {mapped[k]: v for k, v in self._call(self._client.get_many, list(mapped)).items()}

    def cas(self, key: str, expected: bytes, new: bytes, ttl: float = 0) -> bool:
        k, ttl_s = self._k(key), self._ttl(ttl)
        # The token of this handle's last read or write of ``k``: if the item still has it,
        # nobody has written it since, so it still holds that value (no extra ``gets``).
        if (known := self._tokens.pop(k, None)) is not None and known[0] == expected:
            if (stored := self._cas_write(k, new, known[1], ttl_s)) is not None:
                return stored
        value, token = self._call(self._client.gets, k)  # unknown, or written meanwhile
        return value == expected and bool(self._cas_write(k, new, token, ttl_s))

    def _cas_write(self, k: bytes, new: bytes, token: bytes, ttl: int) -> bool | None:
        """Meta-set ``k`` to ``new`` iff its CAS token is ``token`` (then remember the new
        one): ``True`` if stored, ``False`` if the key is missing, ``None`` if written since."""
        stored, line = self._meta(b"ms %b %d T%d C%b c\r\n%b" % (k, len(new), ttl, token, new),
                                  {b"HD": True, b"EX": None, b"NF": False})
        if stored:
            self._remember(((k, (new, flag[1:])) for flag in line.split()[1:]
                            if flag.startswith(b"c")))
        return stored

    def _remember(self, tokens: Any) -> None:
        """Keep ``(key, (value, cas token))`` pairs for :meth:`cas` (bounded)."""
        if len(self._tokens) > 4096:
            self._tokens.clear()
        self._tokens.update(tokens)

    def _meta(self, request: bytes, answers: dict[bytes, bool | None]) -> tuple[Any, bytes]:
        """Send one meta command (memcached >= 1.6) and map its reply's status through
        ``answers`` (any other reply raises); returns ``(answer, reply line)``."""
        try:
            line = self._call(self._client.raw_command, request)
        except ExchangeError as exc:  # "ERROR": a server without meta commands
            if not isinstance(exc.__cause__, MemcacheUnknownCommandError):
                raise
            line = b"ERROR"
        if line[:2] in answers:
            return answers[line[:2]], line
        raise ExchangeError(f"{self.describe} answered {line!r} to a meta "
                            f"{'get' if request.startswith(b'mg') else 'set'}; the exchange "
                            "needs memcached >= 1.6")

    def incr(self, key: str, ttl: float = 0) -> int:
        k = self._k(key)
        for _ in range(3):
            if (value := self._call(self._client.incr, k, 1)) is not None:
                return int(value)
            self._call(self._client.add, k, str(time.time_ns() // 1000).encode(), self._ttl(ttl))
        raise ExchangeError(f"{self.describe} did not keep counter {key!r}")

    def delete(self, key: str) -> None:
        self._call(self._client.delete, self._k(key))

    def exists(self, key: str) -> bool:
        # Meta get without flags ("mg <key>"): "HD" if present, "EN" if not. Transfers no
        # data and, unlike ``touch``, leaves the key's expiry alone (memcached >= 1.6).
        return self._meta(b"mg " + self._k(key), {b"HD": True, b"EN": False})[0]

    def put_payload(self, key: str, encoded: Encoded, ttl: float = 0) -> bool:
        data = encoded.tobytes()  # (a single bytes buffer is returned as is: no copy)
        head, names, size = data, [], self.chunk_size
        if len(data) > size:
            n, view = math.ceil(len(data) / size), memoryview(data)
            head = _DESCRIPTOR.pack(_DESC_MAGIC, n, len(data), os.urandom(8))
            names = [self._k(name) for name in _chunk_names(key, head)]
            chunks = {k: bytes(view[i * size:(i + 1) * size]) for i, k in enumerate(names)}
            if failed := self._call(self._client.set_many, chunks, self._ttl(ttl)):
                self._drop(names)
                raise ExchangeError(f"{self.describe} did not store {len(failed)} chunk(s) "
                                    f"of {key!r}; give it more memory (-m)")
        # ``add`` in its meta form: one round trip, without pymemcache's per-call checks.
        stored = self._meta(b"ms %b %d T%d ME\r\n%b" % (self._k(key), len(head),
                                                         self._ttl(ttl), head),
                            {b"HD": True, b"NS": False})[0]
        if not stored:
            self._drop(names)
        return stored

    def _drop(self, keys: list[bytes]) -> None:
        """Delete memcached keys without waiting for replies (clean-up only)."""
        if keys:
            self._call(self._client.delete_many, keys, noreply=True)

    def get_payload(self, key: str) -> bytearray | None:
        return self.read_message([], key)[1]

    def read_message(self, small_keys: list[str],
                     payload_key: str) -> tuple[dict[str, bytes], bytearray | None]:
        # One round trip, keys in order. Plain ``get``: no CAS tokens to parse (the
        # payload needs none, and the consumer's ack write uses its own last token).
        got = self.peek_many([*small_keys, payload_key])
        head = got.pop(payload_key, None)
        return got, None if head is None else self.resolve_payload(payload_key, head)

    def resolve_payload(self, key: str, head: bytes) -> bytearray:
        """Turn a payload item (whole message or chunk descriptor) into the message bytes."""
        names = self._chunks[key] = _chunk_names(key, head)
        if not names:
            return bytearray(head)
        total, got = _DESCRIPTOR.unpack(head)[2], self.peek_many(names)
        if missing := [i for i, name in enumerate(names) if name not in got]:
            raise ExchangeStateLostError(
                f"chunk {missing[0]}/{len(names)} of {key!r} is missing from {self.describe}: "
                "evicted or the server restarted; give memcached more memory (-m) and restart "
                "both processes with a new run id")
        buf = bytearray().join(got[name] for name in names)
        if len(buf) != total:
            raise ExchangeStateLostError(f"chunks of {key!r} hold {len(buf)} bytes, descriptor "
                                         f"says {total}: mixed chunks on {self.describe}")
        return buf

    def delete_payload(self, key: str) -> None:
        if (names := self._chunks.pop(key, None)) is None:
            head = self.peek_many([key]).get(key)
            names = [] if head is None else _chunk_names(key, head)
        self._drop([self._k(name) for name in [key, *names]])

    def clone(self) -> MemcachedStore:
        return MemcachedStore(self.address, timeout=self._timeout, chunk_size=self.chunk_size,
                              key_ttl=self.key_ttl)

    def close(self) -> None:
        self._client.close()
