"""Reading and converting proposal files without holding them in memory."""

from __future__ import annotations

import contextlib
import errno
import math
import os
import pickle
import tempfile
import time
import weakref
import zipfile
from collections import deque
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Optional, Sequence

import numpy as np

from lit_roidata._pickle_trust import UntrustedPickleError
from lit_roidata.osutil import atomic_write
from lit_roidata.roidb.cache import DiskFullError, disk_full_error, npy_header, pread_exact
from lit_roidata.roidb.cache import read_npy_header
from lit_roidata.roidb.info import RoIDBInputError
from lit_roidata.roidb.segms import offsets
from lit_roidata.roidb.workers import OrderedWorkers, WorkerDied, WorkerFailed, build_workers

__all__ = ["ProposalSource", "read_proposal_file", "convert_proposals"]

_RECONSTRUCT = {("numpy.core.multiarray", "_reconstruct"),
                ("numpy._core.multiarray", "_reconstruct")}
_FROMBUFFER = {("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer")}
_SCORE_KEYS = ("scores", "objectness_logits")


@dataclass
class ProposalSource:
    """A proposal file's records: ``boxes_of(i)`` is the box array of record ``i``."""

    path: str
    ids: np.ndarray                      # int64 (m,)
    counts: np.ndarray                   # int64 (m,)
    boxes_of: Callable[[int], np.ndarray]
    flat: Optional[Any] = None           # (N, 4) rows, sliceable
    flat_off: Optional[np.ndarray] = None
    scores_flat: Optional[Any] = None    # (N,) scores in the same order, when contiguous
    scores_of: Optional[Callable[[int], np.ndarray]] = None
    keep_alive: Any = None               # scratch file / pickle data the accessors read


class FileRows:
    """Rows ``(N, *row_shape)`` of ``dtype`` stored at ``offset`` in an open file."""

    def __init__(self, fh: BinaryIO, offset: int, dtype: np.dtype, n: int,
                 row_shape: tuple = (4,)) -> None:
        self.fh, self.offset, self.dtype = fh, int(offset), np.dtype(dtype)
        self.shape = (int(n), *row_shape)
        self.row_bytes = self.dtype.itemsize * math.prod(row_shape)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, sl: slice) -> np.ndarray:
        if not isinstance(sl, slice) or sl.step not in (None, 1):
            raise TypeError("FileRows supports contiguous slices only")
        a, b, _ = sl.indices(self.shape[0])
        out = np.empty((max(a, b) - a, *self.shape[1:]), self.dtype)
        if out.nbytes:
            pread_exact(self.fh.fileno(), memoryview(out.reshape(-1).view(np.uint8)),
                        self.offset + a * self.row_bytes,
                        f"from {getattr(self.fh, 'name', 'scratch file')}")
        return out


class _Stored:
    """An array the unpickler wrote to the scratch file (only its place is kept)."""

    __slots__ = ("sink", "off", "dtype", "shape", "array")

    def __init__(self, sink: "_Sink", off: int = -1, dtype: Any = None, shape: tuple = ()
                 ) -> None:
        self.sink, self.off, self.dtype, self.shape, self.array = sink, off, dtype, shape, None

    def __setstate__(self, state: tuple) -> None:
        """``ndarray.__setstate__``'s arguments: write the raw bytes out, keep the place."""
        if len(state) not in (4, 5):  # (version,) shape, dtype, fortran, raw
            raise pickle.UnpicklingError(f"unexpected ndarray state of length {len(state)}")
        shape, dtype, fortran, raw = state[-4:]
        dtype = np.dtype(dtype)
        if isinstance(raw, str):  # a Python 2 str read with encoding="latin1"
            raw = raw.encode("latin1")
        if dtype.hasobject or not isinstance(raw, (bytes, bytearray)):
            arr = np.ndarray.__new__(np.ndarray, (0,), np.uint8)
            arr.__setstate__(state)  # object arrays etc.: let NumPy do it, keep it
            self.array, self.dtype, self.shape = arr, arr.dtype, arr.shape
            return
        shape = tuple(int(s) for s in shape)
        if len(raw) != dtype.itemsize * math.prod(shape):
            raise pickle.UnpicklingError(f"array data of {len(raw)} bytes for shape {shape} "
                                         f"and dtype {dtype}")
        if not dtype.isnative and not (dtype.fields or dtype.subdtype or dtype.metadata):
            # ndarray.__setstate__ byte-swaps to the native order (pickle protocols <= 4)
            arr = np.frombuffer(raw, dtype).reshape(shape, order="F" if fortran else "C")
            dtype = dtype.newbyteorder("=")
            raw = np.ascontiguousarray(arr, dtype=dtype)
        elif fortran and len(shape) > 1:
            raw = np.frombuffer(raw, dtype).reshape(shape, order="F").copy(order="C")
        self.sink.put(self, raw, dtype, shape)

    def load(self) -> np.ndarray:
        """The array (read back from the staging area)."""
        if self.array is not None:
            return self.array
        n = math.prod(self.shape)
        if self.off == _DROPPED:
            if n == 0:
                return np.zeros(self.shape, self.dtype)
            raise _NeedDropped()
        return self.sink.rows(self.off, self.dtype, n, ())[0:n].reshape(self.shape)


