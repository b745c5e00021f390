"""Images and annotation files in object storage (``s3://``, ``gs://``, ``az://``,
``http(s)://``) through fsspec: one GET per object, retries with backoff, credentials from
each backend's own environment/config, and the exact read-ahead of a worker's next blocks
(docs/custom_datasets.md, "Data on S3")."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

from lit_roidata._optional import require
from lit_roidata.osutil import atomic_write

__all__ = ["StorageError", "ReadAhead", "is_url", "redact", "read_bytes", "object_fingerprint",
           "fetch_to_cache", "list_names", "prefetch_block"]

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]+://")
#: Per-protocol defaults under the user's fsspec config (``fsspec.config.conf``, which wins).
#: S3: no HEAD before a GET (``max_concurrency=1``), a connection pool for the reads in
#: flight, and the retries done here (one policy for every backend).
DEFAULTS: dict[str, dict[str, Any]] = {"s3": {
    "max_concurrency": 1, "config_kwargs": {
        "max_pool_connections": 64, "connect_timeout": 10, "read_timeout": 30,
        "retries": {"max_attempts": 1}}}}
#: Errors retried: OSError (connections, timeouts) and the network clients' own.
_TRANSIENT = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests", "google", "azure",
              "fsspec", "gcsfs", "adlfs", "s3fs", "asyncio")
#: Seconds a failing read is retried (backoff 0.1 s doubling to 4 s); then StorageError.
RETRY_SECONDS = float(os.environ.get("LIT_ROIDATA_READ_RETRY_S", "30"))
_FS: dict[tuple[int, str], Any] = {}


class StorageError(OSError):
    """A read that failed after its retries (or for good: 403); the message names the
    URL, with credentials left out."""


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL (``s3://...``) rather than a local path."""
    return isinstance(path, str) and bool(_URL.match(path)) and not path.startswith("file://")


def redact(text: Any) -> str:
    """``text`` with URL user info and query strings (signatures) replaced by ``***``."""
    text = re.sub(r"(://)[^/@\s'\"]*@", r"\1***@", str(text))
    return re.sub(r"(://[^\s'\"?]*)\?[^\s'\"]*", r"\1?***", text)


def filesystem(url: str) -> Any:
    """This process's fsspec filesystem for ``url``'s protocol (one per process: shared by
    the reader threads, created again after a fork)."""
    protocol = url.split("://", 1)[0]
    key = (os.getpid(), protocol)
    if key not in _FS:
        backend, extra = {"s3": ("s3fs", "s3"), "gs": ("gcsfs", "gcs")}.get(protocol, ("", ""))
        fsspec = require("fsspec", extra or "s3", f"reading {protocol}:// URLs")
        if backend:
            require(backend, extra, f"reading {protocol}:// URLs")
        opts = dict(DEFAULTS.get(protocol, {}), **fsspec.config.conf.get(protocol, {}))
        fs = fsspec.filesystem(protocol, skip_instance_cache=True, **opts)
        if hasattr(fs, "retries"):
            fs.retries = 1  # s3fs: the retries are ours
        _FS[key] = fs
    return _FS[key]


def _retrying(url: str, fn: Any) -> Any:
    """``fn()`` retried with backoff on transient errors for :data:`RETRY_SECONDS`.

    Raises:
        FileNotFoundError: the object does not exist (404).
        StorageError: access denied (403), or still failing after the retries.
    """
    t0, wait, tries = time.monotonic(), 0.1, 0
    while True:
        tries += 1
        try:
            return fn()
        except FileNotFoundError:  # (never chained: the backend's may quote a signed URL)
            raise FileNotFoundError(f"no object at {redact(url)}") from None
        except PermissionError as exc:
            raise StorageError(f"access denied to {redact(url)} ({redact(exc)}); check the "
                               f"backend's credentials (environment or config)") from None
        except Exception as exc:  # noqa: BLE001 - transient until the time is up
            if not (isinstance(exc, OSError) or type(exc).__module__.split(".")[0]
                    in _TRANSIENT) or time.monotonic() - t0 + wait > RETRY_SECONDS:
                raise StorageError(f"cannot read {redact(url)} after {tries} tries in "
                                   f"{time.monotonic() - t0:.1f} s: {type(exc).__name__}: "
                                   f"{redact(exc)}") from None
            time.sleep(wait)
            wait = min(wait * 2, 4.0)


