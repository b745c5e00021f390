"""The embedded backend: a directory of files on one machine, no server.

Processes meet in ``<root>/<run>/<rank>/<channel>/`` (``/dev/shm`` by default). Small
values are replaced by rename, payloads published by hard link (or an exclusive
``renameat2``), ``head``/``ack`` are two-slot CRC records updated in place under a
per-directory ``flock``; docs/exchange.md ("Backends") has the details.
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
from collections.abc import Iterator
from pathlib import Path

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
_RECORD = struct.Struct("<" + 2 * (_SLOT.format[1:] + _CRC.format[1:]))  # both slots
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
    m0, v0, e0, n0, val0, c0, m1, v1, e1, n1, val1, c1 = _RECORD.unpack_from(raw)
    ok0 = m0 == _MAGIC
    ok1 = m1 == _MAGIC
    if ok1 and (not ok0 or v1 > v0):  # check the newer slot first, the other if it is torn
        if zlib.crc32(raw[_SLOT_SIZE:_SLOT_SIZE + _SLOT.size]) == c1:
            return v1, e1, val1[:n1]
        ok1 = False
    if ok0 and zlib.crc32(raw[:_SLOT.size]) == c0:
        return v0, e0, val0[:n0]
    if ok1 and zlib.crc32(raw[_SLOT_SIZE:_SLOT_SIZE + _SLOT.size]) == c1:
        return v1, e1, val1[:n1]
    return None


def _libc_renameat2():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                   ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_renameat2 = _libc_renameat2()


def rename_noreplace(src: str, dst: str) -> None:
    """Atomically rename ``src`` to ``dst``, failing if ``dst`` exists (``renameat2``).

    Raises:
        FileExistsError: ``dst`` exists (nothing was renamed).
        OSError: with ``errno.ENOTSUP`` if neither the C library nor the file system
            supports an exclusive rename.
    """
    if _renameat2 is None:
        raise OSError(errno.ENOTSUP, "renameat2 is not available in this C library")
    if _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst),
                  _RENAME_NOREPLACE) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        raise FileExistsError(err, os.strerror(err), dst)
    if err in (errno.EINVAL, errno.ENOSYS):
        err = errno.ENOTSUP
    raise OSError(err, os.strerror(err), dst)


def default_root() -> Path:
    """``$LIT_ROIDATA_EXCHANGE_DIR``, else ``/dev/shm/lit_roidata_exchange-<uid>``, else tmp."""
    env = os.environ.get("LIT_ROIDATA_EXCHANGE_DIR")
    if env:
        return Path(env)
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
    return base / f"lit_roidata_exchange-{os.getuid() if hasattr(os, 'getuid') else 0}"


class EmbeddedStore(Store):
    """File-backed :class:`~lit_roidata.exchange.backend.Store` under ``root``.

    Args:
        root: directory shared by the processes that exchange blobs (created if missing).
        hard_links: ``False`` publishes payloads with the exclusive rename instead of
            ``link`` (what happens automatically on a file system without hard links).
    """

    def __init__(self, root: str | os.PathLike | None = None, *,
                 hard_links: bool = True) -> None:
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
        self._lockfds: dict[str, int] = {}
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
            free = shutil.disk_usage(directory).free
            free_txt = f"{free / 1e6:.1f} MB free"
        except OSError:
            free_txt = "free space unknown"
        return ExchangeError(
            f"cannot write {needed / 1e6:.1f} MB to the exchange directory {directory} "
            f"({exc.strerror or exc}; {free_txt} there, {needed / 1e6:.1f} MB needed per "
            "message). The partial file was removed. Free space there or point the "
            "embedded store at a larger directory: BlobExchange(..., shm_dir=<dir>) or "
            "LIT_ROIDATA_EXCHANGE_DIR=<dir> (in Docker, raise /dev/shm with --shm-size)")

    def _write_tmp(self, path: str, chunks: list) -> str:
        """Write ``chunks`` to a new temporary file next to ``path``; return its name.

        On failure the temporary file is removed; running out of space (or into a file
        size limit) raises :class:`ExchangeError` naming the directory and the sizes.
        """
        tmp = f"{path}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        views = [memoryview(c).cast("B") for c in chunks]
        views = [v for v in views if len(v)]
        needed = sum(len(v) for v in views)
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:  # the directory was swept away: make it again
                os.makedirs(path.rpartition("/")[0], exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            if exc.errno in _SPACE_ERRNOS:
                raise self._space_error(path, exc, needed) from exc
            raise
        try:
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
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError) and exc.errno in _SPACE_ERRNOS:
                raise self._space_error(path, exc, needed) from exc
            raise
        os.close(fd)
        return tmp

    @staticmethod
    def _read_small(path: str) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            raw = os.read(fd, 65536)  # small values: one read returns the whole file
            if len(raw) == 65536:
                parts = [raw]
                while part := os.read(fd, 65536):
                    parts.append(part)
                raw = b"".join(parts)
        finally:
            os.close(fd)
        if len(raw) < _EXPIRY.size:
            return None  # cannot happen with atomic writes; treat as absent
        (expiry,) = _EXPIRY.unpack_from(raw)
        if expiry and expiry < time.time():
            return None
        return raw[_EXPIRY.size:]

    @staticmethod
    def _expiry(ttl: float) -> bytes:
        return _EXPIRY.pack(time.time() + ttl if ttl else 0.0)

    @contextlib.contextmanager
    def _lock(self, path: str) -> Iterator[None]:
        """Exclusive ``flock`` on the directory's ``.lock`` file (fd kept per handle)."""
        directory = path.rpartition("/")[0]
        while True:
            fd = self._lockfds.get(directory)
            if fd is None:
                fd = os.open(directory + "/.lock", os.O_RDWR | os.O_CREAT, 0o644)
                self._lockfds[directory] = fd
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink:
                break
            # The lock file was removed (the channel was deleted and maybe re-created):
            # a lock on the old file excludes nobody. Open the current one.
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            del self._lockfds[directory]
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _replace(self, path: str, value: bytes, ttl: float) -> None:
        self._replace_parts(path, [self._expiry(ttl), value])

    def _replace_parts(self, path: str, parts: list[bytes]) -> None:
        """Write ``parts`` to a temp file and rename it over ``path`` (no partial file
        is ever visible; the temp file is removed on failure)."""
        tmp = self._write_tmp(path, parts)
        try:
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _record_fd(self, path: str) -> int | None:
        fd = self._recfds.get(path)
        if fd is not None:
            if os.fstat(fd).st_nlink:
                return fd
            os.close(fd)  # removed (the channel was deleted)
            del self._recfds[path]
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        self._recfds[path] = fd
        return fd

    def _read_record(self, path: str, locked: bool = False) -> tuple[int, float, bytes] | None:
        """``(version, expiry, value)`` of a record file, ``None`` if there is none.
        Without the lock, a read that finds both slots torn is retried, then repeated under
        the lock."""
        for _ in range(1 if locked else _TORN_RETRIES):
            fd = self._record_fd(path)
            if fd is None:
                return None
            rec = _parse_record(os.pread(fd, _RECORD_SIZE, 0))
            if rec is not None:
                return rec
        if not locked:
            with self._lock(path):
                return self._read_record(path, locked=True)
        raise ExchangeError(f"the position file {path} is damaged (neither of its slots "
                            "passes its CRC); delete the run directory and start a new run")

    def _record_value(self, path: str, locked: bool = False) -> bytes | None:
        rec = self._read_record(path, locked)
        if rec is None or (rec[1] and rec[1] < time.time()):
            return None
        return rec[2]

    def _write_record(self, path: str, value: bytes, ttl: float,
                      rec: tuple[int, float, bytes] | None) -> None:
        """Write a record (the caller holds the lock and passes what it read under it)."""
        expiry = time.time() + ttl if ttl else 0.0
        if rec is None:  # create it whole
            self._replace_parts(path, [_pack_slot(0, expiry, value) + bytes(_SLOT_SIZE)])
            return
        version = rec[0] + 1
        try:
            os.pwrite(self._recfds[path], _pack_slot(version, expiry, value),
                      (version & 1) * _SLOT_SIZE)
        except OSError as exc:
            if exc.errno in _SPACE_ERRNOS:
                raise self._space_error(path, exc, _SLOT_SIZE) from exc
            raise

    def _get_locked(self, path: str) -> tuple[bytes | None, tuple | None]:
        """Current value (``None``: absent or expired) and, for a record, what was read."""
        if path.endswith(_RECORD_SUFFIXES):
            rec = self._read_record(path, locked=True)
            if rec is None or (rec[1] and rec[1] < time.time()):
                return None, rec
            return rec[2], rec
        return self._read_small(path), None

    def _set_locked(self, path: str, value: bytes, ttl: float, rec: tuple | None) -> None:
        if path.endswith(_RECORD_SUFFIXES):
            self._write_record(path, value, ttl, rec)
        else:
            self._replace(path, value, ttl)

    def add(self, key: str, value: bytes, ttl: float = 0) -> bool:
        path = self._path(key)
        with self._lock(path):
            cur, rec = self._get_locked(path)
            if cur is not None:
                return False
            self._set_locked(path, value, ttl, rec)
            return True

    def set(self, key: str, value: bytes, ttl: float = 0) -> None:
        path = self._path(key)
        if path.endswith(_RECORD_SUFFIXES):  # written in place: writers take the lock
            with self._lock(path):
                self._write_record(path, value, ttl, self._read_record(path, locked=True))
        else:
            self._replace(path, value, ttl)

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        out = {}
        for key in keys:
            path = self._root + key
            value = (self._record_value(path) if path.endswith(_RECORD_SUFFIXES)
                     else self._read_small(path))
            if value is not None:
                out[key] = value
        return out

    def cas(self, key: str, expected: bytes, new: bytes, ttl: float = 0) -> bool:
        path = self._path(key)
        with self._lock(path):
            cur, rec = self._get_locked(path)
            if cur != expected:
                return False
            self._set_locked(path, new, ttl, rec)
            return True

    local_fence = True
    volatile = False

    def fence(self, key: str, new: bytes, gen: int) -> tuple[bool, bytes | None]:
        path = self._path(key)
        with self._lock(path):  # one locked read-check-write (a pwrite for a record)
            cur, rec = self._get_locked(path)
            if cur is None:
                return False, None
            parts = cur.split(b" ", 1)
            if len(parts) > 1 and int(parts[1]) > gen:
                return False, cur
            if cur != new:
                self._set_locked(path, new, 0, rec)
            return True, cur

    def incr(self, key: str, ttl: float = 0) -> int:
        path = self._path(key)
        with self._lock(path):
            raw, rec = self._get_locked(path)
            value = (int(raw) if raw is not None else time.time_ns() // 1000) + 1
            self._set_locked(path, str(value).encode(), ttl, rec)
            return value

    def delete(self, key: str) -> None:
        fd = self._recfds.pop(self._root + key, None)
        if fd is not None:
            os.close(fd)
        try:
            os.unlink(self._root + key)
        except FileNotFoundError:
            pass

    def exists(self, key: str) -> bool:
        return os.path.exists(self._root + key)

    def put_payload(self, key: str, encoded: Encoded, ttl: float = 0) -> bool:
        path = self._path(key)
        tmp = self._write_tmp(path, encoded.buffers)
        try:
            if self._links:
                try:
                    os.link(tmp, path)
                    return True
                except FileExistsError:
                    return False
                except OSError as exc:
                    if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV,
                                         errno.EMLINK):
                        raise
                    self._links = False  # no hard links here: use the exclusive rename
            try:
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
                    "/dev/shm or a local file system (shm_dir=... or "
                    "LIT_ROIDATA_EXCHANGE_DIR)") from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
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

    def sweep_stale_runs(self, stale_after: float, keep: str | None = None) -> list[str]:
        """Remove run directories under the root that nobody owns any more.

        A run is stale when none of its lease files names a live owner (a lease of a
        process on this host that is gone, or an expired lease, does not count) and no
        file in it changed for ``stale_after`` seconds. ``keep`` (this process's run id)
        is never removed.

        Returns:
            The run ids removed.
        """
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
                        raw = self._read_small(full)
                        rec = LeaseRecord.loads(raw) if raw is not None else None
                        if peer_liveness(rec) == "alive":
                            live = True
                if live:
                    break
            if not live and now - newest >= stale_after:
                shutil.rmtree(run.path, ignore_errors=True)
                removed.append(run.name)
        return removed

    def remove_run_if_unused(self, run_id: str) -> bool:
        """Remove ``<root>/<run_id>`` if no channel directory is left in it (every channel
        of the run was closed by both ends); return whether it was removed."""
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
        fds, self._lockfds = self._lockfds, {}
        recs, self._recfds = self._recfds, {}
        for fd in [*fds.values(), *recs.values()]:
            with contextlib.suppress(OSError):
                os.close(fd)
