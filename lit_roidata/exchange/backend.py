"""The key-value primitives a backend provides to the channel protocol.

Keys are logical paths ``"<run>/<rank>/<channel>/<name>"``; payloads are written once and
read back as a writable ``bytearray``. Every method succeeds, returns its "absent"/"refused"
value, or raises :class:`StoreUnavailable` (transient) or ``ExchangeError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from lit_roidata.exchange.errors import ExchangeError
from lit_roidata.exchange.wire import Encoded

__all__ = ["Store", "StoreUnavailable"]


class StoreUnavailable(ExchangeError):
    """The backend could not be reached (connection refused/reset); retry within a deadline."""


class Store(ABC):
    """Key-value operations needed by a channel. Not thread-safe: one per thread or a lock."""

    #: Human-readable location used in error messages, e.g. ``"memcached at 127.0.0.1:11211"``.
    describe: str = "store"

    @abstractmethod
    def add(self, key: str, value: bytes, ttl: float = 0) -> bool:
        """Create ``key`` only if absent (or expired); return whether it was created."""

    @abstractmethod
    def set(self, key: str, value: bytes, ttl: float = 0) -> None:
        """Store ``value`` under ``key`` atomically (readers see old or new, never a mix)."""

    @abstractmethod
    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        """Values of the present keys. Keys are read in the given order (see channel.get)."""

    @abstractmethod
    def cas(self, key: str, expected: bytes, new: bytes, ttl: float = 0) -> bool:
        """Replace ``key``'s value with ``new`` iff it currently equals ``expected``."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key`` if present."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether a (payload or small) key is present."""

    @abstractmethod
    def incr(self, key: str, ttl: float = 0) -> int:
        """Atomically increment a counter and return the new value; a missing one starts
        from the time in microseconds (so it grows across a restart that lost it)."""

    @abstractmethod
    def put_payload(self, key: str, encoded: Encoded, ttl: float = 0) -> bool:
        """Write a payload once, visible atomically and completely; ``False`` if ``key``
        exists. ExchangeError if the backend refused it (too large, no memory or space)."""

    @abstractmethod
    def get_payload(self, key: str) -> bytearray | None:
        """The whole payload as a writable buffer, or ``None`` if it was never written;
        ExchangeStateLostError if it was partly lost (e.g. an evicted chunk)."""

    @abstractmethod
    def delete_payload(self, key: str) -> None:
        """Remove a payload (all of its parts) if present."""

    @abstractmethod
    def clone(self) -> Store:
        """A new, independent handle on the same storage (e.g. for a heartbeat thread)."""

    #: Whether :meth:`fence` is one atomic local operation (no prior read needed).
    local_fence: bool = False
    #: Whether the store can lose state by itself (a server restarting or evicting): then
    #: every poll also checks the run's incarnation key.
    volatile: bool = True

    def fence(self, key: str, new: bytes, gen: int) -> tuple[bool, bytes | None]:
        """Replace ``key`` (``"<seq> <gen>"``) with ``new`` unless its generation is newer
        than ``gen``: ``(done, current value or None)``. Backends with ``local_fence`` only."""
        raise NotImplementedError

    def close(self) -> None:
        """Release connections/handles. Idempotent."""

    def delete_namespace(self, prefix: str, keys: list[str], payloads: list[str]) -> None:
        """Remove a finished channel: ``keys`` and ``payloads`` (all under ``prefix``)."""
        for key in keys:
            self.delete(key)
        for key in payloads:
            self.delete_payload(key)

    def read_message(self, small_keys: list[str],
                     payload_key: str) -> tuple[dict[str, bytes], bytearray | None]:
        """Read ``small_keys``, then the payload (so a consumer tells "not yet published"
        from "published, then lost"), in one round trip if the backend can."""
        return self.get_many(small_keys), self.get_payload(payload_key)

    def peek_many(self, keys: list[str]) -> dict[str, bytes]:
        """Like :meth:`get_many`, for values that will not be compare-and-swapped next
        (a backend may then skip fetching CAS tokens)."""
        return self.get_many(keys)

    def get(self, key: str) -> bytes | None:
        """Value of one key, or ``None``."""
        return self.get_many([key]).get(key)