_DROPPED = -2  # offset of an array whose bytes were not kept (scores of a build)


class _NeedDropped(Exception):
    """A dropped array's bytes were needed after all (the file is read again, keeping all)."""


#: Environment variable: bytes of memory a proposal pickle may be staged in before the
#: rest goes to an anonymous scratch file (default: a quarter of the available memory).
STAGING_ENV = "LIT_ROIDATA_PROPOSAL_STAGING_BYTES"


def staging_budget() -> int:
    """Bytes of memory a proposal pickle's arrays may be staged in (then a scratch file)."""
    env = os.environ.get(STAGING_ENV)
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            raise ValueError(f"{STAGING_ENV}={env!r}: give a number of bytes, e.g. "
                             f"4000000000") from None
    with contextlib.suppress(OSError, ValueError, IndexError, StopIteration), \
            open("/proc/meminfo", encoding="ascii") as fh:
        return next(int(line.split()[1]) * 1024 // 4 for line in fh
                    if line.startswith("MemAvailable:"))
    return 1 << 30


class _Sink:
    """Where the arrays' bytes go, in unpickling order: a ``bytearray`` up to
    :func:`staging_budget` bytes, then (all of it) an anonymous scratch file."""

    _BATCH_BYTES = 8 << 20
    _BATCH_BUFFERS = 512

    def __init__(self, drop: Optional[Callable[[np.dtype, tuple], bool]] = None,
                 scratch: Optional[BinaryIO] = None) -> None:  # the scratch file from the start
        self.budget, self.drop = staging_budget(), drop
        self.mem: Optional[bytearray] = None if scratch else bytearray()
        self.fh: Optional[BinaryIO] = scratch
        self.pos = 0  # the logical end (staged + pending)
        self._pending: list = []
        self._pending_bytes = 0

    def reconstruct(self, *_args: Any) -> _Stored:
        """Stands in for ``numpy.core.multiarray._reconstruct`` (subtype, shape, code)."""
        return _Stored(self)

    def frombuffer(self, buf: Any, dtype: Any, shape: tuple, order: str) -> _Stored:
        """Stands in for ``numpy.core.numeric._frombuffer`` (pickle protocol 5)."""
        dtype = np.dtype(dtype)  # (never an object dtype: np.frombuffer refuses those)
        arr = np.frombuffer(buf, dtype=dtype).reshape(shape, order=order)
        self.put(st := _Stored(self), arr, dtype, tuple(int(s) for s in shape))
        return st

    def put(self, st: _Stored, raw: Any, dtype: np.dtype, shape: tuple) -> None:
        if self.drop is not None and self.drop(dtype, shape):
            st.off, st.dtype, st.shape = _DROPPED, dtype, shape
            return
        self._append(b"\0" * ((-self.pos) % max(1, dtype.alignment)))  # (empty: no-op)
        if not isinstance(raw, (bytes, bytearray)):
            raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        st.off, st.dtype, st.shape = self.pos, dtype, shape
        self._append(raw)

    def _append(self, raw: Any) -> None:
        n = len(raw) if isinstance(raw, (bytes, bytearray)) else raw.nbytes
        if not n:
            return
        if self.mem is not None:
            if self.pos + n <= self.budget:
                self.mem += memoryview(raw).cast("B")  # amortised growth (remapped, not copied)
                self.pos += n
                return
            self._spill()
        self._pending.append(raw)
        self._pending_bytes += n
        self.pos += n
        if self._pending_bytes >= self._BATCH_BYTES or len(self._pending) >= self._BATCH_BUFFERS:
            self._flush()

    def _spill(self) -> None:
        """Move what is staged in memory to a new scratch file; later arrays go there."""
        self.fh = tempfile.TemporaryFile(prefix="lit-roidata-proposals-")
        # nothing is pending while staging in memory: the staged bytes go first
        self._pending, self._pending_bytes, self.mem = [self.mem], len(self.mem), None
        self._flush()

    def _flush(self) -> None:
        bufs = [memoryview(b).cast("B") for b in self._pending]
        while bufs:
            try:
                n = os.writev(self.fh.fileno(), bufs)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                raise disk_full_error(tempfile.gettempdir(), self.pos, exc, scratch=True) from None
            while bufs and n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            if bufs and n:
                bufs[0] = bufs[0][n:]
        self._pending, self._pending_bytes = [], 0

    def rows(self, off: int, dtype: np.dtype, n: int, row_shape: tuple) -> Any:
        if self.mem is not None:  # read-only rows of the memory staging area (no copy)
            a = np.frombuffer(self.mem, dtype, n * math.prod(row_shape), off).reshape(n, *row_shape)
            a.flags.writeable = False
            return a
        return FileRows(self.fh, off, dtype, n, row_shape)

    def close(self) -> None:
        """Free the staging memory and close the scratch file."""
        self.mem = None
        if self.fh is not None:
            self.fh.close()


