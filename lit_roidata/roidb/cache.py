"""The on-disk roidb cache: content keys, atomic writes, validation, one builder at a time."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import math
import io
import json
import logging
import os
import weakref
import shutil
import tempfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, BinaryIO, Callable, Mapping, Optional, Sequence

import numpy as np
from filelock import FileLock, Timeout

from lit_roidata.osutil import atomic_write, start_writeback

__all__ = ["CACHE_ENV", "FORMAT_VERSION", "default_cache_dir", "file_fingerprint", "cache_key",
           "write_arrays", "ArrayWriter", "npy_data_offset", "npy_header", "read_npy_header",
           "pwrite_all", "pread_exact", "hasher", "default_algo", "file_digest", "validate_cache",
           "verify_checksums", "get_or_build", "remove_cache", "CacheError", "DiskFullError",
           "hold_in_use", "in_use", "LAST_USED"]

logger = logging.getLogger(__name__)

#: Environment variable for the default cache directory.
CACHE_ENV = "LIT_ROIDATA_CACHE"
#: Bumped whenever the on-disk layout or a build rule changes.
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
VERIFIED = "verified"
LAST_USED = "last_used"
_HASH_BLOCK = 1 << 22


class CacheError(RuntimeError):
    """A cache directory that cannot be used (damaged, truncated, wrong version)."""


def default_cache_dir() -> str:
    """``$LIT_ROIDATA_CACHE`` or ``~/.cache/lit_roidata``."""
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "lit_roidata")


def file_fingerprint(path: str, cache_root: str) -> dict[str, Any]:
    """``{path, size, mtime_ns, digest}`` of ``path``, with the hash memoised by stat."""
    path = os.path.abspath(path)
    st = os.stat(path)
    stat_key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    algo = default_algo()
    memo_dir = os.path.join(cache_root, ".fingerprints")
    memo = os.path.join(memo_dir, hashlib.sha1(path.encode()).hexdigest() + ".json")
    digest = None
    with contextlib.suppress(OSError, ValueError, KeyError), open(memo, encoding="utf-8") as fh:
        rec = json.load(fh)
        if rec.get("stat") == stat_key and rec.get("path") == path \
                and str(rec["digest"]).startswith(algo + ":"):
            digest = rec["digest"]
    if digest is None:
        digest = f"{algo}:{file_digest(path, algo)}"
        try:  # best effort: a read-only cache directory just means re-hashing next time
            os.makedirs(memo_dir, exist_ok=True)
            with atomic_write(memo, "w", encoding="utf-8") as fh:
                json.dump({"path": path, "stat": stat_key, "digest": digest}, fh)
        except OSError as exc:
            logger.debug("cannot memoise the hash of %s: %s", path, exc)
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "digest": digest}


def cache_key(doc: Mapping[str, Any]) -> str:
    """Stable hash of a JSON-serialisable description of inputs and options."""
    text = json.dumps({"format": FORMAT_VERSION, **doc}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def write_arrays(directory: str, arrays: Mapping[str, np.ndarray]) -> dict[str, dict]:
    """Save each array as ``<name>.npy`` (:class:`ArrayWriter`); the manifest entries."""
    writer = ArrayWriter(directory)
    try:
        for name, arr in arrays.items():
            writer.add(name, arr)
        return writer.finish()
    finally:
        writer.close()  # (a no-op after finish)


class DiskFullError(OSError, CacheError):
    """A cache build or proposal column write ran out of disk space (``ENOSPC``/``EDQUOT``);
    the message names the folder, the bytes needed and the bytes free."""


def disk_full_error(folder: str, needed: int, exc: OSError, *,
                    scratch: bool = False) -> DiskFullError:
    """The :class:`DiskFullError` for ``exc`` while writing about ``needed`` bytes in
    ``folder`` (``scratch``: a temporary folder, not the cache)."""
    free = -1  # unknown
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(folder).free
    fix = ("set TMPDIR to a folder on a larger disk" if scratch else "point the cache "
           "elsewhere (sources.cache_dir of the data module, cache_dir= of the roidb "
           "functions, or $LIT_ROIDATA_CACHE)")
    err = DiskFullError(exc.errno, (
        f"{'quota exceeded' if exc.errno == errno.EDQUOT else 'no space left'} on the disk "
        f"of the {'scratch' if scratch else 'roidb cache'} folder {folder}: the build needs "
        f"at least {needed} bytes ({needed / 2**20:.1f} MiB) and {free} bytes "
        f"({free / 2**20:.1f} MiB) are free there. Free space on that disk, or {fix}."))
    err.folder, err.needed, err.free = folder, needed, free
    return err


def _disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and not isinstance(exc, DiskFullError) and \
        exc.errno in (errno.ENOSPC, errno.EDQUOT)


class ArrayWriter:
    """Writes ``.npy`` files of a folder in the background: the one writer of the cache's
    arrays and of the proposal columns."""

    def __init__(self, directory: Optional[str], threads: int = 0, *, durable: bool = True,
                 max_pending: int = 0) -> None:
        self.directory = directory if directory is not None else tempfile.gettempdir()
        self.durable, self.max_pending = durable, max_pending
        self.threads, self.algo = threads or _WRITE_THREADS, default_algo()
        self.records: dict[str, dict] = {}
        self.needed = 0  # bytes handed over so far (the disk-full error's estimate)
        self._fds, self._futures = [], deque()  # files add opened; writes queued
        self._pool: Optional[ThreadPoolExecutor] = None

    def add(self, name: str, arr: np.ndarray) -> None:
        """Queue ``arr`` for ``<name>.npy`` (it must not change until :meth:`finish`)."""
        arr = np.ascontiguousarray(arr)
        fd = os.open(os.path.join(self.directory, name + ".npy"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fds.append(fd)
        header = npy_header(arr.dtype, arr.shape)
        body = memoryview(arr.reshape(-1)).cast("B")
        h = hasher(self.algo)
        h.update(header)
        h.update(body)
        size = len(header) + body.nbytes
        self._guard(os.ftruncate, fd, size)
        self.write(fd, 0, header)
        for off in range(0, body.nbytes, _WRITE_BLOCK):
            blk = body[off:off + _WRITE_BLOCK]
            if np.frombuffer(blk, np.uint8).any():
                self.write(fd, len(header) + off, blk)
        self._record(name, size, arr.dtype, list(arr.shape), h)

    def write(self, fd: int, offset: int, data: Any) -> None:
        """Queue ``data`` for ``offset`` of ``fd`` (waits while ``max_pending`` are queued)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="lit-roidata-write")
        self.needed += memoryview(data).nbytes
        self._futures.append(self._pool.submit(pwrite_all, fd, offset, data, self.durable))
        while self.max_pending and len(self._futures) > self.max_pending:
            self._guard(self._futures.popleft().result)

    def seal(self, name: str, fd: int, dtype: np.dtype, shape: tuple, pad_to: int) -> None:
        """Write the header of the column in ``fd`` (``pad_to`` bytes reserved) and
        checksum the file by reading it back (after the queued writes)."""
        self.wait()
        header = npy_header(dtype, shape, pad_to=pad_to)
        self._guard(pwrite_all, fd, 0, header, False)
        size = len(header) + np.dtype(dtype).itemsize * math.prod(shape)
        h = _hash_fd(fd, self.algo, size, f"{name}.npy")
        self._record(name, size, np.dtype(dtype), list(shape), h)

    def _record(self, name: str, size: int, dtype: np.dtype, shape: list, h: Any) -> None:
        self.records[name] = {"file": name + ".npy", "bytes": size, "dtype": dtype.str,
                              "shape": shape, "checksum": f"{self.algo}:{h.hexdigest()}"}

    def _guard(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)``, a full disk raised as :class:`DiskFullError`."""
        try:
            return fn(*args)
        except OSError as exc:
            if _disk_full(exc):
                raise disk_full_error(self.directory, self.needed, exc,
                                      scratch=not self.durable) from None
            raise

    def wait(self) -> None:
        """Wait for the queued writes and stop the threads (e.g. before forking)."""
        while self._futures:
            self._guard(self._futures.popleft().result)
        self._stop_threads()

    def _stop_threads(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def finish(self, fds: Sequence[int] = ()) -> dict[str, dict]:
        """Wait for every write, fsync the files (also ``fds``); the manifest entries."""
        try:
            self.wait()
            if self.durable:
                for fd in (*self._fds, *fds):
                    self._guard(os.fsync, fd)  # durable before the rename that publishes
        finally:
            self.close()
        return self.records

    def close(self) -> None:
        """Stop (writes not started are dropped) and close the files :meth:`add` opened."""
        for f in self._futures:
            f.cancel()
        self._futures.clear()
        self._stop_threads()
        for fd in self._fds:
            os.close(fd)
        self._fds = []


#: bytes per write (and per all-zero check); threads writing them
_WRITE_BLOCK = 8 << 20
_WRITE_THREADS = 4


def pwrite_all(fd: int, offset: int, data: Any, writeback: bool = True) -> None:
    """Write all of ``data`` at ``offset`` of ``fd``; ``writeback`` has the kernel start
    writing it to disk (``sync_file_range``: the final fsync waits less)."""
    view = memoryview(data).cast("B")
    start, size = offset, view.nbytes
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
    if writeback and size:
        start_writeback(fd, start, size)


def pread_exact(fd: int, view: memoryview, offset: int, what: str) -> None:
    """Fill ``view`` with the bytes at ``offset`` of ``fd``; ``OSError("short read
    <what>")`` if the file ends first."""
    got = 0
    while got < view.nbytes:
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise OSError(f"short read {what}")
        got += n


def npy_header(dtype: Any, shape: tuple, pad_to: int = 0) -> bytes:
    """The ``.npy`` header ``np.save`` writes for a C-order ``dtype``/``shape`` array
    (version 1.0, else 2.0), padded with spaces to ``pad_to`` bytes (1.0 only)."""
    buf = io.BytesIO()
    meta = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
            "shape": tuple(int(s) for s in shape)}
    try:
        np.lib.format.write_array_header_1_0(buf, meta)
    except ValueError:  # a header over 64 KiB
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, meta)
    head = buf.getvalue()
    if pad_to > len(head) and head[6] == 1:
        body = head[10:-1] + b" " * (pad_to - len(head)) + b"\n"
        head = head[:8] + len(body).to_bytes(2, "little") + body
    return head


