"""The on-disk roidb cache: content keys, atomic writes, validation, one builder at a time.

* **Key.** ``sha256`` of the input fingerprints (path, size, mtime, xxh3 or BLAKE2b of
  the content, as ``"<algo>:<hex>"``) and every option that changes the result. Content hashes are memoised per
  ``(path, size, mtime_ns, ctime_ns, inode)`` in ``<cache>/.fingerprints`` so a warm open
  does not re-read multi-GB files; ``ctime`` cannot be set by users, so a file replaced
  with a preserved mtime is still re-hashed.
* **Atomic and durable.** A cache is built in ``<cache>/.tmp-*``, every file is fsynced,
  and the directory is renamed to ``roidb-<key>`` only when complete; ``manifest.json``
  (written last) records every array's size. (Fsync also means freshly built pages are
  clean in the page cache, so workers mapping them share them instead of showing them
  as private dirty memory.)
* **Validated.** Opening checks the manifest, each file's size and its ``.npy`` header
  (dtype and shape as recorded); a damaged or truncated cache is removed (with a warning
  naming the file) and rebuilt, never used.
* **Checksummed.** The manifest keeps a 128-bit digest of every array file (xxh3 when
  ``xxhash`` is installed, else BLAKE2b), computed at build. The digests are verified (a full read) on the first open after each boot, which
  is when a power loss shows, on request (``verify=True``, ``lit-roidata cache verify``),
  never on the other opens, which stay cheap. A ``verified`` stamp holds the boot id.
* **One builder.** A ``filelock`` per key: the first process builds, the others wait and
  then open the result (DDP ranks, several nodes on a shared filesystem).
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Optional

import numpy as np
from filelock import FileLock, Timeout

__all__ = ["CACHE_ENV", "FORMAT_VERSION", "default_cache_dir", "file_fingerprint", "cache_key",
           "write_arrays", "ArrayWriter", "npy_data_offset", "start_writeback",
           "validate_cache", "verify_checksums", "get_or_build", "CacheError",
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
    """``{path, size, mtime_ns, digest}`` of ``path``, with the hash memoised by stat.

    The digest is ``"<algo>:<hex>"`` (xxh3_128 when ``xxhash`` is installed, several GB/s,
    else BLAKE2b): a cold build hashes every input file once, proposal files are GBs.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    path = os.path.abspath(path)
    st = os.stat(path)
    stat_key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    algo = _default_algo()
    memo_dir = os.path.join(cache_root, ".fingerprints")
    memo = os.path.join(memo_dir, hashlib.sha1(path.encode()).hexdigest() + ".json")
    try:
        with open(memo, encoding="utf-8") as fh:
            rec = json.load(fh)
        if rec.get("stat") == stat_key and rec.get("path") == path and \
                str(rec["digest"]).startswith(algo + ":"):
            return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                    "digest": rec["digest"]}
    except (OSError, ValueError, KeyError):
        pass
    digest = f"{algo}:{file_digest(path, algo)}"
    try:  # best effort: a read-only cache directory just means re-hashing next time
        os.makedirs(memo_dir, exist_ok=True)
        _atomic_write_text(memo, json.dumps({"path": path, "stat": stat_key, "digest": digest}))
    except OSError as exc:
        logger.debug("cannot memoise the hash of %s: %s", path, exc)
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "digest": digest}