class _ProposalUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that routes NumPy arrays to a :class:`_Sink`."""

    def __init__(self, fh: BinaryIO, sink: _Sink) -> None:
        super().__init__(fh, encoding="latin1")
        self._sink = sink

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _RECONSTRUCT:
            return self._sink.reconstruct
        if (module, name) in _FROMBUFFER:
            return self._sink.frombuffer
        return super().find_class(module, name)


def untrusted_proposal_pickle(path: str) -> UntrustedPickleError:
    """The error for a proposal pickle read without ``trust_pickle=True``."""
    stem = os.path.splitext(os.path.basename(path))[0]
    return UntrustedPickleError(
        path, "proposal file",
        f"Convert it once with `lit-roidata convert-proposals {path} {stem}.npz` and give the "
        f".npz instead, or, if you trust the file, pass trust_pickle=True (the data module's "
        f"sources.trust_pickle; on the command line: --data.sources.trust_pickle true).")


def is_pickle(path: str) -> bool:
    """Whether a proposal file is read by unpickling (anything but the ``.npz``)."""
    if path.endswith(".npz"):
        return False
    with open(path, "rb") as fh:
        return fh.read(4) != b"PK\x03\x04"


def _unpickler(fh: BinaryIO, sink: _Sink, *, trust_pickle: bool) -> pickle.Unpickler:
    """The one place a proposal pickle's unpickler is created (its trust policy)."""
    if not trust_pickle:
        raise untrusted_proposal_pickle(getattr(fh, "name", "<stream>"))
    return _ProposalUnpickler(fh, sink)


