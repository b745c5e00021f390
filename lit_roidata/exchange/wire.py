"""The exchange's wire format: named arrays plus JSON metadata, no pickle.

A 24-byte prefix (magic ``LRXW``, version, flags, lengths, CRC-32), a JSON header
(envelope, meta, tensor table) and the 64-byte aligned tensor data, optionally followed by
an HMAC-SHA256 tag (``FLAG_HMAC``); see docs/exchange.md ("Wire format").
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from lit_roidata.exchange.errors import MessageAuthError, WireFormatError

__all__ = ["Encoded", "FLAG_HMAC", "Message", "SUPPORTED_DTYPES", "decode", "encode",
           "read_envelope"]

MAGIC = b"LRXW"
VERSION = 1
FLAG_HMAC = 0x0001
KNOWN_FLAGS = FLAG_HMAC
TAG_SIZE = 32  # HMAC-SHA256
_PREFIX = struct.Struct("<4sHHIIQ")
_ALIGN = 64

# Canonical name -> NumPy dtype (little-endian) for types NumPy represents natively.
_NUMPY_TYPES: dict[str, np.dtype] = {name: np.dtype(name).newbyteorder("<") for name in (
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128")}
# Torch-only types (the torch dtype's name) -> the same-width integer carrier.
_TORCH_ONLY: dict[str, str] = {"bfloat16": "int16", **dict.fromkeys(
    ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"), "uint8")}
_CARRIERS = {**_NUMPY_TYPES, **{k: _NUMPY_TYPES[v] for k, v in _TORCH_ONLY.items()}}
SUPPORTED_DTYPES: tuple[str, ...] = tuple(_CARRIERS)


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class Encoded:
    """An encoded message as a list of buffers (written without joining where possible)."""

    buffers: list[Any]
    nbytes: int

    def tobytes(self) -> bytes:
        """The message as one contiguous ``bytes`` object (one copy)."""
        return b"".join(self.buffers)


@dataclass
class Message:
    """A decoded message: tensors by name, user metadata and the channel envelope."""

    tensors: dict[str, Any]
    meta: dict[str, Any]
    envelope: dict[str, Any] = field(default_factory=dict)


def _to_numpy(name: str, value: Any) -> tuple[str, np.ndarray]:
    """Return ``(canonical dtype name, C-contiguous little-endian array)`` for one entry."""
    if type(value).__module__.startswith("torch"):
        import torch

        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise WireFormatError(f"tensor {name!r} has layout {value.layout}; only dense "
                                      "(strided) tensors can be exchanged: call .to_dense()")
            t = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
            tname = str(t.dtype).removeprefix("torch.")
            if tname in _TORCH_ONLY:
                return tname, t.view(getattr(torch, _TORCH_ONLY[tname])).numpy()
            value = t.numpy()
    arr = np.asarray(value)
    dname = arr.dtype.name
    if dname not in _NUMPY_TYPES:
        raise WireFormatError(
            f"tensor {name!r} has dtype {arr.dtype!r}, which the exchange cannot carry; "
            f"supported: {', '.join(SUPPORTED_DTYPES)} (convert strings/objects to numbers)")
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not np.little_endian):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    # Not np.ascontiguousarray: it turns 0-d arrays into shape (1,).
    return dname, arr if arr.flags.c_contiguous else arr.copy(order="C")


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):  # torch tensors, numpy scalars orjson did not take
        return obj.tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON-serialisable")


def _check_finite(obj: Any, path: str) -> None:
    """JSON has no inf/nan (orjson would silently write ``null``): refuse them."""
    if isinstance(obj, float) and not np.isfinite(obj):
        raise WireFormatError(f"meta field {path!r} is {obj}; JSON cannot carry inf/nan "
                              "(send it as a tensor instead)")
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _check_finite(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_finite(v, f"{path}[{i}]")
    elif isinstance(obj, (np.ndarray, np.floating)) and obj.dtype.kind in "fc":
        if not np.isfinite(obj).all():
            raise WireFormatError(f"meta field {path!r} holds inf/nan; JSON cannot carry "
                                  "them (send it as a tensor instead)")


def encode(tensors: Mapping[str, Any], meta: Mapping[str, Any] | None = None,
           envelope: Mapping[str, Any] | None = None, *, key: bytes | None = None
           ) -> Encoded:
    """Encode named arrays/tensors (any device, dtype of :data:`SUPPORTED_DTYPES`, shape)
    and JSON metadata, without copying the array data; ``key``: HMAC key (``FLAG_HMAC``).
    WireFormatError on an unsupported dtype, a non-str name or non-JSON metadata."""
    if not isinstance(tensors, Mapping):
        raise WireFormatError(f"tensors must be a dict of name -> array, got {type(tensors)}")
    entries, data, offset = [], [], 0
    for name, value in tensors.items():
        if not isinstance(name, str) or not name:
            raise WireFormatError(f"tensor names must be non-empty strings, got {name!r}")
        dname, arr = _to_numpy(name, value)
        entries.append({"name": name, "dtype": dname,
                        "byteorder": "|" if arr.dtype.itemsize == 1 else "<",
                        "shape": list(arr.shape), "offset": offset, "nbytes": arr.nbytes})
        if arr.nbytes:
            data.append(memoryview(arr.reshape(-1).view(np.uint8)))
        if arr.nbytes % _ALIGN:
            data.append(bytes(-arr.nbytes % _ALIGN))
        offset = _align(offset + arr.nbytes)
    meta = dict(meta or {})
    _check_finite(meta, "")
    try:
        header = orjson.dumps({"envelope": dict(envelope or {}), "meta": meta,
                               "tensors": entries}, default=_json_default,
                              option=orjson.OPT_SERIALIZE_NUMPY)
    except (TypeError, orjson.JSONEncodeError) as exc:
        raise WireFormatError(f"meta must be JSON-serialisable (numbers, strings, lists, "
                              f"dicts with str keys, NumPy arrays): {exc}") from exc
    body: list[Any] = [header, bytes(-(_PREFIX.size + len(header)) % _ALIGN), *data]
    crc = 0
    for buf in body if key is None else ():  # with an HMAC the tag covers corruption too
        crc = zlib.crc32(buf, crc)
    prefix = _PREFIX.pack(MAGIC, VERSION, 0 if key is None else FLAG_HMAC, len(header), crc,
                          offset)
    buffers = [prefix, *body]
    if key is not None:
        mac = hmac.new(key, prefix, hashlib.sha256)
        for buf in body:
            mac.update(buf)
        buffers.append(mac.digest())
    return Encoded(buffers, sum(memoryview(b).nbytes for b in buffers))


def _fail(where: str, msg: str) -> WireFormatError:
    return WireFormatError(f"corrupt exchange message{where}: {msg}")


def decode(buf: bytes | bytearray | memoryview, *, as_torch: bool = False,
           where: str = "", key: bytes | None = None) -> Message:
    """Decode and validate a message produced by :func:`encode`; arrays share ``buf``'s
    memory. With ``key`` only messages with a valid HMAC tag are read (else
    MessageAuthError); a corrupt one raises WireFormatError."""
    view, data_start, data_len, header = _parse(buf, where, key)
    data = view[data_start:data_start + data_len]
    tensors = {e["name"]: _decode_one(e, data, data_len, as_torch, where)
               for e in header["tensors"]}
    return Message(tensors, header["meta"], header["envelope"])


def read_envelope(buf: bytes | bytearray | memoryview, *, key: bytes | None = None,
                  where: str = "") -> dict[str, Any]:
    """The envelope of a message (checked like :func:`decode`, tensors not decoded)."""
    return _parse(buf, where, key)[3]["envelope"]


def _parse(buf: bytes | bytearray | memoryview, where: str, key: bytes | None
           ) -> tuple[memoryview, int, int, dict[str, Any]]:
    """Check prefix, length, HMAC (or CRC-32) and header: ``(view, data start, length,
    header)``."""
    view = memoryview(buf).cast("B")
    if len(view) < _PREFIX.size:
        raise _fail(where, f"{len(view)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, version, flags, header_len, crc, data_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise _fail(where, f"bad magic {bytes(magic)!r} (not a lit_roidata exchange message)")
    if version != VERSION:
        raise _fail(where, f"wire version {version}, this build reads version {VERSION}; "
                           "upgrade lit_roidata on both ends")
    if flags & ~KNOWN_FLAGS:  # the prefix is outside the CRC: an unknown flag is corrupt
        raise _fail(where, f"unknown flags {flags:#06x} (version {VERSION} defines only "
                           f"{KNOWN_FLAGS:#06x}, HMAC)")
    data_start = _align(_PREFIX.size + header_len)
    end = data_start + data_len
    tag = TAG_SIZE if flags & FLAG_HMAC else 0
    if len(view) != end + tag:
        raise _fail(where, f"length {len(view)} != expected {end + tag} "
                           "(truncated or padded payload)")
    if key is not None:  # the verified HMAC covers every byte: no CRC needed
        if not tag:
            raise MessageAuthError(f"unauthenticated exchange message{where}: this end "
                                   "requires an HMAC (a secret is set) and the message has "
                                   "none (forged, or the producer has no secret)")
        if not hmac.compare_digest(hmac.new(key, view[:end], hashlib.sha256).digest(), view[end:]):
            raise MessageAuthError(f"forged or altered exchange message{where}: its HMAC "
                                   "does not match this run's secret")
    elif tag:
        raise MessageAuthError(f"authenticated exchange message{where}, but this end has no "
                               "secret to check it: set the same secret on both ends "
                               "(LIT_ROIDATA_EXCHANGE_SECRET or secret=...)")
    elif zlib.crc32(view[_PREFIX.size:end]) != crc:
        raise _fail(where, "CRC-32 mismatch (torn, mixed or corrupted payload)")
    try:
        header = orjson.loads(view[_PREFIX.size:_PREFIX.size + header_len])
        header["tensors"], header["meta"], header["envelope"]  # noqa: B018
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise _fail(where, f"unreadable header ({exc})") from exc
    return view, data_start, data_len, header


def _decode_one(e: Mapping[str, Any], data: memoryview, data_len: int, as_torch: bool,
                where: str) -> Any:
    name, dname, shape = e["name"], e["dtype"], tuple(int(s) for s in e["shape"])
    offset, nbytes, order = int(e["offset"]), int(e["nbytes"]), e["byteorder"]
    if (carrier := _CARRIERS.get(dname)) is None:
        raise _fail(where, f"tensor {name!r} has unknown dtype {dname!r}")
    if order == ">":
        carrier = carrier.newbyteorder(">")
    count = int(np.prod(shape, dtype=np.int64))
    if any(s < 0 for s in shape) or count * carrier.itemsize != nbytes \
            or offset < 0 or offset + nbytes > data_len:
        raise _fail(where, f"tensor {name!r}: shape {shape} x {dname} does not match "
                           f"{nbytes} bytes at offset {offset} of {data_len}")
    arr = np.frombuffer(data, dtype=carrier, count=count, offset=offset).reshape(shape)
    if order == ">":
        arr = arr.astype(carrier.newbyteorder("="))
    if dname not in _TORCH_ONLY and not as_torch:
        return arr
    import torch

    t = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    return t.view(getattr(torch, dname)) if dname in _TORCH_ONLY else t