def read_npy_header(fh: BinaryIO) -> tuple[tuple, bool, np.dtype]:
    """``(shape, fortran_order, dtype)`` of the ``.npy`` header at ``fh``'s position
    (NumPy's public readers; a 3.0 header is read as 2.0, the same layout)."""
    version = np.lib.format.read_magic(fh)
    if version == (1, 0):
        return np.lib.format.read_array_header_1_0(fh)
    if version in ((2, 0), (3, 0)):
        return np.lib.format.read_array_header_2_0(fh)
    raise ValueError(f"unsupported .npy format version {version}")


def hasher(algo: str) -> Any:
    """A new 128-bit hasher for ``algo`` (``xxh3_128`` or ``blake2b``)."""
    if algo == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algo == "blake2b":
        return hashlib.blake2b(digest_size=16)
    raise CacheError(f"unknown checksum algorithm {algo!r}")


def default_algo() -> str:
    """``xxh3_128`` (several GB/s) when ``xxhash`` is installed, else BLAKE2b."""
    try:
        import xxhash  # noqa: F401

        return "xxh3_128"
    except ImportError:
        return "blake2b"


def file_digest(path: str, algo: str = "blake2b") -> str:
    """128-bit digest (``xxh3_128`` or ``blake2b``) of a file's bytes, in 4 MiB blocks."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return _hash_fd(fd, algo, os.fstat(fd).st_size, path).hexdigest()
    finally:
        os.close(fd)


def _hash_fd(fd: int, algo: str, size: int, name: str) -> Any:
    """The hasher of ``algo`` over the first ``size`` bytes of ``fd``."""
    h = hasher(algo)
    view = memoryview(bytearray(_HASH_BLOCK))
    for pos in range(0, size, _HASH_BLOCK):
        block = view[:min(_HASH_BLOCK, size - pos)]
        pread_exact(fd, block, pos, f"while checksumming {name} (at byte {pos} of {size})")
        h.update(block)
    return h


def _boot_id() -> str:
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id",
                                             encoding="ascii") as fh:
        return fh.read().strip()
    return "unknown"  # not Linux: verify once per cache


def npy_data_offset(fn: str, rec: dict) -> Optional[int]:
    """Where the array data of ``.npy`` file ``fn`` start, if its header is exactly what
    NumPy writes for the manifest entry ``rec`` (any padding); else ``None`` (then parse
    it). Reads one small block, parses nothing."""
    try:
        with open(fn, "rb", buffering=0) as fh:
            head = fh.read(_HEADER_PEEK)
    except OSError:
        return None
    start = {1: 10, 2: 12, 3: 12}.get(head[6]) if len(head) >= 12 else None  # by version
    if head[:6] != b"\x93NUMPY" or start is None:
        return None
    end = start + int.from_bytes(head[8:start], "little")
    return end if end <= len(head) and head[start:end].rstrip(b" \n") == _header_text(
        rec["dtype"], tuple(rec["shape"])) else None


_HEADER_PEEK = 4096


@functools.lru_cache(maxsize=256)
def _header_text(dtype: str, shape: tuple) -> bytes:
    """The header dictionary NumPy writes for ``dtype``/``shape`` (no padding)."""
    return npy_header(dtype, shape)[10:].rstrip(b" \n")


def _check_header(path: str, rec: dict) -> None:
    """The ``.npy`` header of ``rec['file']`` is readable and matches the manifest."""
    fn = os.path.join(path, rec["file"])
    if npy_data_offset(fn, rec) is not None:
        return
    try:
        with open(fn, "rb") as fh:
            shape, _, dtype = read_npy_header(fh)
    except (OSError, ValueError) as exc:
        raise CacheError(f"{path}: array file {rec['file']} has a damaged header ({exc})") \
            from None
    if dtype.hasobject or list(shape) != list(rec["shape"]) or dtype.str != rec["dtype"]:
        raise CacheError(f"{path}: array file {rec['file']} holds {dtype.str} {list(shape)}, the "
                         f"manifest says {rec['dtype']} {rec['shape']} (overwritten or damaged)")


def verify_checksums(path: str, manifest: Optional[dict] = None) -> None:
    """Read every array file of the cache at ``path`` and compare its digest; else
    :class:`CacheError` naming the first file that differs."""
    manifest = manifest if manifest is not None else validate_cache(path)
    for name, rec in manifest.get("arrays", {}).items():
        want = rec.get("checksum")
        if not want or ":" not in want:
            raise CacheError(f"{path}: the manifest has no checksum for {rec['file']} (a cache "
                             f"from an older version); rebuild it")
        algo, digest = want.split(":", 1)
        try:
            got = file_digest(os.path.join(path, rec["file"]), algo)
        except ImportError:
            raise CacheError(f"{path}: checksums are {algo} but xxhash is not installed here; "
                             f"install it (pip install xxhash) or rebuild the cache") from None
        if got != digest:
            raise CacheError(f"{path}: array file {rec['file']} is damaged (its {algo} checksum "
                             f"differs from the manifest's; e.g. zero-filled by a power loss)")
    for stamp in _stamps(path):  # in the cache, or (read-only cache) in the temp dir
        with contextlib.suppress(OSError), atomic_write(stamp, "w", encoding="ascii") as fh:
            fh.write(_boot_id())
            break  # (a failed write goes on with the next place)


def _stamps(path: str) -> list[str]:
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
    return [os.path.join(path, VERIFIED),
            os.path.join(tempfile.gettempdir(), f"lit_roidata-verified-{digest}")]


def _verified_this_boot(path: str) -> bool:
    for stamp in _stamps(path):
        with contextlib.suppress(OSError), open(stamp, encoding="ascii") as fh:
            if fh.read().strip() == _boot_id():
                return True
    return False


def hold_in_use(path: str, owner: Any) -> bool:
    """Mark the cache at ``path`` in use (``lit-roidata cache clean`` skips it) with a shared
    lock held while ``owner`` lives; whether the lock is held."""
    try:
        import fcntl

        fd = os.open(os.path.join(path, MANIFEST), os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, ImportError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        return False
    weakref.finalize(owner, os.close, fd)
    return True


def in_use(path: str) -> bool:
    """Whether a process holds the cache at ``path`` (:func:`hold_in_use`)."""
    try:
        import fcntl

        with open(os.path.join(path, MANIFEST), "rb") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
            return False
    except (OSError, ImportError):
        return False


def touch_last_used(path: str) -> None:
    """Record that the cache at ``path`` was opened now (best effort)."""
    with contextlib.suppress(OSError):
        open(os.path.join(path, LAST_USED), "a").close()
        os.utime(os.path.join(path, LAST_USED))


def validate_cache(path: str) -> dict[str, Any]:
    """The manifest of a complete, undamaged cache directory (cheap: no full read); else
    :class:`CacheError` (manifest, format version, array file sizes and headers)."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CacheError(f"{path}: no readable {MANIFEST} ({exc})") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CacheError(f"{path}: cache format {manifest.get('format')} != {FORMAT_VERSION}")
    for name, rec in manifest.get("arrays", {}).items():
        fn = os.path.join(path, rec["file"])
        try:
            size = os.path.getsize(fn)
        except OSError:
            raise CacheError(f"{path}: array file {rec['file']} is missing") from None
        if size != rec["bytes"]:
            raise CacheError(f"{path}: array file {rec['file']} has {size} bytes, the manifest "
                             f"says {rec['bytes']} (truncated or overwritten)")
        _check_header(path, rec)
    return manifest