def read_proposal_file(path: str, *, trust_pickle: bool = False,
                       scores: bool = True) -> ProposalSource:
    """Open a Detectron pickle or a columnar ``.npz`` proposal file (validated): else
    FileNotFoundError, UntrustedPickleError (a pickle without ``trust_pickle``) or
    RoIDBInputError (a bad file or record: names the file, record, image id and fix)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"proposal file not found: {path}")
    if os.path.getsize(path) == 0:
        raise RoIDBInputError(f"{path}: the proposal file is empty (0 bytes); it was probably "
                              f"not written completely. Regenerate or copy it again.")
    return _read_pickle(path, trust_pickle, scores) if is_pickle(path) else _read_npz(path)


def _drop_scores(dtype: np.dtype, shape: tuple) -> bool:
    """The arrays a build does not keep: 1-D floats (per-image scores)."""
    return len(shape) == 1 and dtype.kind == "f"


def _read_pickle(path: str, trust_pickle: bool, scores: bool = True,
                 scratch: Optional[BinaryIO] = None) -> ProposalSource:
    data, sink = _load_pickle(path, trust_pickle, None if scores else _drop_scores, scratch)
    try:
        return source_from_object(path, data, keep_alive=sink, scores=scores)
    except _NeedDropped:  # e.g. float ids in a 1-D array: read again, keeping everything
        sink.close()
        del data
        return _read_pickle(path, trust_pickle, True)


def _load_pickle(path: str, trust_pickle: bool,
                 drop: Optional[Callable[[np.dtype, tuple], bool]] = None,
                 scratch: Optional[BinaryIO] = None) -> tuple[Any, _Sink]:
    """Unpickle a proposal file, its arrays streamed into the staging area (the sink; with
    ``scratch``, that file from the start)."""
    if not trust_pickle:
        raise untrusted_proposal_pickle(path)
    sink = _Sink(drop, scratch)
    try:
        with open(path, "rb") as fh:
            data = _unpickler(fh, sink, trust_pickle=trust_pickle).load()
    except RoIDBInputError:
        raise
    except Exception as exc:  # pickle raises many types for a damaged file
        sink.close()
        if isinstance(exc, DiskFullError):
            raise
        hint = ("the file is truncated (copy or write it again)"
                if isinstance(exc, EOFError) or "truncated" in str(exc)
                else "is it a Detectron proposal pickle?")
        raise RoIDBInputError(f"{path}: cannot unpickle the proposal file "
                              f"({type(exc).__name__}: {exc}); {hint}") from None
    sink._flush()  # (nothing is pending while staging in memory)
    return data, sink


class PickleReadAhead:
    """The proposal pickles of ``paths`` unpickled (scores dropped) in one forked process,
    in order, while the caller goes on (decoding the annotations); :meth:`source` takes
    each one's result. Their arrays go to a shared scratch file (memory up to
    :func:`staging_budget`). Without build workers, each is read when asked for."""

    def __init__(self, paths: Sequence[Optional[str]], trust_pickle: bool) -> None:
        self.trust, self.todo, self.proc = trust_pickle, deque(), None
        picks = [p for p in paths if p and os.path.isfile(p) and is_pickle(p)]
        if not (trust_pickle and picks and build_workers()):
            return
        for p in picks:  # created before the fork: the reader writes into the same files
            fd = (os.memfd_create("lit-roidata-proposals") if hasattr(os, "memfd_create")
                  and os.path.getsize(p) <= staging_budget() else None)
            self.todo.append((p, open(fd, "w+b") if fd is not None else
                              tempfile.TemporaryFile(prefix="lit-roidata-proposals-")))
        files = list(self.todo)
        self.proc = OrderedWorkers(lambda k, _: _read_ahead(*files[k], trust_pickle), 1)
        for k in range(len(files)):
            self.proc.submit(k)

    def source(self, path: str) -> ProposalSource:
        """``read_proposal_file(path, scores=False)``, from the read-ahead when it has it."""
        if self.todo and self.todo[0][0] == path:
            fh, got = self.todo.popleft()[1], None
            try:
                got = self.proc.result()
            except WorkerFailed as exc:
                if not isinstance(exc, WorkerDied):
                    fh.close()
                    raise exc.__cause__ from None
            finally:
                if not self.todo:  # its last file: the reader ends now, not with the build
                    self.proc.close()
            if got is not None:  # (else an unusual layout: read here)
                ids, counts, off, dtype, n = got
                flat, fo = FileRows(fh, off, np.dtype(dtype), n), offsets(counts)
                src = ProposalSource(path, ids, counts, lambda i: flat[fo[i]:fo[i + 1]], flat,
                                     fo, keep_alive=fh)
                weakref.finalize(src, fh.close)
                return src
            fh.close()
        return read_proposal_file(path, trust_pickle=self.trust, scores=False)

    def close(self) -> None:
        """End the reader; close the files not taken."""
        if self.proc is not None:
            self.proc.close()
        while self.todo:
            self.todo.popleft()[1].close()


def _read_ahead(path: str, fh: BinaryIO, trust_pickle: bool) -> Optional[tuple]:
    """In the reader: unpickle ``path`` into ``fh``; the source's place there (``None``
    unless its boxes lie back to back there, as in Detectron's pickles)."""
    src = _read_pickle(path, trust_pickle, False, fh)
    if not (isinstance(f := src.flat, FileRows) and f.fh is fh):
        return None
    return src.ids, src.counts, f.offset, f.dtype.str, len(f)