def cache_key(doc: Mapping[str, Any]) -> str:
    """Stable hash of a JSON-serialisable description of inputs and options."""
    text = json.dumps({"format": FORMAT_VERSION, **doc}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _atomic_write_text(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_arrays(directory: str, arrays: Mapping[str, np.ndarray]) -> dict[str, dict]:
    """Save each array as ``<name>.npy``; returns the manifest entries (sizes, shapes).

    See :class:`ArrayWriter`, which this uses.
    """
    writer = ArrayWriter(directory)
    try:
        for name, arr in arrays.items():
            writer.add(name, arr)
    except BaseException:
        writer.close()
        raise
    return writer.finish()


class ArrayWriter:
    """Writes arrays as ``<name>.npy`` files of a cache directory, in the background.

    :meth:`add` computes the file's checksum from the array in memory (the ``.npy``
    header, then the array's bytes; nothing is read back) and queues its bytes, which a
    few threads write in blocks while the caller goes on (the kernel's page-cache work,
    which dominates writing on some machines, then runs beside the build on other
    CPUs). Blocks that are all zeros are not written but left as holes of the file,
    which read back as zeros (e.g. the polygon offsets of a box-only dataset).
    :meth:`finish` waits, fsyncs every file and returns the manifest entries.
    """

    def __init__(self, directory: str, threads: int = 0) -> None:
        self.directory = directory
        self.algo = _default_algo()
        self.records: dict[str, dict] = {}
        self._fds: list = []
        self._pool = ThreadPoolExecutor(threads or _WRITE_THREADS,
                                        thread_name_prefix="lit-roidata-write")
        self._futures: list = []

    def add(self, name: str, arr: np.ndarray) -> None:
        """Queue ``arr`` for ``<name>.npy`` (it must not change until :meth:`finish`)."""
        arr = np.ascontiguousarray(arr)
        fd = os.open(os.path.join(self.directory, name + ".npy"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._fds.append(fd)
        header = _npy_header(arr)
        body = memoryview(arr.reshape(-1)).cast("B")
        h = _hasher(self.algo)
        h.update(header)
        h.update(body)
        size = len(header) + body.nbytes
        os.ftruncate(fd, size)
        blocks = [(fd, 0, header)]
        for off in range(0, body.nbytes, _WRITE_BLOCK):
            blk = body[off:off + _WRITE_BLOCK]
            if np.frombuffer(blk, np.uint8).any():
                blocks.append((fd, len(header) + off, blk))
        self._futures += [self._pool.submit(_pwrite_all, *b) for b in blocks]
        self.records[name] = {"file": name + ".npy", "bytes": size, "dtype": arr.dtype.str,
                              "shape": list(arr.shape),
                              "checksum": f"{self.algo}:{h.hexdigest()}"}

    def finish(self) -> dict[str, dict]:
        """Wait for every write, fsync the files; the manifest entries by name."""
        try:
            for f in self._futures:
                f.result()
            for fd in self._fds:
                os.fsync(fd)  # durable before the rename that publishes the cache
        finally:
            self.close()
        return self.records

    def close(self) -> None:
        """Stop (writes not started are dropped) and close the files."""
        for f in self._futures:
            f.cancel()
        self._pool.shutdown(wait=True)
        for fd in self._fds:
            os.close(fd)
        self._fds, self._futures = [], []


#: bytes per write (and per all-zero check); threads writing them
_WRITE_BLOCK = 8 << 20
_WRITE_THREADS = 4


def _pwrite_all(fd: int, offset: int, data: Any, writeback: bool = True) -> None:
    """Write all of ``data`` at ``offset`` of ``fd``, and (``writeback``) have the kernel
    start writing it to disk (the final fsync then has little left to wait for)."""
    view = memoryview(data).cast("B")
    start, size = offset, view.nbytes
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
    if writeback:
        start_writeback(fd, start, size)


def start_writeback(fd: int, offset: int, size: int) -> None:
    """Ask the kernel to start writing ``[offset, offset + size)`` of ``fd`` to disk now
    (``sync_file_range``; nothing where it is not available). Durability still comes
    from the fsync; this only overlaps the disk's work with the build's."""
    if _SYNC_FILE_RANGE and size:
        try:
            os.sync_file_range(fd, offset, size, os.SYNC_FILE_RANGE_WRITE)
        except OSError:
            pass


_SYNC_FILE_RANGE = hasattr(os, "sync_file_range")


def _npy_header(arr: np.ndarray) -> bytes:
    """The ``.npy`` header ``np.save`` would write before ``arr``'s bytes."""
    buf = io.BytesIO()
    meta = np.lib.format.header_data_from_array_1_0(arr)
    try:
        np.lib.format.write_array_header_1_0(buf, meta)
    except ValueError:  # a header over 64 KiB
        buf = io.BytesIO()
        np.lib.format.write_array_header_2_0(buf, meta)
    return buf.getvalue()


def _hasher(algo: str) -> Any:
    if algo == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algo == "blake2b":
        return hashlib.blake2b(digest_size=16)
    raise CacheError(f"unknown checksum algorithm {algo!r}")


def _default_algo() -> str:
    """``xxh3_128`` (several GB/s) when ``xxhash`` is installed, else BLAKE2b."""
    try:
        import xxhash  # noqa: F401

        return "xxh3_128"
    except ImportError:
        return "blake2b"


def file_digest(path: str, algo: str = "blake2b") -> str:
    """128-bit digest (``xxh3_128`` or ``blake2b``) of a file's bytes, in 4 MiB blocks."""
    h = _hasher(algo)
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(_HASH_BLOCK)
        view = memoryview(buf)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(view[:n])
    return h.hexdigest()


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:  # not Linux: verify once per cache
        return "unknown"


def npy_data_offset(fn: str, rec: dict) -> Optional[int]:
    """Where the array data of ``.npy`` file ``fn`` starts, if its header says exactly
    the manifest entry ``rec``'s dtype and shape (C order, any padding); ``None`` if it
    does not, or differs only in how it is written (then parse it:
    :func:`validate_cache` does). Reads one small block, parses nothing."""
    try:
        with open(fn, "rb", buffering=0) as fh:
            head = fh.read(_HEADER_PEEK)
    except OSError:
        return None
    if head[:6] != b"\x93NUMPY" or len(head) < 12:
        return None
    if head[6] == 1:
        start, n = 10, int.from_bytes(head[8:10], "little")
    elif head[6] in (2, 3):
        start, n = 12, int.from_bytes(head[8:12], "little")
    else:
        return None
    if start + n > len(head):
        return None
    if head[start:start + n].rstrip(b" \n") != _header_text(rec["dtype"], tuple(rec["shape"])):
        return None
    return start + n


_HEADER_PEEK = 4096


@functools.lru_cache(maxsize=256)
def _header_text(dtype: str, shape: tuple) -> bytes:
    """The header dictionary NumPy writes for ``dtype``/``shape`` (no padding)."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {
        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
        "shape": tuple(int(x) for x in shape)})
    return buf.getvalue()[10:].rstrip(b" \n")


def _check_header(path: str, rec: dict) -> None:
    """The ``.npy`` header of ``rec['file']`` is readable and matches the manifest."""
    fn = os.path.join(path, rec["file"])
    if npy_data_offset(fn, rec) is not None:
        return
    try:
        with open(fn, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            if version == (1, 0):
                shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
            elif version == (2, 0):
                shape, _, dtype = np.lib.format.read_array_header_2_0(fh)
            else:
                arr = np.load(fn, mmap_mode="r", allow_pickle=False)
                shape, dtype = arr.shape, arr.dtype
    except (OSError, ValueError) as exc:
        raise CacheError(f"{path}: array file {rec['file']} has a damaged header ({exc})") \
            from None
    if dtype.hasobject or list(shape) != list(rec["shape"]) or dtype.str != rec["dtype"]:
        raise CacheError(f"{path}: array file {rec['file']} holds {dtype.str} {list(shape)}, the "
                         f"manifest says {rec['dtype']} {rec['shape']} (overwritten or damaged)")


def verify_checksums(path: str, manifest: Optional[dict] = None) -> None:
    """Read every array file of the cache at ``path`` and compare its BLAKE2b digest.

    Raises:
        CacheError: naming the first file whose digest differs (or a cache built before
            checksums were kept).
    """
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
        try:
            _atomic_write_text(stamp, _boot_id())
            break
        except OSError:
            continue


def _stamps(path: str) -> list[str]:
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
    return [os.path.join(path, VERIFIED),
            os.path.join(tempfile.gettempdir(), f"lit_roidata-verified-{digest}")]


def _verified_this_boot(path: str) -> bool:
    for stamp in _stamps(path):
        try:
            with open(stamp, encoding="ascii") as fh:
                if fh.read().strip() == _boot_id():
                    return True
        except OSError:
            continue
    return False


def hold_in_use(path: str) -> Any:
    """A shared lock that marks the cache at ``path`` as in use while it is held.

    ``lit-roidata cache clean`` never removes a cache someone holds. The lock goes away
    with the returned object (``close()`` or garbage collection) or the process.
    """
    try:
        import fcntl

        fd = os.open(os.path.join(path, MANIFEST), os.O_RDONLY)
    except (OSError, ImportError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        return None
    return _InUse(fd)


class _InUse:
    """Owns the descriptor holding the in-use lock; closing it (or GC) releases it."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        """Release the lock."""
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1

    def __del__(self) -> None:
        self.close()


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
    try:
        with open(os.path.join(path, LAST_USED), "a"):
            pass
        os.utime(os.path.join(path, LAST_USED))
    except OSError:
        pass


def validate_cache(path: str) -> dict[str, Any]:
    """The manifest of a complete, undamaged cache directory (cheap: no full read).

    Raises:
        CacheError: missing/unreadable manifest, wrong format version, a missing array
            file, one whose size differs from the manifest (e.g. truncated) or whose
            ``.npy`` header is damaged or disagrees with the manifest.
    """
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
                 rebuild: bool = False, lock_timeout: float = -1,
                 verify: Optional[bool] = None) -> tuple[str, dict, bool]:
    """Open the cache ``roidb-<key>`` under ``cache_root``, building it if needed.

    Args:
        build: fills a temporary directory and returns the manifest (without
            ``format``); it runs under the lock, at most once per key at a time.
        rebuild: discard an existing cache and build again.
        lock_timeout: seconds to wait for another builder (-1: forever).
        verify: compare the array checksums when opening an existing cache: ``None``
            (default) on the first open after each boot, ``True`` always, ``False`` never.
            A mismatch rebuilds the cache, with a warning naming the file.

    Returns:
        ``(path, manifest, built)``.
    """
    os.makedirs(cache_root, exist_ok=True)
    final = os.path.join(cache_root, f"roidb-{key}")
    if not rebuild:
        manifest = _try_open(final, verify)
        if manifest is not None:
            touch_last_used(final)
            return final, manifest, False
    lock = FileLock(final + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("waiting for another process to finish building %s", final)
        lock.acquire(timeout=lock_timeout)
    try:
        manifest = None if rebuild else _try_open(final, verify)
        if manifest is not None:
            touch_last_used(final)
            return final, manifest, False
        if os.path.exists(final):
            logger.warning("removing damaged or outdated roidb cache %s", final)
            _remove(final)
        tmp = tempfile.mkdtemp(dir=cache_root, prefix=f".tmp-roidb-{key}-")
        try:
            manifest = dict(build(tmp))
            manifest["format"] = FORMAT_VERSION
            manifest["key"] = key
            _atomic_write_text(os.path.join(tmp, MANIFEST),
                               json.dumps(manifest, indent=1, default=str))
            _atomic_write_text(os.path.join(tmp, VERIFIED), _boot_id())  # digests of this build
            touch_last_used(tmp)
            _fsync_dir(tmp)
            os.rename(tmp, final)
            _fsync_dir(cache_root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return final, validate_cache(final), True
    finally:
        lock.release()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _try_open(path: str, verify: Optional[bool] = None) -> Optional[dict]:
    if not os.path.isdir(path):
        return None
    try:
        manifest = validate_cache(path)
        if verify or (verify is None and not _verified_this_boot(path)):
            verify_checksums(path, manifest)
        return manifest
    except CacheError as exc:
        logger.warning("roidb cache is unusable and will be rebuilt: %s", exc)
        return None


def _remove(path: str) -> None:
    # Rename first so that a reader never sees a half-deleted directory.
    trash = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".trash-")
    os.rename(path, os.path.join(trash, "old"))
    shutil.rmtree(trash, ignore_errors=True)
