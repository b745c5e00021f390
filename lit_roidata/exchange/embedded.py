"""The embedded backend: a directory of files on one machine, no server.

Processes meet in ``<root>/<run>/<rank>/<channel>/`` (``/dev/shm`` by default); small
values are replaced by rename, payloads published by hard link (or ``renameat2``),
``head``/``ack`` are two-slot CRC records updated in place under a per-directory ``flock``.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import shutil
import struct
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lit_roidata.exchange.errors import ExchangeError
from lit_roidata.exchange.backend import Store
from lit_roidata.exchange.wire import Encoded

__all__ = ["EmbeddedStore", "default_root"]

_EXPIRY = struct.Struct("<d")
_SPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100

# Records (the positions head and ack): two slots of magic, version, expiry, value length,
# value (up to 70 bytes) and a CRC-32 of all that.
_RECORD_SUFFIXES = ("/head", "/ack")
_MAGIC = b"LRX1"
_SLOT = struct.Struct("<4sQdH70s")
_CRC = struct.Struct("<I")
_SLOT_SIZE = _SLOT.size + _CRC.size
_RECORD_SIZE = 2 * _SLOT_SIZE
_TORN_RETRIES = 3


def _pack_slot(version: int, expiry: float, value: bytes) -> bytes:
    if len(value) > 70:
        raise ExchangeError(f"a position value is limited to 70 bytes, got {len(value)}")
    body = _SLOT.pack(_MAGIC, version, expiry, len(value), value)
    return body + _CRC.pack(zlib.crc32(body))


def _parse_record(raw: bytes) -> tuple[int, float, bytes] | None:
    """``(version, expiry, value)`` of the valid slot with the highest version, or ``None``
    if neither slot is valid (both torn: a concurrent writer, or damage)."""
    if len(raw) < _RECORD_SIZE:
        return None
    valid = []
    for start in (0, _SLOT_SIZE):
        body = raw[start:start + _SLOT.size]
        magic, version, expiry, n, value = _SLOT.unpack(body)
        if magic == _MAGIC and _CRC.unpack_from(raw, start + _SLOT.size)[0] == zlib.crc32(body):
            valid.append((version, expiry, value[:n]))
    return max(valid, default=None)


try:
    _renameat2 = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6",
                             use_errno=True).renameat2
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                           ctypes.c_uint]
    _renameat2.restype = ctypes.c_int
except (OSError, AttributeError):
    _renameat2 = None


def rename_noreplace(src: str, dst: str) -> None:
    """Atomically rename ``src`` to ``dst``, failing if ``dst`` exists (``renameat2``).

    Raises:
        FileExistsError: ``dst`` exists (nothing was renamed).
        OSError: ``errno.ENOTSUP``: no exclusive rename in the C library or file system.
    """
    if _renameat2 is None:
        raise OSError(errno.ENOTSUP, "renameat2 is not available in this C library")
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                  _RENAME_NOREPLACE) == 0:
        return
    err = ctypes.get_errno()
    err = errno.ENOTSUP if err in (errno.EINVAL, errno.ENOSYS) else err
    raise OSError(err, os.strerror(err), dst)  # (EEXIST makes it a FileExistsError)


def default_root() -> Path:
    """``$LIT_ROIDATA_EXCHANGE_DIR``, else ``/dev/shm/lit_roidata_exchange-<uid>``, else tmp."""
    if env := os.environ.get("LIT_ROIDATA_EXCHANGE_DIR"):
        return Path(env)
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return base / f"lit_roidata_exchange-{os.getuid() if hasattr(os, 'getuid') else 0}"


class EmbeddedStore(Store):
    """File-backed :class:`~lit_roidata.exchange.backend.Store` under ``root`` (created if
    missing); ``hard_links=False`` publishes payloads with the exclusive rename."""

    def __init__(self, root: str | os.PathLike | None = None, *, hard_links: bool = True) -> None:
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
        self._links = hard_links
        self._lockfds: dict[str, int] = {}  # lock path -> fd kept open
        self._recfds: dict[str, int] = {}  # record path -> fd kept open (O_RDWR)

    # Plain strings and os.* calls: pathlib and buffered io cost more than the syscalls.
    def _path(self, key: str) -> str:
        path = self._root + key
        parent = path.rpartition("/")[0]
        if parent not in self._made:
            os.makedirs(parent, exist_ok=True)
            self._made.add(parent)
        return path

    def _space_error(self, path: str, exc: OSError, needed: int) -> ExchangeError:
        directory = path.rpartition("/")[0]
        try:
            free_txt = f"{shutil.disk_usage(directory).free / 1e6:.1f} MB free"
        except OSError:
            free_txt = "free space unknown"
        return ExchangeError(
            f"cannot write {needed / 1e6:.1f} MB to the exchange directory {directory} "
            f"({exc.strerror or exc}; {free_txt} there, {needed / 1e6:.1f} MB needed per "
            "message). The partial file was removed. Free space there or point the "
            "embedded store at a larger directory: BlobExchange(..., shm_dir=<dir>) or "
            "LIT_ROIDATA_EXCHANGE_DIR=<dir> (in Docker, raise /dev/shm with --shm-size)")

    def _write_new(self, path: str, chunks: list, place: Callable[[str, str], Any]) -> Any:
        """Write ``chunks`` to a new temporary file next to ``path``, then return
        ``place(tmp, path)``; the temporary file is always removed (no space raises
        :class:`ExchangeError`)."""
        tmp = f"{path}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        views = [v for v in (memoryview(c).cast("B") for c in chunks) if len(v)]
        needed, fd = sum(len(v) for v in views), None
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:  # the directory was swept away: make it again
                os.makedirs(path.rpartition("/")[0], exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            while views:
                n = os.writev(fd, views[:512])
                if n == 0:
                    raise OSError(errno.ENOSPC, "no progress writing")
                while views and n >= len(views[0]):  # drop fully written buffers
                    n -= len(views[0])
                    views.pop(0)
                if n:
                    views[0] = views[0][n:]
        except BaseException as exc:
            if fd is not None:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if isinstance(exc, OSError) and exc.errno in _SPACE_ERRNOS:
                raise self._space_error(path, exc, needed) from exc
            raise
        os.close(fd)
        try:
            return place(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    @staticmethod
    def _read_file(path: str) -> bytearray | None:
        """The whole file as a writable buffer, ``None`` if it does not exist."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            buf = bytearray(os.fstat(fd).st_size)
            view, got = memoryview(buf), 0
            while got < len(buf):
                n = os.readv(fd, [view[got:]])
                if n == 0:
                    raise ExchangeError(f"payload {path} shrank while reading")
                got += n
            return buf
        finally:
            os.close(fd)

    def _read_small(self, path: str) -> bytes | None:
        if (raw := self._read_file(path)) is None or len(raw) < _EXPIRY.size:
            return None  # (too short cannot happen with atomic writes: treat as absent)
        (expiry,) = _EXPIRY.unpack_from(raw)
        return None if expiry and expiry < time.time() else bytes(raw[_EXPIRY.size:])

    @staticmethod
    def _fd(cache: dict[str, int], path: str, flags: int) -> int | None:
        """A kept-open fd of ``path`` (re-opened once the file was removed), ``None`` if it
        does not exist."""
        if (fd := cache.get(path)) is not None and os.fstat(fd).st_nlink:
            return fd
        if fd is not None:
            os.close(cache.pop(path))
        try:
            cache[path] = os.open(path, flags, 0o644)
        except FileNotFoundError:
            if flags & os.O_CREAT:
                raise
        return cache.get(path)

    @contextlib.contextmanager
    def _lock(self, path: str) -> Iterator[None]:
        """Exclusive ``flock`` on the directory's ``.lock`` file (fd kept per handle)."""
        lock = path.rpartition("/")[0] + "/.lock"
        while True:
            fd = self._fd(self._lockfds, lock, os.O_RDWR | os.O_CREAT)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink:
                break
            # The lock file was removed: a lock on it excludes nobody. Open the current one.
            fcntl.flock(fd, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _read_record(self, path: str, locked: bool = False) -> tuple[int, float, bytes] | None:
        """``(version, expiry, value)`` of a record file, ``None`` if there is none (a torn
        read without the lock is retried, then repeated under the lock)."""
        for _ in range(1 if locked else _TORN_RETRIES):
            if (fd := self._fd(self._recfds, path, os.O_RDWR)) is None:
                return None
            if (rec := _parse_record(os.pread(fd, _RECORD_SIZE, 0))) is not None:
                return rec
        if not locked:
            with self._lock(path):
                return self._read_record(path, locked=True)
        raise ExchangeError(f"the position file {path} is damaged (neither of its slots "
                            "passes its CRC); delete the run directory and start a new run")

    def _value(self, path: str, locked: bool = False) -> tuple[bytes | None, tuple | None]:
        """Current value (``None``: absent or expired) and, for a record, what was read."""
        if not path.endswith(_RECORD_SUFFIXES):
            return self._read_small(path), None
        rec = self._read_record(path, locked)
        expired = rec is None or (rec[1] and rec[1] < time.time())
        return (None if expired else rec[2]), rec

    def _write(self, path: str, value: bytes, ttl: float, rec: tuple | None) -> None:
        """Replace a small value's file; rewrite a record's older slot in place (under the
        caller's lock, ``rec``: what it read)."""
        expiry = time.time() + ttl if ttl else 0.0
        if not path.endswith(_RECORD_SUFFIXES):
            return self._write_new(path, [_EXPIRY.pack(expiry), value], os.replace)
        if rec is None:  # create it whole
            return self._write_new(path, [_pack_slot(0, expiry, value) + bytes(_SLOT_SIZE)],
                                   os.replace)
        version = rec[0] + 1
        try:
            os.pwrite(self._recfds[path], _pack_slot(version, expiry, value),
                      (version & 1) * _SLOT_SIZE)
        except OSError as exc:
            if exc.errno in _SPACE_ERRNOS:
                raise self._space_error(path, exc, _SLOT_SIZE) from exc
            raise

    def _rmw(self, key: str, ttl: float, decide: Callable[[bytes | None], tuple]) -> Any:
        """One locked read-check-write: ``decide(current)`` gives ``(new value or None to
        leave it, result)``; returns the result."""
        path = self._path(key)
        with self._lock(path):
            cur, rec = self._value(path, locked=True)
            new, result = decide(cur)
            if new is not None:
                self._write(path, new, ttl, rec)
            return result

    def add(self, key: str, value: bytes, ttl: float = 0) -> bool:
        return self._rmw(key, ttl, lambda cur: (value, True) if cur is None else (None, False))

    def set(self, key: str, value: bytes, ttl: float = 0) -> None:
        if key.endswith(_RECORD_SUFFIXES):  # written in place: writers take the lock
            self._rmw(key, ttl, lambda cur: (value, None))
        else:
            self._write(self._path(key), value, ttl, None)

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        got = {key: self._value(self._root + key)[0] for key in keys}
        return {key: value for key, value in got.items() if value is not None}

    def cas(self, key: str, expected: bytes, new: bytes, ttl: float = 0) -> bool:
        return self._rmw(key, ttl, lambda cur: (new, True) if cur == expected else (None, False))

    local_fence = True
    volatile = False

    def fence(self, key: str, new: bytes, gen: int) -> tuple[bool, bytes | None]:
        def decide(cur: bytes | None) -> tuple:
            if cur is None or (b" " in cur and int(cur.split(b" ", 1)[1]) > gen):
                return None, (False, cur)
            return (new if cur != new else None), (True, cur)

        return self._rmw(key, 0, decide)  # a pwrite for a record

    def incr(self, key: str, ttl: float = 0) -> int:
        def bump(cur: bytes | None) -> tuple:
            value = (int(cur) if cur is not None else time.time_ns() // 1000) + 1
            return str(value).encode(), value

        return self._rmw(key, ttl, bump)

    def delete(self, key: str) -> None:
        if (fd := self._recfds.pop(self._root + key, None)) is not None:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._root + key)

    def exists(self, key: str) -> bool:
        return os.path.exists(self._root + key)

    def put_payload(self, key: str, encoded: Encoded, ttl: float = 0) -> bool:
        return self._write_new(self._path(key), encoded.buffers, self._link_new)

    def _link_new(self, tmp: str, path: str) -> bool:
        """Publish ``tmp`` as ``path`` unless it exists (hard link, else exclusive rename)."""
        try:
            if self._links:
                try:
                    os.link(tmp, path)
                    return True
                except OSError as exc:
                    if isinstance(exc, FileExistsError) or exc.errno not in (
                            errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                        raise
                    self._links = False  # no hard links here: use the exclusive rename
            rename_noreplace(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno != errno.ENOTSUP:
                raise
            raise ExchangeError(
                f"the file system of the exchange directory {self.root} supports neither "
                "hard links nor an exclusive rename (renameat2 RENAME_NOREPLACE), so a "
                "payload cannot be published atomically and exactly once there. Use "
                "/dev/shm or a local file system (shm_dir=... or LIT_ROIDATA_EXCHANGE_DIR)"
            ) from exc

    def get_payload(self, key: str) -> bytearray | None:
        return self._read_file(self._root + key)

    delete_payload = delete

    def sweep_stale_runs(self, stale_after: float, keep: str | None = None) -> list[str]:
        """Remove run directories (but ``keep``) with no live lease owner and no file changed
        for ``stale_after`` seconds; return their ids."""
        from lit_roidata.exchange.lease import LeaseRecord, peer_liveness

        removed, now = [], time.time()
        try:
            runs = list(os.scandir(self.root))
        except OSError:
            return removed
        for run in runs:
            if run.name == keep or not run.is_dir(follow_symlinks=False):
                continue
            newest, live = 0.0, False
            for dirpath, _, files in os.walk(run.path):
                for name in files:
                    full = os.path.join(dirpath, name)
                    try:
                        newest = max(newest, os.stat(full).st_mtime)
                    except OSError:
                        continue
                    if name.startswith("lease.") and not name.endswith(".tmp"):
                        rec = LeaseRecord.loads(self._read_small(full))
                        live = live or peer_liveness(rec) == "alive"
                if live:
                    break
            if not live and now - newest >= stale_after:
                shutil.rmtree(run.path, ignore_errors=True)
                removed.append(run.name)
        return removed

    def remove_run_if_unused(self, run_id: str) -> bool:
        """Remove ``<root>/<run_id>`` if no channel directory is left in it; return whether
        it was removed."""
        run = self._root + run_id
        try:
            entries = list(os.scandir(run))
        except OSError:
            return False
        if any(e.is_dir(follow_symlinks=False) for e in entries):
            return False
        shutil.rmtree(run, ignore_errors=True)
        self._made.discard(run)
        return True

    def delete_namespace(self, prefix: str, keys: list[str] | None = None,
                         payloads: list[str] | None = None) -> None:
        """Remove every key under ``prefix`` (a channel's directory) and the directory."""
        directory = self._root + prefix
        self.close()
        shutil.rmtree(directory, ignore_errors=True)
        self._made.discard(directory)
        # Remove now-empty parents (rank, run) but never the root.
        parent = directory.rpartition("/")[0]
        while len(parent) + 1 > len(self._root):
            try:
                os.rmdir(parent)
            except OSError:
                break
            self._made.discard(parent)
            parent = parent.rpartition("/")[0]

    def clone(self) -> EmbeddedStore:
        return EmbeddedStore(self.root, hard_links=self._links)

    def close(self) -> None:
        for fd in [*self._lockfds.values(), *self._recfds.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._lockfds, self._recfds = {}, {}
