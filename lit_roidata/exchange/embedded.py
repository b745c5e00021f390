"""The embedded backend: a directory of files on one machine, no server (spec §8.4).

Unrelated processes started separately meet in ``<root>/<run>/<rank>/<channel>/`` (the
root defaults to ``/dev/shm`` when it exists, so payloads never touch a disk). Atomicity
comes from the file system:

* ``set`` writes a temporary file and ``os.replace``-s it: readers see old or new.
* ``put_payload`` writes a temporary file and ``os.link``-s it to its final name: the
  link appears atomically, complete, and fails if the name exists (write-once).
* ``add`` and ``cas`` (lease acquisition and heartbeats only) run under a per-directory
  :class:`filelock.FileLock`.

A small value file holds an 8-byte little-endian expiry time (``time.time()``, 0 = never)
followed by the value, which gives leases a TTL without a server.
"""

from __future__ import annotations

import errno
import os
import struct
import tempfile
import time
from pathlib import Path

from filelock import FileLock

from lit_roidata.exchange.errors import ExchangeError
from lit_roidata.exchange.store import Store
from lit_roidata.exchange.wire import Encoded

__all__ = ["EmbeddedStore", "default_root"]

_EXPIRY = struct.Struct("<d")


def default_root() -> Path:
    """``$LIT_ROIDATA_EXCHANGE_DIR``, else ``/dev/shm/lit_roidata_exchange-<uid>``, else tmp."""
    env = os.environ.get("LIT_ROIDATA_EXCHANGE_DIR")
    if env:
        return Path(env)
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return base / f"lit_roidata_exchange-{os.getuid() if hasattr(os, 'getuid') else 0}"


class EmbeddedStore(Store):
    """File-backed :class:`~lit_roidata.exchange.store.Store` under ``root``.

    Args:
        root: directory shared by the processes that exchange blobs (created if missing).
    """

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ExchangeError(f"cannot create the exchange directory {self.root}: {exc}; "
                                "pass address=<writable dir> or set LIT_ROIDATA_EXCHANGE_DIR"
                                ) from exc
        self.describe = f"embedded exchange directory {self.root}"
        self._root = str(self.root) + "/"
        self._made: set[str] = set()

    # -- helpers -------------------------------------------------------------------------
    # Plain strings and os.* calls: pathlib and buffered io cost more than the syscalls.
    def _path(self, key: str) -> str:
        path = self._root + key
        parent = path.rpartition("/")[0]
        if parent not in self._made:
            os.makedirs(parent, exist_ok=True)
            self._made.add(parent)
        return path

    @staticmethod
    def _write_tmp(path: str, chunks: list) -> str:
        tmp = f"{path}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            views = [memoryview(c).cast("B") for c in chunks]
            views = [v for v in views if len(v)]
            while views:
                n = os.writev(fd, views[:512])
                while views and n >= len(views[0]):  # drop fully written buffers
                    n -= len(views[0])
                    views.pop(0)
                if n:
                    views[0] = views[0][n:]
        finally:
            os.close(fd)
        return tmp

    @staticmethod
    def _read_small(path: str) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            parts = []
            while True:
                part = os.read(fd, 65536)
                if not part:
                    break
                parts.append(part)
        finally:
            os.close(fd)
        raw = b"".join(parts)
        if len(raw) < _EXPIRY.size:
            return None  # cannot happen with atomic writes; treat as absent
        (expiry,) = _EXPIRY.unpack_from(raw)
        if expiry and expiry < time.time():
            return None
        return raw[_EXPIRY.size:]

    @staticmethod
    def _expiry(ttl: float) -> bytes:
        return _EXPIRY.pack(time.time() + ttl if ttl else 0.0)

    def _lock(self, path: str) -> FileLock:
        return FileLock(path.rpartition("/")[0] + "/.lock")

    # -- small values --------------------------------------------------------------------
    def add(self, key: str, value: bytes, ttl: float = 0) -> bool:
        path = self._path(key)
        with self._lock(path):
            if self._read_small(path) is not None:
                return False
            os.replace(self._write_tmp(path, [self._expiry(ttl), value]), path)
            return True

    def set(self, key: str, value: bytes, ttl: float = 0) -> None:
        path = self._path(key)
        os.replace(self._write_tmp(path, [self._expiry(ttl), value]), path)

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        out = {}
        for key in keys:
            value = self._read_small(self._root + key)
            if value is not None:
                out[key] = value
        return out

    def cas(self, key: str, expected: bytes, new: bytes, ttl: float = 0) -> bool:
        path = self._path(key)
        with self._lock(path):
            if self._read_small(path) != expected:
                return False
            os.replace(self._write_tmp(path, [self._expiry(ttl), new]), path)
            return True

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._root + key)
        except FileNotFoundError:
            pass

    def exists(self, key: str) -> bool:
        return os.path.exists(self._root + key)

    # -- payloads ------------------------------------------------------------------------
    def put_payload(self, key: str, encoded: Encoded) -> None:
        path = self._path(key)
        tmp = self._write_tmp(path, encoded.buffers)
        try:
            os.link(tmp, path)
        except FileExistsError as exc:
            raise ExchangeError(f"payload {path} already exists: a second writer published "
                                "the same sequence number") from exc
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV):
                raise
            # No hard links on this file system: fall back to an exclusive rename check.
            if os.path.exists(path):
                raise ExchangeError(f"payload {path} already exists") from exc
            os.replace(tmp, path)
            return
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def get_payload(self, key: str) -> bytearray | None:
        try:
            fd = os.open(self._root + key, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(size)
            view, got = memoryview(buf), 0
            while got < size:
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    raise ExchangeError(f"payload {self._root + key} shrank while reading")
                got += n
            return buf
        finally:
            os.close(fd)

    def delete_payload(self, key: str) -> None:
        self.delete(key)

    def clone(self) -> EmbeddedStore:
        return EmbeddedStore(self.root)