def _as_records(path: str, key: str, value: Any) -> list:
    """A top-level field as a list of per-image items."""
    if isinstance(value, _Stored):
        if value.array is not None:
            return list(value.array)
        if len(value.shape) == 0:
            raise RoIDBInputError(f"{path}: {key!r} is a scalar; expected one entry per image")
        if key == "ids" or len(value.shape) == 1:
            return list(value.load())
        # a (n, P, 4) array: one record per row, read back on demand
        step = math.prod(value.shape[1:]) * value.dtype.itemsize
        return [_Stored(value.sink, value.off + i * step, value.dtype, tuple(value.shape[1:]))
                for i in range(value.shape[0])]
    if isinstance(value, (np.ndarray, list, tuple)):
        return list(value)
    raise RoIDBInputError(f"{path}: {key!r} is a {type(value).__name__}; expected a list with "
                          f"one entry per image")


def _ids_array(path: str, key: str, ids: list) -> np.ndarray:
    """Integer image ids, or an error naming the first record that is not one."""
    try:
        arr = np.asarray(ids)
    except Exception:  # ragged / odd objects: checked one by one below
        arr = np.asarray(ids, dtype=object)
    if arr.ndim == 1 and arr.dtype.kind in "iu" and not (
            arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max):
        return arr.astype(np.int64)
    if arr.ndim == 1 and arr.dtype.kind == "f" and (
            np.isfinite(arr) & (arr == np.round(arr)) & (np.abs(arr) < 2.0**63)).all():
        return arr.astype(np.int64)
    for i, v in enumerate(ids):
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, bool) or not _is_integral(v):
            what = f"{v!r} ({type(v).__name__})"
            what = what[:77] + "..." if len(what) > 80 else what
            hint = (" It looks like a file name: map file names to image ids with the "
                    "annotation json (images[].file_name -> images[].id), e.g. "
                    "`lit-roidata convert-proposals in.pkl out.npz --annotations "
                    "instances.json`." if isinstance(v, (str, bytes)) else "")
            raise RoIDBInputError(
                f"{path}: {key!r} record {i} is {what}; ids must be the integer image ids of the "
                f"dataset (the 'id' of each entry of 'images' in the annotation json).{hint}")
    return np.array([int(v) for v in ids], dtype=np.int64)


def _is_integral(v: Any) -> bool:
    if isinstance(v, (int, np.integer)):
        return -2**63 <= int(v) < 2**63
    if isinstance(v, (float, np.floating)):
        return math.isfinite(v) and float(v).is_integer() and abs(v) < 2.0**63
    return False


def _type_name(v: Any) -> str:
    return "ndarray" if isinstance(v, _Stored) else type(v).__name__


def _shape_dtype(item: Any) -> tuple[tuple, Optional[np.dtype]]:
    if isinstance(item, _Stored) and item.array is None:
        return tuple(item.shape), item.dtype
    try:
        a = item.array if isinstance(item, _Stored) else np.asarray(item)
    except Exception:
        return (-1,), None
    return a.shape, a.dtype


def _load(item: Any) -> np.ndarray:
    return item.load() if isinstance(item, _Stored) else np.asarray(item)


