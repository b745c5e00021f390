"""The embedded backend: a directory of files on one machine, no server (Detectron semantics:
cross-process exchange).

Unrelated processes started separately meet in ``<root>/<run>/<rank>/<channel>/`` (the
root defaults to ``/dev/shm`` when it exists, so payloads never touch a disk). Atomicity
comes from the file system:

* ``set`` writes a temporary file and ``os.replace``-s it: readers see old or new.
* ``put_payload`` writes a temporary file and ``os.link``-s it to its final name: the
  link appears atomically, complete, and fails if the name exists (write-once). On a
  file system without hard links it uses ``renameat2(RENAME_NOREPLACE)`` instead, which
  is just as atomic and exclusive; a file system with neither is refused.
* ``add``, ``cas`` and ``incr`` run under a per-directory ``flock`` (one lock file per
  channel directory, kept open by each store handle).
* A failed write (full ``/dev/shm``, file size limit) removes its temporary file and
  raises :class:`~lit_roidata.exchange.errors.ExchangeError` naming the directory, the
  space needed and free, and how to point the store elsewhere.

A small value file holds an 8-byte little-endian expiry time (``time.time()``, 0 = never)
followed by the value, which gives leases a TTL without a server.
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
from collections.abc import Iterator
from pathlib import Path

from lit_roidata.exchange.errors import ExchangeError
from lit_roidata.exchange.store import Store
from lit_roidata.exchange.wire import Encoded

__all__ = ["EmbeddedStore", "default_root"]

_EXPIRY = struct.Struct("<d")
_SPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


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
    """File-backed :class:`~lit_roidata.exchange.store.Store` under ``root``.

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

    # -- helpers -------------------------------------------------------------------------
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
        fd = self._lockfds.get(directory)
        if fd is None:
            fd = os.open(directory + "/.lock", os.O_RDWR | os.O_CREAT, 0o644)
            self._lockfds[directory] = fd
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def _replace(self, path: str, value: bytes, ttl: float) -> None:
        tmp = self._write_tmp(path, [self._expiry(ttl), value])
        try:
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    # -- small values --------------------------------------------------------------------
    def add(self, key: str, value: bytes, ttl: float = 0) -> bool:
        path = self._path(key)
        with self._lock(path):
            if self._read_small(path) is not None:
                return False
            self._replace(path, value, ttl)
            return True

    def set(self, key: str, value: bytes, ttl: float = 0) -> None:
        self._replace(self._path(key), value, ttl)

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
            self._replace(path, new, ttl)
            return True

    local_fence = True
    volatile = False

    def fence(self, key: str, new: bytes, gen: int) -> tuple[bool, bytes | None]:
        path = self._path(key)
        with self._lock(path):
            cur = self._read_small(path)
            if cur is None:
                return False, None
            parts = cur.split(b" ", 1)
            if len(parts) > 1 and int(parts[1]) > gen:
                return False, cur
            if cur != new:
                self._replace(path, new, 0)
            return True, cur

    def incr(self, key: str, ttl: float = 0) -> int:
        path = self._path(key)
        with self._lock(path):
            raw = self._read_small(path)
            value = (int(raw) if raw is not None else time.time_ns() // 1000) + 1
            self._replace(path, str(value).encode(), ttl)
            return value

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._root + key)
        except FileNotFoundError:
            pass

    def exists(self, key: str) -> bool:
        return os.path.exists(self._root + key)

    # -- payloads ------------------------------------------------------------------------
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
        for fd in fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