def read_bytes(path: str) -> bytes:
    """The bytes of a local file or an object (one GET, retried; through this process's
    :class:`ReadAhead` when it holds them).

    Raises:
        OSError: FileNotFoundError (also a missing object) or :class:`StorageError`.
    """
    if not is_url(path):
        with open(path, "rb") as fh:
            return fh.read()
    ahead = _AHEAD.get(os.getpid())
    return _get(path) if ahead is None else ahead.get(path)


def _get(url: str) -> bytes:
    fs = filesystem(url)
    return _retrying(url, lambda: fs.cat_file(url))


def object_fingerprint(url: str) -> dict[str, Any]:
    """``{url, etag, size, mtime}`` of an object (one HEAD): a changed object gives a
    changed fingerprint (the ETag, else size and modification time)."""
    info = _retrying(url, lambda: filesystem(url).info(url))
    low = {str(k).lower(): v for k, v in info.items()}
    mtime = low.get("lastmodified") or low.get("mtime") or low.get("last_modified")
    return {"url": redact(url), "etag": str(low.get("etag") or "").strip('"') or None,
            "size": low.get("size"), "mtime": None if mtime is None else str(mtime)}


def fetch_to_cache(url: str, cache_root: str, fingerprint: dict[str, Any]) -> str:
    """Download ``url`` once per ``fingerprint`` into ``<cache_root>/.remote``; the local
    path (an unchanged object is not downloaded again)."""
    tag = hashlib.sha1(repr((url, sorted(fingerprint.items()))).encode()).hexdigest()[:16]
    local = os.path.join(cache_root, ".remote", f"{tag}-{os.path.basename(url.split('?')[0])}")
    if not os.path.isfile(local):
        os.makedirs(os.path.dirname(local), exist_ok=True)
        fs = filesystem(url)

        def copy() -> None:
            with fs.open(url, "rb") as src, atomic_write(local) as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        _retrying(url, copy)
    return local


def list_names(url: str) -> set[str]:
    """Every object below the folder ``url``, as paths relative to it."""
    fs, base = filesystem(url), url.split("://", 1)[1].rstrip("/") + "/"
    found = (p.split("://", 1)[-1] for p in _retrying(url, lambda: fs.find(url)))
    return {p[len(base):] for p in found if p.startswith(base)}


class ReadAhead:
    """The read-ahead of one worker process: the bytes of the images of its next blocks,
    fetched by ``threads`` reader threads (the bound on requests in flight) while it
    decodes the current block. It holds at most the images named by its last two
    :meth:`prefetch` calls (the bound on memory)."""

    def __init__(self, threads: int = 16) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="lit_roidata-read")
        self.pending: dict[str, tuple[Any, int]] = {}  # url -> (future, window number)
        self.window = 0

    def prefetch(self, paths: Iterable[str]) -> None:
        """Start reading the objects among ``paths`` (in order) not already held, and drop
        those no longer named (neither now nor by the previous call)."""
        self.window += 1
        for p in dict.fromkeys(p for p in paths if is_url(p)):
            fut = self.pending[p][0] if p in self.pending else self.pool.submit(_get, p)
            self.pending[p] = (fut, self.window)
        for p in [p for p, (_, w) in self.pending.items() if w < self.window - 1]:
            self.pending.pop(p)[0].cancel()

    def get(self, path: str) -> bytes:
        """The bytes of ``path``: the read-ahead's (then dropped), else read now."""
        held = self.pending.pop(path, None)
        return _get(path) if held is None else held[0].result()


_AHEAD: dict[int, ReadAhead] = {}


def prefetch_block(block: Any, roidb: Any) -> None:
    """Start reading the images of the blocks named in ``block.ahead`` (the roidb indices
    the loader attaches with ``loader.read_ahead``) in this process's :class:`ReadAhead`."""
    ahead = getattr(block, "ahead", None)
    if ahead and is_url(roidb[int(ahead[0])]["image"]):  # (local files: nothing to do)
        reader = _AHEAD.get(os.getpid()) or _AHEAD.setdefault(os.getpid(), ReadAhead())
        reader.prefetch([roidb[int(i)]["image"] for i in ahead])