def source_from_object(path: str, data: Any, keep_alive: Any = None,
                       scores: bool = True) -> ProposalSource:
    """Validate an unpickled proposal dict (streamed or plain) and index its records
    (``scores=False``: no score accessors; the scores' shapes are still checked)."""
    if not isinstance(data, dict):
        raise RoIDBInputError(f"{path}: expected a dict with keys 'boxes', 'scores' and 'ids' "
                              f"(or 'indexes'), got {_type_name(data)}. Save the proposals "
                              f"as dict(boxes=[...], scores=[...], ids=[...]).")
    id_key = "indexes" if "indexes" in data else "ids"
    score_key = next((k for k in _SCORE_KEYS if k in data), None)
    missing = [k for k, ok in (("boxes", "boxes" in data), ("ids", id_key in data),
                                ("scores", score_key is not None)) if not ok]
    if missing:
        raise RoIDBInputError(f"{path}: missing key(s) {missing} (found {sorted(map(str, data))}"
                              f"); a Detectron proposal file is a dict with 'boxes', 'scores' "
                              f"and 'ids', one entry per image")
    scores_wanted = scores
    boxes = _as_records(path, "boxes", data["boxes"])
    scores = _as_records(path, score_key, data[score_key])
    id_list = [x.load() if isinstance(x, _Stored) else x  # e.g. 0-d arrays
               for x in _as_records(path, id_key, data[id_key])]
    if len(boxes) != len(id_list) or len(scores) != len(id_list):
        raise RoIDBInputError(f"{path}: 'boxes' ({len(boxes)}), {score_key!r} ({len(scores)}) "
                              f"and {id_key!r} ({len(id_list)}) must have one record per image")
    ids = _ids_array(path, id_key, id_list)
    counts = np.zeros(ids.size, np.int64)
    for i, b in enumerate(boxes):
        shape, dt = _shape_dtype(b)
        size = math.prod(shape) if dt is not None else -1
        if dt is None or dt.kind not in "iuf" or not (len(shape) == 2 and shape[1] == 4
                                                      or size == 0):
            kind = (f"{_type_name(b)} that is no numeric array" if dt is None else
                    f"dtype {dt}" if dt.kind not in "iuf" else f"shape {shape}")
            raise RoIDBInputError(f"{path}: record {i} (image id {int(ids[i])}) has boxes of "
                                  f"{kind}; expected a (P, 4) array of numbers [x1, y1, x2, y2] "
                                  f"(an empty (0, 4) array for no proposals). Regenerate the "
                                  f"file or fix that record.")
        counts[i] = size // 4
    for i, s in enumerate(scores):
        shape, dt = _shape_dtype(s)
        n = math.prod(shape) if dt is not None else -1
        if n != counts[i] or (n and (dt is None or dt.kind not in "iuf")):
            raise RoIDBInputError(f"{path}: record {i} (image id {int(ids[i])}) has "
                                  f"{int(counts[i])} boxes but {score_key!r} of shape {shape}"
                                  f"{'' if dt is None else f' ({dt})'}; each image needs one "
                                  f"score per box. Regenerate the file or fix that record.")
    flat = _contiguous(boxes, counts, 4)
    src = ProposalSource(path, ids, counts, lambda i: _load(boxes[i]).reshape(-1, 4), flat,
                         None if flat is None else offsets(counts),
                         _contiguous(scores, counts, None) if scores_wanted else None,
                         (lambda i: _load(scores[i]).reshape(-1)) if scores_wanted else None,
                         keep_alive=(keep_alive, boxes, scores))
    if keep_alive is not None and hasattr(keep_alive, "close"):
        weakref.finalize(src, keep_alive.close)  # the scratch file goes with the source
    return src


def _contiguous(items: list, counts: np.ndarray, width: Optional[int]) -> Any:
    """The records as one block of rows (:class:`FileRows` or a read-only array) when they
    lie back to back in the staging area in one dtype (as in Detectron's pickles)."""
    if not all(isinstance(it, _Stored) and it.array is None for it in items):
        return None
    nonempty = [(it, int(c)) for it, c in zip(items, counts) if c]
    if not nonempty:
        return None
    first, expect = nonempty[0][0], nonempty[0][0].off
    for it, c in nonempty:
        if it.dtype != first.dtype or it.off != expect:
            return None
        expect += c * (width or 1) * first.dtype.itemsize
    return first.sink.rows(first.off, first.dtype, int(counts.sum()), (width,) if width else ())


