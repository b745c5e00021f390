"""The on-disk roidb cache: content keys, atomic writes, validation, one builder at a time.

* **Key.** ``sha256`` of the input fingerprints (path, size, mtime, BLAKE2b of the
  content) and every option that changes the result. Content hashes are memoised per
  ``(path, size, mtime_ns, ctime_ns, inode)`` in ``<cache>/.fingerprints`` so a warm open
  does not re-read multi-GB files; ``ctime`` cannot be set by users, so a file replaced
  with a preserved mtime is still re-hashed.
* **Atomic and durable.** A cache is built in ``<cache>/.tmp-*``, every file is fsynced,
  and the directory is renamed to ``roidb-<key>`` only when complete; ``manifest.json``
  (written last) records every array's size. (Fsync also means freshly built pages are
  clean in the page cache, so workers mapping them share them instead of showing them
  as private dirty memory.)
* **Validated.** Opening checks the manifest and each file's size; a damaged or truncated
  cache is removed (with a warning) and rebuilt, never used.
* **One builder.** A ``filelock`` per key: the first process builds, the others wait and
  then open the result (DDP ranks, several nodes on a shared filesystem).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Callable, Mapping, Optional

import numpy as np
from filelock import FileLock, Timeout

__all__ = ["CACHE_ENV", "FORMAT_VERSION", "default_cache_dir", "file_fingerprint", "cache_key",
           "write_arrays", "validate_cache", "get_or_build", "CacheError"]

logger = logging.getLogger(__name__)

#: Environment variable for the default cache directory.
CACHE_ENV = "LIT_ROIDATA_CACHE"
#: Bumped whenever the on-disk layout or a build rule changes.
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CacheError(RuntimeError):
    """A cache directory that cannot be used (damaged, truncated, wrong version)."""


def default_cache_dir() -> str:
    """``$LIT_ROIDATA_CACHE`` or ``~/.cache/lit_roidata``."""
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "lit_roidata")


def file_fingerprint(path: str, cache_root: str) -> dict[str, Any]:
    """``{path, size, mtime_ns, blake2b}`` of ``path``, with the hash memoised by stat.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    path = os.path.abspath(path)
    st = os.stat(path)
    stat_key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    memo_dir = os.path.join(cache_root, ".fingerprints")
    memo = os.path.join(memo_dir, hashlib.sha1(path.encode()).hexdigest() + ".json")
    try:
        with open(memo, encoding="utf-8") as fh:
            rec = json.load(fh)
        if rec.get("stat") == stat_key and rec.get("path") == path:
            return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                    "blake2b": rec["blake2b"]}
    except (OSError, ValueError, KeyError):
        pass
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    try:  # best effort: a read-only cache directory just means re-hashing next time
        os.makedirs(memo_dir, exist_ok=True)
        _atomic_write_text(memo, json.dumps({"path": path, "stat": stat_key, "blake2b": digest}))
    except OSError as exc:
        logger.debug("cannot memoise the hash of %s: %s", path, exc)
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "blake2b": digest}


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
    """Save each array as ``<name>.npy``; returns the manifest entries (sizes, shapes)."""
    out = {}
    for name, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        fn = os.path.join(directory, name + ".npy")
        with open(fn, "wb") as fh:
            np.save(fh, arr, allow_pickle=False)
            fh.flush()
            os.fsync(fh.fileno())  # durable before the rename that publishes the cache
        out[name] = {"file": name + ".npy", "bytes": os.path.getsize(fn),
                     "dtype": arr.dtype.str, "shape": list(arr.shape)}
    return out


def validate_cache(path: str) -> dict[str, Any]:
    """The manifest of a complete, undamaged cache directory.

    Raises:
        CacheError: missing/unreadable manifest, wrong format version, a missing array
            file or one whose size differs from the manifest (e.g. truncated).
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
    return manifest


def get_or_build(cache_root: str, key: str, build: Callable[[str], dict[str, Any]], *,
                 rebuild: bool = False, lock_timeout: float = -1) -> tuple[str, dict, bool]:
    """Open the cache ``roidb-<key>`` under ``cache_root``, building it if needed.

    Args:
        build: fills a temporary directory and returns the manifest (without
            ``format``); it runs under the lock, at most once per key at a time.
        rebuild: discard an existing cache and build again.
        lock_timeout: seconds to wait for another builder (-1: forever).

    Returns:
        ``(path, manifest, built)``.
    """
    os.makedirs(cache_root, exist_ok=True)
    final = os.path.join(cache_root, f"roidb-{key}")
    if not rebuild:
        manifest = _try_open(final)
        if manifest is not None:
            return final, manifest, False
    lock = FileLock(final + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        logger.info("waiting for another process to finish building %s", final)
        lock.acquire(timeout=lock_timeout)
    try:
        manifest = None if rebuild else _try_open(final)
        if manifest is not None:
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


def _try_open(path: str) -> Optional[dict]:
    if not os.path.isdir(path):
        return None
    try:
        return validate_cache(path)
    except CacheError as exc:
        logger.warning("roidb cache is unusable and will be rebuilt: %s", exc)
        return None


def _remove(path: str) -> None:
    # Rename first so that a reader never sees a half-deleted directory.
    trash = tempfile.mkdtemp(dir=os.path.dirname(path), prefix=".trash-")
    os.rename(path, os.path.join(trash, "old"))
    shutil.rmtree(trash, ignore_errors=True)