def get_or_build(cache_root: str, key: str, build: Callable[[str], dict[str, Any]], *,
                 rebuild: bool = False, verify: Optional[bool] = None) -> tuple[str, dict, bool]:
    """``(path, manifest, built)`` of the cache ``roidb-<key>`` under ``cache_root``; if it
    is missing or unusable (or ``rebuild``), ``build(tmp)`` fills a temporary folder and
    returns the manifest, under a lock (once per key at a time). ``verify`` as for
    :func:`~lit_roidata.roidb.build.combined_roidb_for_training`."""
    os.makedirs(cache_root, exist_ok=True)
    final = os.path.join(cache_root, f"roidb-{key}")
    if not rebuild and (manifest := _try_open(final, verify)) is not None:
        return final, manifest, False
    lock = FileLock(final + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("waiting for another process to finish building %s", final)
        lock.acquire()
    try:
        if not rebuild and (manifest := _try_open(final, verify)) is not None:
            return final, manifest, False
        if os.path.exists(final):
            logger.warning("removing damaged or outdated roidb cache %s", final)
            remove_cache(final)
        tmp = tempfile.mkdtemp(dir=cache_root, prefix=f".tmp-roidb-{key}-")
        try:
            manifest = dict(build(tmp), format=FORMAT_VERSION, key=key)
            with atomic_write(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as fh:
                json.dump(manifest, fh, indent=1, default=str)
            with atomic_write(os.path.join(tmp, VERIFIED), "w", encoding="ascii") as fh:
                fh.write(_boot_id())  # the digests are this build's
            touch_last_used(tmp)
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(cache_root)
        except BaseException as exc:
            needed = _logical_size(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, DiskFullError) and getattr(exc, "folder", tmp) != tmp:
                raise  # another disk (a scratch folder) filled up
            if isinstance(exc, DiskFullError) or _disk_full(exc):  # named, after the cleanup
                raise disk_full_error(cache_root, max(needed, getattr(exc, "needed", 0)),
                                      exc) from None  # type: ignore[arg-type]
            raise
        return final, validate_cache(final), True
    finally:
        lock.release()


def _logical_size(folder: str) -> int:
    """Bytes of the files in ``folder`` (holes included: what a build had sized)."""
    with contextlib.suppress(OSError):
        return sum(e.stat().st_size for e in os.scandir(folder) if e.is_file())
    return 0


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _try_open(path: str, verify: Optional[bool] = None) -> Optional[dict]:
    """The manifest of the usable cache at ``path`` (its use recorded), else ``None``."""
    if not os.path.isdir(path):
        return None
    try:
        manifest = validate_cache(path)
        if verify or (verify is None and not _verified_this_boot(path)):
            verify_checksums(path, manifest)
        touch_last_used(path)
        return manifest
    except CacheError as exc:
        logger.warning("roidb cache is unusable and will be rebuilt: %s", exc)
        return None


def remove_cache(path: str) -> None:
    """Remove the cache folder ``path`` (renamed away first: no reader sees half of it)."""
    trash = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".trash-")
    os.rename(path, os.path.join(trash, "old"))
    shutil.rmtree(trash, ignore_errors=True)
