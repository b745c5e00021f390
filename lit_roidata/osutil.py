"""Small operating-system helpers every part of the package shares (one of each)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import mmap
import os
import weakref
import tempfile
from collections.abc import Iterator
from typing import IO, Any

__all__ = ["atomic_write", "keep_freed_memory", "malloc_trim", "map_readonly",
           "no_transparent_hugepages", "start_writeback"]


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb", *, fsync: bool = True,
                 encoding: str | None = None) -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing; rename it to ``path`` on success.

    On any exception the temporary file is removed and ``path`` is untouched. With
    ``fsync`` the data reach the disk before the rename (a crash leaves the old file or
    the new one).
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-" + os.path.basename(path) + "-")
    try:
        if hasattr(os, "fchmod"):  # the permissions open() would give (mkstemp: 0600)
            os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, mode, encoding=encoding if "b" not in mode else None) as fh:
            yield fh
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask (read without changing it where Linux allows)."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(
            "/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def no_transparent_hugepages() -> Iterator[bool]:
    """Turn transparent huge pages off for this process while the block runs (Linux
    ``prctl(PR_SET_THP_DISABLE)``, inherited by forked children); yields whether it could.

    A fault on a huge-page-backed array may wait for memory compaction on a loaded
    machine; short-lived build arrays gain nothing from huge pages.
    """
    prctl = _libc("prctl")
    was = -1 if prctl is None else prctl(_PR_GET_THP_DISABLE, 0, 0, 0, 0)
    if was < 0 or prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        prctl = None
    try:
        yield prctl is not None
    finally:
        if prctl is not None:
            prctl(_PR_SET_THP_DISABLE, was, 0, 0, 0)


_PR_SET_THP_DISABLE, _PR_GET_THP_DISABLE = 41, 42


@functools.cache
def _libc(name: str) -> Any:
    """The C library's function ``name``, or ``None`` where there is none."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True),
                       name)
    except (OSError, AttributeError):
        return None


def malloc_trim() -> bool:
    """Return the C heap's free memory to the OS (glibc ``malloc_trim(0)``; glibc keeps
    freed memory); False where there is no glibc (nothing is done)."""
    if (trim := _libc("malloc_trim")) is None:
        return False
    trim(ctypes.c_size_t(0))
    return True


def keep_freed_memory() -> None:
    """Have glibc keep freed memory for reuse instead of handing it back to the OS, for the
    rest of this (short-lived) process: the forked builder frees and allocates the same
    few-MB arrays chunk after chunk, and every hand-back is paid again in page faults."""
    if (fn := _libc("mallopt")) is not None:
        fn(_M_TRIM_THRESHOLD, 1 << 30)
        fn(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's largest


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing the just-written ``nbytes`` at ``offset`` of ``fd`` to
    the disk, so a later ``fsync`` waits less (Linux ``sync_file_range``, which Python's
    ``os`` lacks; elsewhere nothing is done, and errors are ignored: it is only a hint).

    Only the whole 2 MiB spans inside the range are started: the page-cache folio (up to
    2 MiB) at either end may be shared with a write not done yet (writer threads finish in
    any order), and a folio written out before it would be dirtied, and written, twice."""
    lo, hi = -(-offset // _SPAN) * _SPAN, (offset + nbytes) // _SPAN * _SPAN
    if hi > lo and (fn := _libc("sync_file_range")) is not None:
        fn(fd, ctypes.c_int64(lo), ctypes.c_int64(hi - lo), _SYNC_FILE_RANGE_WRITE)


_SYNC_FILE_RANGE_WRITE, _SPAN = 2, 2 << 20


def map_readonly(path: str, dtype: Any, offset: int, shape: tuple[int, ...]) -> Any:
    """A read-only NumPy array over ``shape`` items of ``dtype`` at ``offset`` in ``path``,
    memory-mapped (shared page cache) without holding a file descriptor.

    ``np.memmap`` keeps a descriptor open per array (Python's ``mmap`` duplicates it): a
    roidb of 60 arrays then holds 60, and a process that opens roidbs again and again (a
    notebook, a sweep, a test run) reaches the usual 1,024 limit before the garbage
    collector unmaps them. Here the descriptor is closed once the pages are mapped; the
    mapping ends when the last view of the array is gone. ``np.memmap`` where there is no
    C ``mmap`` (Windows).

    Raises:
        ValueError: the file is shorter than ``offset`` plus the array's bytes.
    """
    import numpy as np

    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if (fn := _libc("mmap")) is None or _libc("munmap") is None:
        return np.asarray(np.memmap(path, dtype, "r", offset, shape))
    fn.restype = ctypes.c_void_p
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    length = max(1, offset - start + nbytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        if (size := os.fstat(fd).st_size) < offset + nbytes:
            raise ValueError(f"{path} is shorter ({size} bytes) than the "
                             f"array it holds ({offset + nbytes} bytes)")
        addr = fn(None, ctypes.c_size_t(length), mmap.PROT_READ, mmap.MAP_SHARED, fd,
                  ctypes.c_int64(start))
    finally:
        os.close(fd)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    pages = (ctypes.c_ubyte * length).from_address(addr)
    weakref.finalize(pages, _libc("munmap"), ctypes.c_void_p(addr), ctypes.c_size_t(length))
    return np.frombuffer(memoryview(pages).toreadonly(), dtype, nbytes // dtype.itemsize,
                         offset - start).reshape(shape)