def _npz_member(zf: zipfile.ZipFile, fh: BinaryIO, name: str) -> tuple:
    """``(data offset, dtype, shape, fortran, stored)`` of ``name.npy`` in an open npz."""
    info = zf.getinfo(name + ".npy")
    fh.seek(info.header_offset)
    local = fh.read(30)
    if local[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile(f"bad local header for {name}.npy")
    # the data follow the 30-byte local header, the file name and the extra field
    start = info.header_offset + 30 + sum(int.from_bytes(local[i:i + 2], "little")
                                          for i in (26, 28))
    stored = info.compress_type == zipfile.ZIP_STORED
    with zf.open(info) as member:
        shape, fortran, dtype = read_npy_header(member)
        return start + (member.tell() if stored else 0), dtype, shape, fortran, stored


def _read_npz(path: str) -> ProposalSource:
    def bad(what: str) -> RoIDBInputError:
        return RoIDBInputError(f"{path}: {what}; a columnar proposal file holds 'ids' (n,), "
                               f"'counts' (n,), 'boxes' (sum(counts), 4) and optionally 'scores' "
                               f"(sum(counts),) (write one with lit-roidata convert-proposals)")

    fh = open(path, "rb")
    try:
        try:
            zf = zipfile.ZipFile(fh)
            names = {n[:-4] for n in zf.namelist() if n.endswith(".npy")}
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise RoIDBInputError(f"{path}: not a readable .npz file ({exc}); it may be "
                                  f"truncated. Write it again (lit-roidata convert-proposals)."
                                  ) from None
        missing = {"ids", "counts", "boxes"} - names
        if missing:
            raise bad(f".npz proposal file lacks {sorted(missing)}")
        try:
            with np.load(path, allow_pickle=False) as z:
                ids_raw, counts_raw = np.asarray(z["ids"]), np.asarray(z["counts"])
            meta = {n: _npz_member(zf, fh, n) for n in ("boxes", "scores") if n in names}
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            raise RoIDBInputError(f"{path}: cannot read the .npz ({type(exc).__name__}: {exc}); "
                                  f"it may be truncated or hold object arrays. Write it again "
                                  f"(lit-roidata convert-proposals).") from None
        ids = (np.asarray(ids_raw, np.int64).ravel() if ids_raw.dtype.kind in "iu"
               else _ids_array(path, "ids", list(ids_raw.ravel())))
        if counts_raw.dtype.kind not in "iu":
            raise bad(f"'counts' has dtype {counts_raw.dtype}, expected integers")
        counts = np.asarray(counts_raw, np.int64).ravel()
        total = int(counts.sum()) if counts.size else 0
        _, b_dtype, b_shape, _, _ = meta["boxes"]
        if len(b_shape) != 2 or b_shape[1] != 4 or counts.size != ids.size \
                or total != b_shape[0] or (counts < 0).any():
            raise bad(f"inconsistent shapes: ids {tuple(ids.shape)}, counts "
                      f"{tuple(counts.shape)} (sum {total}), boxes {tuple(b_shape)}")
        if b_dtype.kind not in "iuf":
            raise bad(f"'boxes' has dtype {b_dtype}, expected numbers")
        if "scores" in meta and math.prod(meta["scores"][2]) != total:
            raise bad(f"'scores' has shape {tuple(meta['scores'][2])} but there are {total} boxes")
        off = offsets(counts)

        def rows(name: str, row_shape: tuple) -> Any:
            start, dtype, _, fortran, stored = meta[name]
            if stored and not fortran:  # stored, C order: read in place
                return FileRows(fh, start, dtype, total, row_shape)
            with np.load(path, allow_pickle=False) as z:  # compressed: into memory
                return np.ascontiguousarray(z[name]).reshape(-1, *row_shape)

        flat = rows("boxes", (4,))
        scores_flat = rows("scores", ()) if "scores" in meta else None
    except BaseException:
        fh.close()
        raise
    scores_of = None if scores_flat is None else (lambda i: scores_flat[off[i]:off[i + 1]])
    src = ProposalSource(path, ids, counts, lambda i: flat[off[i]:off[i + 1]], flat, off,
                         scores_flat, scores_of, keep_alive=fh)
    weakref.finalize(src, fh.close)
    return src


_CHUNK_ROWS = 1 << 20


def _write_member(zf: zipfile.ZipFile, name: str, dtype: np.dtype, shape: tuple,
                  chunks: Any) -> None:
    """Stream ``chunks`` (arrays in row order) into ``name.npy`` of an open npz."""
    with zf.open(name + ".npy", "w", force_zip64=True) as f:
        f.write(npy_header(dtype, shape))
        for c in chunks:
            c = np.ascontiguousarray(c, dtype=dtype)
            if c.size:
                f.write(c.reshape(-1).view(np.uint8))


def _chunks_of(flat: Any, of: Callable[[int], np.ndarray], counts: np.ndarray) -> Any:
    if flat is None:
        return map(of, range(counts.size))
    total = int(counts.sum())
    return (flat[a:min(total, a + _CHUNK_ROWS)] for a in range(0, total, _CHUNK_ROWS))


def _column_dtype(flat: Any, of: Any, counts: np.ndarray) -> np.dtype:
    """The dtype of a column of the records (their common type; float32 for none)."""
    if flat is not None:
        return np.dtype(flat.dtype)
    dts = {np.asarray(of(i)).dtype for i in range(counts.size) if counts[i]}
    return np.result_type(*dts) if dts else np.dtype(np.float32)


def convert_proposals(in_path: str, out_path: str, *,
                      annotations: Optional[str] = None, trust_pickle: bool = False) -> dict:
    """Convert a proposal pickle (or an ``.npz``) into the columnar ``.npz`` ``out_path``,
    streamed; ``annotations`` (a COCO json) maps ids that are file names to image ids.

    Returns ``{"images", "boxes", "dtype", "seconds_read", "seconds_write"}``; raises as
    :func:`read_proposal_file` (and for unknown file names).
    """
    t0 = time.perf_counter()
    src = (read_proposal_file(in_path, trust_pickle=trust_pickle) if annotations is None
           else _read_with_name_map(in_path, annotations, trust_pickle))
    t1 = time.perf_counter()
    counts = src.counts
    total = int(counts.sum())
    dtype = _column_dtype(src.flat, src.boxes_of, counts)
    if dtype.kind in "iu":
        dtype = np.dtype(np.float32)
    with atomic_write(out_path, fsync=False) as out_fh:
        with zipfile.ZipFile(out_fh, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
            _write_member(zf, "ids", np.int64, src.ids.shape, [src.ids])
            _write_member(zf, "counts", np.int64, counts.shape, [counts])
            _write_member(zf, "boxes", dtype, (total, 4),
                          _chunks_of(src.flat, src.boxes_of, counts))
            if src.scores_flat is not None or src.scores_of is not None:
                _write_member(zf, "scores", _column_dtype(src.scores_flat, src.scores_of, counts),
                              (total,), _chunks_of(src.scores_flat, src.scores_of, counts))
    return {"images": int(counts.size), "boxes": total, "dtype": dtype.str,
            "seconds_read": round(t1 - t0, 3), "seconds_write": round(time.perf_counter() - t1, 3)}


def _read_with_name_map(path: str, annotations: str, trust_pickle: bool) -> ProposalSource:
    """Read a pickle whose ids may be file names, mapping them through a COCO json."""
    import orjson

    with open(annotations, "rb") as fh:
        images = orjson.loads(fh.read()).get("images") or []

    def names(fn: str) -> tuple:  # a file name, its base name and its stem
        return fn, os.path.basename(fn), os.path.splitext(os.path.basename(fn))[0]

    by_name: dict = {}
    for im in images:
        for k in names(str(im.get("file_name", ""))):
            by_name.setdefault(k, im.get("id"))
    data, sink = _load_pickle(path, trust_pickle)
    key = "indexes" if isinstance(data, dict) and "indexes" in data else "ids"
    if isinstance(data, dict) and key in data:
        mapped = []
        for i, v in enumerate(_as_records(path, key, data[key])):
            if isinstance(v, bytes):
                v = v.decode("utf-8", "replace")
            if isinstance(v, str):
                k = next((c for c in names(v) if c in by_name), None)
                if k is None:
                    raise RoIDBInputError(f"{path}: record {i} has id {v!r}, which is no "
                                          f"file_name of {annotations}; check that the "
                                          f"proposals belong to that dataset")
                v = by_name[k]
            mapped.append(v)
        data = {**data, key: mapped}
    return source_from_object(path, data, keep_alive=sink)
