"""The ``roidb`` blob: per-image gt dicts carried from the loader to the model (Detectron
semantics: RPN targets; end-to-end training).

Detectron pickles the minimal roidb into a float32 array of byte values. The container is
kept (a 1-D float32 array of byte values), not pickle: an explicit, versioned format any
process can read without executing code:

    b"LRDB" | version (1 byte) | header length (uint32 LE) | header (UTF-8 JSON) | arrays

Per image, the header maps each key to a JSON value (``segms``, ``has_visible_keypoints``),
an array ``{"t": "a", "dtype", "shape", "off"}`` into the array section, or a CSR
descriptor (``gt_overlaps``). ``deserialize_roidb(serialize_roidb(x)) == x``; polygons come
back as lists of floats and RLE ``counts`` keep their ``bytes``/``str`` type.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Mapping, Sequence

import numpy as np
import orjson
import scipy.sparse

from lit_roidata.roidb.columnar import LVIS_ENTRY_FIELDS

__all__ = ["ROIDB_BLOB_KEYS", "EXTRA_KEYS", "LVIS_KEYS", "serialize_roidb", "deserialize_roidb"]

ROIDB_BLOB_KEYS = ("has_visible_keypoints", "boxes", "segms", "seg_areas", "gt_classes",
                   "gt_overlaps", "is_crowd", "box_to_gt_ind_map", "gt_keypoints")
# Not in Detectron's minimal roidb; carried so that errors can name the image and RLE
# segms can be decoded at their size in the second stage.
EXTRA_KEYS = ("id", "image", "width", "height", "flipped")
# LVIS roidbs only: each image's neg / not-exhaustive categories as contiguous class ids
# (int32 arrays, like gt_classes), for federated losses in the model: the entry fields.
LVIS_KEYS = LVIS_ENTRY_FIELDS
_JSON_KEYS = frozenset(("segms", "has_visible_keypoints") + EXTRA_KEYS)
_KEYS = ROIDB_BLOB_KEYS + EXTRA_KEYS + LVIS_KEYS
_MAGIC = b"LRDB"
_VERSION = 1


def serialize_roidb(entries: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Encode the keys of ``ROIDB_BLOB_KEYS``, ``EXTRA_KEYS`` and ``LVIS_KEYS`` present in
    each entry (Detectron semantics: RPN targets).

    Returns:
        A 1-D float32 array of byte values (Detectron's container for the blob).
    """
    header: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    offset = 0

    def put(arr: Any) -> dict[str, Any]:
        nonlocal offset
        a = np.ascontiguousarray(arr)
        chunks.append(a.tobytes())
        desc = {"t": "a", "dtype": a.dtype.str, "shape": list(a.shape), "off": offset}
        offset += len(chunks[-1])
        return desc

    for entry in entries:
        item: dict[str, Any] = {}
        for key, value in ((k, entry[k]) for k in _KEYS if k in entry):
            if key in _JSON_KEYS:
                item[key] = {"t": "j", "v": _to_json(value)}
            elif scipy.sparse.issparse(value):
                csr = scipy.sparse.csr_matrix(value)
                item[key] = {"t": "csr", "shape": list(csr.shape), "data": put(csr.data),
                             "indices": put(csr.indices), "indptr": put(csr.indptr)}
            else:
                item[key] = put(np.asarray(value))
        header.append(item)
    head = _dumps(header)
    payload = (_MAGIC + bytes([_VERSION]) + struct.pack("<I", len(head)) + head + b"".join(chunks))
    return np.frombuffer(payload, dtype=np.uint8).astype(np.float32)


def deserialize_roidb(blob: Any) -> list[dict[str, Any]]:
    """Decode a blob made by :func:`serialize_roidb` (NumPy array or torch tensor).

    Raises:
        ValueError: the blob is not a ``roidb`` blob of a known version.
    """
    if hasattr(blob, "detach"):
        blob = blob.detach().cpu().numpy()
    raw = np.asarray(blob).astype(np.uint8).tobytes()
    if raw[:4] != _MAGIC or len(raw) < 9:
        raise ValueError("not a lit_roidata roidb blob (bad magic); it must come from "
                         "lit_roidata.minibatch.roidb_blob.serialize_roidb")
    if raw[4] != _VERSION:
        raise ValueError(f"roidb blob version {raw[4]} is not supported (expected {_VERSION})")
    (hlen,) = struct.unpack("<I", raw[5:9])
    header = json.loads(raw[9:9 + hlen].decode("utf-8"))
    data = memoryview(raw)[9 + hlen:]

    def get(desc: Mapping[str, Any]) -> np.ndarray:
        count = int(np.prod(desc["shape"], dtype=np.int64))
        return np.frombuffer(data, dtype=np.dtype(desc["dtype"]), count=count,
                             offset=desc["off"]).reshape(desc["shape"]).copy()

    def value(desc: Mapping[str, Any]) -> Any:
        if desc["t"] == "j":
            return _from_json(desc["v"])
        if desc["t"] == "csr":
            return scipy.sparse.csr_matrix(
                (get(desc["data"]), get(desc["indices"]), get(desc["indptr"])),
                shape=tuple(desc["shape"]))
        return get(desc)

    return [{key: value(desc) for key, desc in item.items()} for item in header]


def _dumps(header: list[dict[str, Any]]) -> bytes:
    """The header as compact JSON: orjson (several times faster than ``json`` on
    polygon floats; floats in shortest round-trip form, so ``json.loads`` reads back
    the same values), or ``json`` where orjson would change the content: it writes
    NaN/Infinity as ``null`` (so any ``null`` falls back) and refuses integers beyond
    64 bits and lone surrogates."""
    try:
        head = orjson.dumps(header)
    except (TypeError, orjson.JSONEncodeError):
        head = b"null"
    if b"null" in head:
        head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return head


_PLAIN = frozenset((float, int, str, bool, type(None)))


def _to_json(value: Any) -> Any:
    kind = type(value)
    if kind in _PLAIN:  # fast paths: polygon coordinates are lists of Python floats
        return value
    if (kind is list or kind is tuple) and _PLAIN.issuperset(map(type, value)):
        return value if kind is list else list(value)
    if isinstance(value, bytes):
        return {"__bytes__": value.decode("latin1")}
    if isinstance(value, Mapping):
        return {"__dict__": [[k, _to_json(v)] for k, v in value.items()]}
    if isinstance(value, np.ndarray):
        return _to_json(value.tolist())
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    return value.item() if isinstance(value, np.generic) else value


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if "__bytes__" in value:
            return value["__bytes__"].encode("latin1")
        return {k: _from_json(v) for k, v in value["__dict__"]}
    return [_from_json(v) for v in value] if isinstance(value, list) else value
