"""COCO JSON → :class:`RawCoco`: the fields the roidb reads, as columns, in JSON order.

Two decoders give the same columns: the typed ``msgspec`` one (:func:`decode_fast`,
windowed in :func:`decode_chunked` / :func:`iter_coco`) and, for whatever it refuses,
the generic ``orjson`` one (:func:`decode_generic`), whose errors name the file, the
record and the fix. Value rules are checked afterwards by :mod:`lit_roidata.roidb.coco`.
See docs/roidb.md ("Decoding in windows", "Bad input").
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import re
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter, itemgetter, methodcaller
from typing import Any, Callable, NoReturn, Optional, Union

import msgspec
import numpy as np
import orjson

from lit_roidata.roidb.info import RoIDBInputError
from lit_roidata.roidb.numtext import parse_number_lists
from lit_roidata.roidb.segms import concat

__all__ = ["RawCoco", "decode_coco", "decode_chunked", "decode_fast", "decode_generic",
           "read_json", "WINDOW_BYTES", "iter_coco", "decode_window",
           "SEG_MISSING", "SEG_POLY", "SEG_RLE", "LVIS_IMAGE_LISTS"]

#: ``RawCoco.seg_kind`` values.
SEG_MISSING, SEG_POLY, SEG_RLE = 0, 1, 2

_REQUIRED = object()


def _empty(dtype: Any, shape: tuple = (0,)) -> Any:
    return field(default_factory=lambda: np.zeros(shape, dtype))


@dataclass
class RawCoco:
    """One COCO file's roidb fields as columns, images and annotations in JSON order.

    ``source`` is the file; ``categories`` the JSON entries; ``img_*`` / ``ann_*`` one
    value per image / annotation (``ann_id`` -1 when absent, ``ann_bbox`` (N, 4));
    ``seg_kind`` a ``SEG_*`` per annotation, ``poly_n`` polygons per annotation,
    ``coord_n`` coordinates per polygon, ``coords`` all of them; ``rles`` annotation
    index → the JSON RLE value; ``kp_len`` keypoint values per annotation (-1: no
    ``keypoints`` field), ``kp_vals`` all of them. LVIS only (``lvis=True``):
    ``coco_urls`` (``file_names`` then holds ``None`` where ``file_name`` is absent) and
    ``neg_n``/``neg_ids``, ``nexh_n``/``nexh_ids``: per image the length of its
    ``neg_category_ids`` / ``not_exhaustive_category_ids``, and all their values.
    """

    source: str
    categories: list = field(default_factory=list)
    img_id: np.ndarray = _empty(np.int64)
    img_w: np.ndarray = _empty(np.float64)
    img_h: np.ndarray = _empty(np.float64)
    file_names: list = field(default_factory=list)
    ann_id: np.ndarray = _empty(np.int64)
    ann_img: np.ndarray = _empty(np.int64)
    ann_cat: np.ndarray = _empty(np.int64)
    ann_bbox: np.ndarray = _empty(np.float64, (0, 4))
    ann_area: np.ndarray = _empty(np.float64)
    ann_crowd: np.ndarray = _empty(np.int64)
    ann_ignore: np.ndarray = _empty(np.float64)
    seg_kind: np.ndarray = _empty(np.int8)
    poly_n: np.ndarray = _empty(np.int64)
    coord_n: np.ndarray = _empty(np.int64)
    coords: np.ndarray = _empty(np.float64)
    rles: dict = field(default_factory=dict)
    kp_len: np.ndarray = _empty(np.int64)
    kp_vals: np.ndarray = _empty(np.float64)
    decoder: str = "generic"
    #: JSON position of annotation 0 (a window of a file), or of each (``ann_pos``)
    ann_base: int = 0
    ann_pos: Optional[np.ndarray] = None
    coco_urls: Optional[list] = None
    neg_n: Optional[np.ndarray] = None
    neg_ids: Optional[np.ndarray] = None
    nexh_n: Optional[np.ndarray] = None
    nexh_ids: Optional[np.ndarray] = None

    def ann_label(self, i: int) -> str:
        """``annotation id X (image id Y)`` of annotation ``i`` (JSON position)."""
        return _ann_label(int(self.ann_id[i]), self.ann_at(i), int(self.ann_img[i]))

    def ann_at(self, rows: Any) -> Any:
        """The JSON positions of annotations ``rows`` (indices into the columns)."""
        return self.ann_pos[rows] if self.ann_pos is not None else self.ann_base + rows


def _ann_label(aid: int, pos: Any, image_id: Any) -> str:
    who = f"annotation id {aid}" if aid != -1 else f"annotation #{pos} (no 'id')"
    return f"{who} (image id {image_id})"


def read_json(path: str, raw: Optional[bytes] = None) -> Any:
    """Parse a JSON file with orjson.

    Raises:
        RoIDBInputError: malformed JSON, naming the file, line, column and byte offset.
    """
    if raw is None:
        with open(path, "rb") as fh:
            raw = fh.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _malformed(path, exc.lineno, exc.colno, exc.pos, exc.msg) from None


def _malformed(path: str, line: int, col: int, pos: int, msg: str) -> RoIDBInputError:
    return RoIDBInputError(f"{path}: malformed JSON at line {line}, column {col} (byte {pos}): "
                           f"{msg}. Re-export or repair the file; a truncated download is a "
                           f"common cause.")


# ------------------------------------------------------------------------------ fast
_NULL = msgspec.Raw(b"null")


# gc=False: decoded JSON holds no reference cycles, so the structs need not be tracked by
# the cyclic GC (cheaper to create and free; msgspec's documented option)
class _Img(msgspec.Struct, gc=False):
    id: int
    width: int
    height: int
    file_name: str


class _RLE(msgspec.Struct, gc=False):
    size: list[int]
    counts: Union[list[int], str]


class _Ann(msgspec.Struct, kw_only=True, gc=False):
    id: int = -1
    image_id: int
    category_id: int
    bbox: tuple[float, float, float, float]
    area: float
    iscrowd: Union[int, bool] = 0
    ignore: float = 0.0
    # polygons and keypoints are kept as JSON text (msgspec checks the syntax and skips
    # the value without building objects); lit_roidata.roidb.numtext parses the numbers
    segmentation: Union[list[msgspec.Raw], _RLE, None] = None
    keypoints: msgspec.Raw = _NULL


class _Top(msgspec.Struct):
    images: list[_Img]
    annotations: Optional[list[_Ann]] = None
    categories: msgspec.Raw = _NULL


_DECODER = msgspec.json.Decoder(_Top)


class _LvisImg(msgspec.Struct, kw_only=True, gc=False):
    """An LVIS image: ``file_name`` may be absent (v1 names come from ``coco_url``)."""

    id: int
    width: int
    height: int
    file_name: Optional[str] = None
    coco_url: Optional[str] = None
    neg_category_ids: list[int] = msgspec.field(default_factory=list)
    not_exhaustive_category_ids: list[int] = msgspec.field(default_factory=list)


_EMPTY: tuple = ()
#: The per-image category lists an LVIS roidb keeps: entry field → ``RawCoco`` prefix.
LVIS_IMAGE_LISTS = {"neg_category_ids": "neg", "not_exhaustive_category_ids": "nexh"}
#: the per-image numeric columns and their dtypes (LVIS: plus the id lists)
_IMG_ARRAYS = {"img_id": np.int64, "img_w": np.float64, "img_h": np.float64}
_LVIS_ARRAYS = {f"{short}_{k}": np.int64 for short in LVIS_IMAGE_LISTS.values()
                for k in ("n", "ids")}

#: the element types the typed decoder gave polygon coordinates and keypoint values:
#: numbers the vectorised parser leaves to msgspec are decoded with them
_POLY_NUMBER = list[float]
_KP_NUMBER = list[Union[int, float]]
_SEG_KIND = {list: SEG_POLY, type(None): SEG_MISSING, _RLE: SEG_RLE, dict: SEG_RLE}
_REFUSED = (msgspec.ValidationError, msgspec.DecodeError, OverflowError)


def decode_fast(raw: bytes, source: str) -> Optional[RawCoco]:
    """The typed msgspec decode of a whole file; ``None`` if it is not strictly well-typed."""
    try:
        top = _DECODER.decode(raw)
        cats = orjson.loads(bytes(top.categories)) or []
        img = _image_columns(top.images)
        ann = _annotation_columns(top.annotations or [])
    except (*_REFUSED, orjson.JSONDecodeError):  # an id beyond int64: OverflowError
        return None
    return (None if ann is None or not isinstance(cats, list) else
            RawCoco(source=source, categories=cats, **img, **ann, decoder="fast"))


def _attrs(items: list, name: str, dtype: Any = None) -> Any:
    """Attribute ``name`` of every struct: a ``dtype`` array, or a list."""
    vals = map(attrgetter(name), items)
    return list(vals) if dtype is None else np.fromiter(vals, dtype, len(items))


#: typed-struct columns: RawCoco column -> (struct attribute, dtype)
_IMG_FIELDS = {"img_id": ("id", np.int64), "img_w": ("width", np.float64),
               "img_h": ("height", np.float64), "file_names": ("file_name", None)}
_ANN_FIELDS = {"ann_id": ("id", np.int64), "ann_img": ("image_id", np.int64),
               "ann_cat": ("category_id", np.int64), "ann_area": ("area", np.float64),
               "ann_crowd": ("iscrowd", np.int64), "ann_ignore": ("ignore", np.float64)}


def _image_columns(images: list, lvis: bool = False) -> dict:
    """Image columns of typed ``_Img`` (``lvis``: ``_LvisImg``) structs."""
    cols = {k: _attrs(images, *a) for k, a in _IMG_FIELDS.items()}
    if lvis:
        cols["coco_urls"] = _attrs(images, "coco_url")
        for key, short in LVIS_IMAGE_LISTS.items():
            cols[short + "_n"], cols[short + "_ids"] = _id_lists(_attrs(images, key))
    return cols


def _annotation_columns(anns: list) -> Optional[dict]:
    """Annotation columns of typed ``_Ann`` structs; ``None`` if a polygon or keypoint
    list is not numbers."""
    na = len(anns)
    bbox = np.fromiter(chain.from_iterable(map(attrgetter("bbox"), anns)), np.float64,
                       4 * na).reshape(-1, 4)
    segs = _attrs(anns, "segmentation")
    rles: dict = {}
    if segs.count(None) == na:  # box-only files (Objects365): no per-row segm work
        poly_n, seg_kind = np.zeros(na, np.int64), np.full(na, SEG_MISSING, np.int8)
        coord_n, coords = np.zeros(0, np.int64), np.zeros(0, np.float64)
    else:
        types = list(map(type, segs))
        per = [s_ if t is list else _EMPTY for s_, t in zip(segs, types)]
        poly_n = np.fromiter(map(len, per), np.int64, na)
        parsed = parse_number_lists(list(chain.from_iterable(per)), slow_type=_POLY_NUMBER)
        if parsed is None:
            return None  # a polygon that is not a list of numbers: the generic decoder names it
        coord_n, coords = parsed
        seg_kind = np.fromiter(map(_SEG_KIND.__getitem__, types), np.int8, na)
        rles = {i: {"size": segs[i].size, "counts": segs[i].counts}
                for i in np.flatnonzero(seg_kind == SEG_RLE).tolist()}
    kps = _attrs(anns, "keypoints")
    kp_len, kp_vals = np.full(na, -1, np.int64), np.zeros(0, np.float64)
    if kps.count(_NULL) != na:  # (identity first) an annotation has a keypoints field
        # null (or absent) keypoints: the 4-byte text "null"
        short = np.flatnonzero(np.fromiter(map(len, kps), np.int64, na) == 4).tolist()
        has_kp = np.ones(na, bool)
        has_kp[[i for i in short if kps[i] is _NULL or bytes(kps[i]) == b"null"]] = False
        kp_rows = np.flatnonzero(has_kp)
        parsed = parse_number_lists([kps[i] for i in kp_rows.tolist()], slow_type=_KP_NUMBER)
        if parsed is None:
            return None
        kp_len[kp_rows], kp_vals = parsed
    return {**{k: _attrs(anns, *a) for k, a in _ANN_FIELDS.items()}, "ann_bbox": bbox,
            "seg_kind": seg_kind, "poly_n": poly_n, "coord_n": coord_n, "coords": coords,
            "rles": rles, "kp_len": kp_len, "kp_vals": kp_vals}


# --------------------------------------------------------------------------- chunked
#: bytes of JSON text decoded at a time (a window of whole ``images`` / ``annotations``
#: elements); the decoded Python objects of one window are all that exists at once
WINDOW_BYTES = 16 << 20
_SCAN_BLOCK = 32 << 20
_WS = frozenset(b" \t\r\n")
_STRUCT = np.zeros(256, bool)
_STRUCT[list(b"[]{},")] = True
_DELTA = np.zeros(256, np.int64)
_DELTA[list(b"[{")] = 1
_DELTA[list(b"]}")] = -1
_CANDIDATE = re.compile(rb"\}[ \t\r\n]*,")
_LAST = re.compile(rb"\}[ \t\r\n]*\]")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.S)
_SCALAR = re.compile(rb"[^,\]}\s]*")
_WINDOW_DECODERS = {"images": msgspec.json.Decoder(list[_Img]),
                    "lvis_images": msgspec.json.Decoder(list[_LvisImg]),
                    "annotations": msgspec.json.Decoder(list[_Ann])}
_ANN_ARRAYS = ("ann_id", "ann_img", "ann_cat", "ann_bbox", "ann_area", "ann_crowd",
               "ann_ignore", "seg_kind", "poly_n", "coord_n", "coords", "kp_len", "kp_vals")


def decode_coco(path: str, *, fast: bool = True, window_bytes: int = WINDOW_BYTES,
                lvis: bool = False) -> RawCoco:
    """Decode ``path`` window by window (:func:`decode_chunked`), or, with ``fast=False``,
    whole with the generic decoder.

    Raises:
        RoIDBInputError: a malformed file or record (named, with the fix).
    """
    if fast:
        return decode_chunked(path, window_bytes=window_bytes, lvis=lvis)
    return decode_generic(read_json(path), path, lvis=lvis)


def decode_chunked(path: str, *, window_bytes: int = WINDOW_BYTES,
                   lvis: bool = False) -> RawCoco:
    """The columns of ``path``, decoded in bounded windows of its ``images`` and
    ``annotations`` arrays; identical to the whole-file decoders' for any window size.

    Raises:
        RoIDBInputError: malformed JSON (file, line, column, byte) or a malformed record.
    """
    with _Chunked(path, window_bytes, lvis) as dec:
        return dec.collect()


def iter_coco(path: str, *, window_bytes: int = WINDOW_BYTES, mapper: Any = None) -> Any:
    """The events of a chunked decode of ``path``, in file order (see
    :func:`decode_chunked`): ``("images", window, first)``, ``("images_end", count)``,
    ``("annotations", window, first)`` (``window``: a :class:`RawCoco` of the window's
    images, or of its annotations with ``ann_base=first``) and last ``("end", categories)``.

    ``mapper`` (:class:`lit_roidata.roidb.coco.ParallelWindows`) decodes windows of the
    arrays it ``handles(key)``, ``depth`` in flight: ``submit((key, start, end))``,
    ``result() -> (elements, payload)`` (raising refuses the window: it and the rest of
    its array are decoded here) and ``discard()`` (false: it cannot go on); its windows
    come as ``("annotations_mapped", payload, first)`` / ``("images", ...)`` events.

    Raises:
        RoIDBInputError: malformed JSON or a malformed record, when reached.
    """
    with _Chunked(path, window_bytes) as dec:
        dec.mapper = mapper
        yield from dec.events()


_OPEN: dict = {}


def decode_window(path: str, key: str, start: int, end: int) -> Optional[RawCoco]:
    """The typed decode of one window of ``path``'s ``key`` array, bytes ``[start,
    end)`` from an element start to an element end (a mapper's work, in a worker
    process; the file stays mapped there): a :class:`RawCoco` of the images or of the
    annotations (``ann_base=0``); ``None`` if the typed decoder refuses the window."""
    dec = _OPEN.get(path) or _OPEN.setdefault(path, _Chunked(path, 1))
    cols = _typed_window(key, dec._window_text(start, end), path)
    dec._release(end)  # the window's pages: out of this worker's RSS
    return cols


def _typed_window(key: str, buf: bytes, source: str, lvis: bool = False
                  ) -> Optional[RawCoco]:
    """The typed decode of a window's JSON list of ``key`` elements; ``None`` if refused."""
    try:
        items = _WINDOW_DECODERS["lvis_images" if lvis and key == "images" else key].decode(buf)
        cols = _image_columns(items, lvis) if key == "images" else _annotation_columns(items)
    except _REFUSED:
        return None
    return None if cols is None else RawCoco(source, **cols, decoder="fast")


class _Chunked:
    """One :func:`decode_chunked` pass over a memory-mapped file."""

    def __init__(self, path: str, window_bytes: int, lvis: bool = False) -> None:
        """Map ``path`` (an empty file raises the malformed-JSON error)."""
        with open(path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size == 0:
                read_json(path, b"")
            self.mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self.path, self.window, self.lvis = path, max(1, int(window_bytes)), lvis
        self.n, self.view = len(self.mm), memoryview(self.mm)
        self.generic, self.released = False, 0
        self.mapper: Any = None

    def __enter__(self) -> "_Chunked":
        return self

    def __exit__(self, *exc: Any) -> None:
        """Unmap the file (left to the GC while an error's traceback still views it)."""
        with contextlib.suppress(BufferError):
            self.view.release()
            self.mm.close()

    def _release(self, upto: int) -> None:
        """Drop the mapping's pages before ``upto`` (they stay in the page cache, out of
        this process's RSS): decoded windows are never read again."""
        end = upto - upto % mmap.PAGESIZE
        if end > self.released and hasattr(self.mm, "madvise"):
            self.mm.madvise(mmap.MADV_DONTNEED, self.released, end - self.released)
            self.released = end

    # ------------------------------------------------------------------ top level
    def events(self) -> Any:
        """Walk the top-level object; yield the events of :func:`iter_coco`."""
        path, pos = self.path, self._ws(0)
        if not self._at(pos, b"{"):  # not an object: the generic decoder says so
            if self._at(pos, b'["0123456789-tfn'):
                self._value_end(pos, "the top level")
                raise RoIDBInputError(f"{path}: expected a JSON object at the top level")
            self._syntax_error(pos, "expected a JSON value")
        values, seen = {}, set()
        pos = self._ws(pos + 1)
        closed = self._at(pos, b"}")
        pos = self._ws(pos + 1) if closed else pos
        while not closed:
            m = _STRING.match(self.mm, pos) or self._syntax_error(pos, "expected a key string")
            key = orjson.loads(m.group())
            pos = self._expect(self._ws(m.end()), b":", "expected ':'")
            if pos >= self.n:
                self._syntax_error(pos, "unexpected end of data")
            if key in seen:
                raise RoIDBInputError(f"{path}: the key {key!r} appears twice at the top "
                                      f"level; keep one")
            seen.update({key} & {"images", "annotations"})
            if key in ("images", "annotations") and self.mm[pos] == 0x5B:
                pos, count = yield from self._array(pos, key)
                if key == "images":
                    yield "images_end", count
            else:
                end = self._value_end(pos, repr(key))
                if key in ("images", "annotations", "categories"):
                    values[key] = (pos, end)
                pos = end
            pos = self._ws(pos)
            closed = self._at(pos, b"}")
            pos = self._expect(pos, b",}", "expected ',' or '}'")
        if pos < self.n:
            self._syntax_error(pos, "trailing characters")
        small = {k: orjson.loads(self.view[a:b]) for k, (a, b) in values.items()}
        if "images" not in seen or "images" in small:
            if not isinstance(small.get("images"), list):
                raise RoIDBInputError(f"{path}: no 'images' list at the top level; is this a "
                                      f"COCO-format annotation file?")
            yield "images_end", 0  # an empty list
        cats = small.get("categories") or []
        if not isinstance(cats, list):
            raise RoIDBInputError(f"{path}: 'categories' must be a list of objects")
        if small.get("annotations"):
            raise RoIDBInputError(f"{path}: 'annotations' must be a list of objects")
        yield "end", cats

    def collect(self) -> RawCoco:
        """All events as one :class:`RawCoco` (the file's columns)."""
        wins: dict = {"images": [], "annotations": [], "end": [[]]}
        for ev in self.events():
            wins.get(ev[0], []).append(ev[1])
        imgs = [vars(w) for w in wins["images"]]
        anns = [vars(w) for w in wins["annotations"]]
        out = {k: concat([p.pop(k) for p in imgs], dt)  # freed window by window
               for k, dt in (_IMG_ARRAYS | (_LVIS_ARRAYS if self.lvis else {})).items()}
        for k in ("file_names", "coco_urls") if self.lvis else ("file_names",):
            out[k] = list(chain.from_iterable(p.pop(k) for p in imgs))
        out["rles"] = {p["ann_base"] + i: v for p in anns for i, v in p.pop("rles").items()}
        out.update({k: concat([p.pop(k) for p in anns]) for k in _ANN_ARRAYS if anns})
        return RawCoco(source=self.path, categories=wins["end"][-1], **out,
                       decoder="generic" if self.generic else "fast")

    # ------------------------------------------------------------------ arrays
    def _array(self, open_pos: int, key: str) -> Any:
        """Yield the events of the array at ``open_pos`` (its ``[``), window by window;
        return ``(the position after it, its elements)``."""
        count, pos, refused = 0, self._ws(open_pos + 1), -1
        if pos < self.n and self.mm[pos] == 0x5D:
            return pos + 1, 0
        if self.mapper is not None and self.mapper.handles(key):
            pos, count = yield from self._mapped(pos, key)
            refused = pos  # the mapper's window from here (if any) was refused: not again
        while True:
            m = None if pos == refused else self._candidate(pos)
            w = None if m is None else self._decode(key, pos, m.start() + 1, count, True)
            if w is not None:  # the proposed cut decodes: an element boundary
                nxt, last = self._ws(m.end()), False
            elif (e := self._candidate(pos, True)) and (
                    w := self._decode(key, pos, e.start() + 1, count, True)) is not None:
                nxt, last = e.end(), True  # the proposed end decodes: the array's end
            else:  # the exact cut (scanning the structure), decoded whatever it holds
                cut, last = self._cut(pos, key)
                w = self._decode(key, pos, cut, count, False)
                nxt = cut + 1 if last else self._ws(cut + 1)
            yield key, w, count
            count += len(w.img_id if key == "images" else w.ann_id)
            if last:
                return nxt, count
            pos = nxt

    def _candidate(self, pos: int, last: bool = False) -> Any:
        """The first proposed cut (``},``) at least a window after element start ``pos``;
        ``last``: the first proposed array end (``}]``) after it (tried once a cut fails)."""
        n = self.n
        return (_LAST if last else _CANDIDATE).search(
            self.mm, min(n, pos + (0 if last else self.window)),
            min(n, pos + 2 * self.window + (1 << 20)))

    def _mapped(self, pos: int, key: str) -> Any:
        """Windows from element start ``pos`` decoded by the mapper, several in flight;
        yields as :meth:`_array` and returns ``(position, elements so far)`` where the
        in-process decode goes on: the array's last (short) window, or the first window
        the mapper refused (the array's last window usually is: its proposed cut lies
        past the array's end). Windows in flight behind a refused one are dropped; if
        the mapper cannot go on (``discard()`` is false), it is not used again."""
        mapper, count = self.mapper, 0

        def windows() -> Any:  # (key, start, end, next element start), drawn lazily
            start = pos
            while (m := self._candidate(start)) is not None:
                nxt = self._ws(m.end())
                yield key, start, m.start() + 1, nxt
                start = nxt

        try:
            for (*_, nxt), (rows, payload) in mapper.stream(windows(), mapper.depth):
                yield ("images" if key == "images" else "annotations_mapped"), payload, count
                count += rows
                pos = nxt
        except Exception:  # noqa: BLE001 - refused: decoded here, with exact errors
            if not mapper.discard():
                self.mapper = None
        return pos, count

    def _window_text(self, start: int, end: int) -> bytes:
        """``[`` + the elements in ``[start, end)`` + ``]``: a JSON list to decode (bytes:
        one copy, and msgspec's ``Raw`` values are views of it instead of copies)."""
        return b"".join((b"[", self.view[start:end], b"]"))

    def _decode(self, key: str, start: int, end: int, base: int,
                typed_only: bool) -> Optional[RawCoco]:
        """The elements in ``[start, end)``, the first the array's ``base``-th; ``None``
        if ``typed_only`` and the typed decoder refuses them."""
        buf = self._window_text(start, end)
        self._release(start)
        w = _typed_window(key, buf, self.path, self.lvis)
        if w is None and not typed_only:
            try:
                items = orjson.loads(buf)
            except orjson.JSONDecodeError as exc:
                self._syntax_error(start + max(exc.pos - 1, 0), exc.msg)
            self.generic = True
            w = decode_generic({"images": items} if key == "images" else
                               {"images": [], "annotations": items}, self.path,
                               img_base=base, ann_base=base, lvis=self.lvis)
        if w is not None:
            w.ann_base = base
        return w

    # ------------------------------------------------------------------ scanning
    def _at(self, pos: int, chars: bytes) -> bool:
        """Whether the byte at ``pos`` is one of ``chars`` (false at the end)."""
        return pos < self.n and self.mm[pos] in chars

    def _expect(self, pos: int, chars: bytes, msg: str) -> int:
        """The first non-blank position after the byte at ``pos``, one of ``chars``."""
        if not self._at(pos, chars):
            self._syntax_error(pos, msg)
        return self._ws(pos + 1)

    def _ws(self, pos: int) -> int:
        mm, n = self.mm, self.n
        while pos < n and mm[pos] in _WS:
            pos += 1
        return pos

    def _structure(self, start: int) -> Any:
        """Yield ``(positions, bytes, depth after each)`` of the structural bytes ``[]{},``
        outside strings, from ``start`` (outside a string, depth 0), block by block."""
        n, p, in_str, depth, bs_carry, block = self.n, start, 0, 0, 0, 1 << 16
        while p < n:  # blocks from 64 KiB up: a short value costs a short scan
            m, block = min(block, n - p), min(2 * block, _SCAN_BLOCK)
            a = np.frombuffer(self.mm, np.uint8, m, p)
            q = np.flatnonzero(a == 0x22)
            esc = np.where(q > 0, a[q - 1] == 0x5C, bs_carry > 0)  # a backslash before
            if esc.any():  # a quote after backslashes: escaped if their run is odd
                keep = np.ones(q.size, bool)
                for j in np.flatnonzero(esc).tolist():
                    keep[j] = _backslashes(a, int(q[j]), bs_carry) % 2 == 0
                q = q[keep]
            s = np.flatnonzero(_STRUCT[a])
            s = s[(np.searchsorted(q, s) + in_str) % 2 == 0]
            c = a[s]
            d = depth + np.cumsum(_DELTA[c])
            yield p + s, c, d
            if d.size:
                depth = int(d[-1])
            in_str = (in_str + q.size) % 2
            bs_carry = _backslashes(a, m, bs_carry)
            p += m

    def _cut(self, pos: int, key: str) -> tuple[int, bool]:
        """The exact end of a window starting at element start ``pos``: the first
        element-separating ``,`` at or after ``pos + window``, or the array's ``]``."""
        target = pos + self.window
        for where, chars, depth in self._structure(pos):
            stop = np.flatnonzero((depth < 0) | ((depth == 0) & (chars == 0x2C)
                                                 & (where >= target)))
            if stop.size:
                j = int(stop[0])
                if depth[j] < 0 and chars[j] != 0x5D:
                    self._syntax_error(int(where[j]), "unbalanced brackets")
                return int(where[j]), bool(depth[j] < 0)
        self._syntax_error(self.n, f"unexpected end of data: the {key!r} array is not "
                           f"closed")

    def _value_end(self, pos: int, what: str) -> int:
        """The end of the JSON value starting at ``pos`` (exclusive)."""
        c = self.mm[pos]
        if c in b"[{":
            for where, _, depth in self._structure(pos):
                z = np.flatnonzero(depth <= 0)
                if z.size:
                    return int(where[z[0]]) + 1
            self._syntax_error(self.n, f"unexpected end of data in {what}")
        m = (_STRING if c == 0x22 else _SCALAR).match(self.mm, pos)
        if m is None or m.end() == pos:
            self._syntax_error(pos, f"malformed value for {what}")
        return m.end()

    def _syntax_error(self, pos: int, msg: str) -> NoReturn:
        """Raise the malformed-JSON error for absolute byte ``pos``."""
        pos = min(max(pos, 0), self.n)
        line = 1 + sum(int(np.count_nonzero(np.frombuffer(
            self.mm, np.uint8, min(_SCAN_BLOCK, pos - p), p) == 0x0A))
            for p in range(0, pos, _SCAN_BLOCK))
        raise _malformed(self.path, line, pos - self.mm.rfind(b"\n", 0, pos), pos, msg)


def _backslashes(a: np.ndarray, end: int, carry: int) -> int:
    """The backslashes right before ``a[end]`` (``carry`` more before ``a`` if it is all)."""
    x = end
    while x > 0 and a[x - 1] == 0x5C:
        x -= 1
    return end - x + (carry if x == 0 else 0)


def _id_lists(lists: list) -> tuple[np.ndarray, np.ndarray]:
    """Per-image lengths and the concatenated values of lists of integers."""
    n = np.fromiter(map(len, lists), np.int64, len(lists))
    return n, np.fromiter(chain.from_iterable(lists), np.int64, int(n.sum()))


# --------------------------------------------------------------------------- generic
_INT = frozenset({int})
_NUM = frozenset({int, float})
_INT_OR_BOOL = frozenset({int, bool})
_NUM_OR_BOOL = frozenset({int, float, bool})


def _col(items: list, key: str, allowed: frozenset, dtype: Any, *, source: str, what: str,
         label: Callable[[int], str], default: Any = _REQUIRED, fix: str = "",
         base: int = 0) -> np.ndarray:
    """One typed column of ``items``; an error naming the record for a bad value."""
    get: Callable[[Any], Any] = (itemgetter(key) if default is _REQUIRED
                                 else methodcaller("get", key, default))
    try:
        vals = list(map(get, items))
    except (KeyError, TypeError, AttributeError):
        for i, it in enumerate(items):
            if not isinstance(it, dict):
                raise RoIDBInputError(f"{source}: {what} #{base + i} is not a JSON object (got "
                                      f"{it!r:.80}); fix or remove it.") from None
            if key not in it:
                raise RoIDBInputError(f"{source}: {label(i)} has no {key!r}; {fix or 'add it'}"
                                      f".") from None
        raise
    if not set(map(type, vals)) <= allowed:
        i = next(i for i, v in enumerate(vals) if type(v) not in allowed)
        kind = "an integer" if allowed in (_INT, _INT_OR_BOOL) else "a number"
        raise RoIDBInputError(f"{source}: {label(i)} has {key}={vals[i]!r:.80}, expected "
                              f"{kind}; {fix or 'fix that record'}.")
    try:
        return np.fromiter(vals, dtype, len(vals))
    except OverflowError:
        i = next(i for i, v in enumerate(vals) if abs(v) >= 2 ** 63)
        raise RoIDBInputError(f"{source}: {label(i)} has {key}={vals[i]!r}, out of range; fix "
                              f"that record.") from None


def decode_generic(data: Any, source: str, *, img_base: int = 0,
                   ann_base: int = 0, lvis: bool = False) -> RawCoco:
    """Decode parsed JSON (``orjson.loads`` output) into a :class:`RawCoco`.

    Raises:
        RoIDBInputError: any field of a wrong type, naming the file, record and fix.
    """
    if not isinstance(data, dict):
        raise RoIDBInputError(f"{source}: expected a JSON object at the top level")
    images, cats = data.get("images"), data.get("categories") or []
    anns = data.get("annotations") or []
    for v, problem in ((images, "no 'images' list at the top level; is this a COCO-format "
                                "annotation file?"),
                       (cats, "'categories' must be a list of objects"),
                       (anns, "'annotations' must be a list of objects")):
        if not isinstance(v, list):
            raise RoIDBInputError(f"{source}: {problem}")

    def img_label(i: int) -> str:
        iid = images[i].get("id") if isinstance(images[i], dict) else None
        return f"image #{img_base + i} (id {iid})"

    img_id = _col(images, "id", _INT, np.int64, source=source, what="image", label=img_label,
                  base=img_base)
    icol = functools.partial(_col, images, source=source, what="image", base=img_base,
                             label=lambda i: f"image id {int(img_id[i])}")
    img_w = icol("width", _NUM, np.float64, fix="set it to the image's width in pixels")
    img_h = icol("height", _NUM, np.float64, fix="set it to the image's height in pixels")
    names = [im.get("file_name") for im in images]
    extra = _lvis_generic(images, img_id, source) if lvis else {}
    if not set(map(type, names)) <= ({str, type(None)} if lvis else {str}):
        i = next(i for i, v in enumerate(names) if type(v) is not str)
        raise RoIDBInputError(f"{source}: image id {int(img_id[i])} has file_name="
                              f"{names[i]!r:.80}; every image needs a 'file_name' string.")
    ann_id = _col(anns, "id", _INT, np.int64, source=source, what="annotation",
                  label=lambda i: f"annotation #{ann_base + i}", default=-1, base=ann_base)
    img_raw = [a.get("image_id") if isinstance(a, dict) else None for a in anns]

    def lab(i: int) -> str:
        return _ann_label(int(ann_id[i]), ann_base + i, img_raw[i])

    acol = functools.partial(_col, anns, source=source, what="annotation", label=lab,
                             base=ann_base)
    ann_img = acol("image_id", _INT, np.int64,
                   fix="every annotation needs the integer id of its image")
    ann_cat = acol("category_id", _INT, np.int64,
                   fix="every annotation needs the integer id of one of 'categories'")
    area = acol("area", _NUM, np.float64,
                fix="give the object's area in pixels (the mask area for COCO)")
    crowd = acol("iscrowd", _INT_OR_BOOL, np.int64, default=0, fix="use 0 or 1")
    ignore = acol("ignore", _NUM_OR_BOOL, np.float64, default=0, fix="use 0 or 1")
    # RawCoco's fields in order: _segms and _keypoints give the last seven
    return RawCoco(source, cats, img_id, img_w, img_h, names, ann_id, ann_img, ann_cat,
                   _bboxes(anns, source, lab), area, crowd, ignore, *_segms(anns, source, lab),
                   *_keypoints(anns, source, lab), ann_base=ann_base, **extra)


def _lvis_generic(images: list, img_id: np.ndarray, source: str) -> dict:
    """The LVIS image columns of :class:`RawCoco` from parsed JSON, with named errors."""
    urls = [im.get("coco_url") for im in images]
    if not set(map(type, urls)) <= {str, type(None)}:
        i = next(i for i, v in enumerate(urls) if v is not None and type(v) is not str)
        raise RoIDBInputError(f"{source}: image id {int(img_id[i])} has coco_url="
                              f"{urls[i]!r:.80}; expected a URL string such as "
                              f"'http://images.cocodataset.org/train2017/000000000139.jpg'.")
    out: dict = {"coco_urls": urls}
    for key, short in LVIS_IMAGE_LISTS.items():
        lists = [im.get(key) or [] for im in images]
        bad = [i for i, v in enumerate(lists) if type(v) is not list
               or not set(map(type, v)) <= _INT or any(abs(x) >= 2 ** 63 for x in v)]
        if bad:
            raise RoIDBInputError(f"{source}: image id {int(img_id[bad[0]])} has {key}="
                                  f"{lists[bad[0]]!r:.80}; expected a list of integer category ids "
                                  f"({len(bad)} image(s) have this problem). Fix the lists.")
        out[short + "_n"], out[short + "_ids"] = _id_lists(lists)
    return out


def _first(items: list, bad: Callable[[Any], bool]) -> int:
    return next(i for i, v in enumerate(items) if bad(v))


def _bboxes(anns: list, source: str, lab: Callable[[int], str]) -> np.ndarray:
    boxes = [a.get("bbox") for a in anns]
    ok = set(map(type, boxes)) <= {list} and all(len(b) == 4 for b in boxes)
    flat = _numbers(boxes) if ok else None
    if flat is None:
        i = _first(boxes, lambda b: not (type(b) is list and len(b) == 4
                                         and set(map(type, b)) <= _NUM))
        raise RoIDBInputError(f"{source}: {lab(i)} has bbox {boxes[i]!r:.80}; expected [x, y, "
                              f"width, height] (4 numbers). Fix or remove it.")
    return flat.reshape(-1, 4)


def _numbers(lists: list) -> Optional[np.ndarray]:
    """The values of lists of JSON numbers, float64; ``None`` if one is not a number."""
    flat = list(chain.from_iterable(lists))
    return np.fromiter(flat, np.float64, len(flat)) if set(map(type, flat)) <= _NUM else None


def _segms(anns: list, source: str, lab: Callable[[int], str]) -> tuple:
    segs = [a.get("segmentation") for a in anns]
    kinds = [_SEG_KIND.get(type(s)) for s in segs]
    if None in kinds:
        i = kinds.index(None)
        raise RoIDBInputError(
            f"{source}: {lab(i)} has a malformed 'segmentation' ({segs[i]!r:.80}); expected a "
            f"list of polygons [[x1, y1, x2, y2, ...], ...] or an RLE dict "
            f"{{'size': [h, w], 'counts': ...}}. Fix or remove that annotation.")
    per = [s if k == SEG_POLY else () for s, k in zip(segs, kinds)]
    poly_n = np.fromiter(map(len, per), np.int64, len(per))
    polys = list(chain.from_iterable(per))
    if not set(map(type, polys)) <= {list}:
        i = _first(per, lambda s: any(type(p) is not list for p in s))
        raise RoIDBInputError(
            f"{source}: {lab(i)} has a malformed polygon list (an element is "
            f"{next(p for p in per[i] if type(p) is not list)!r:.40}, not a list); expected "
            f"[[x1, y1, x2, y2, ...], ...]. Fix or remove that annotation.")
    coords = _numbers(polys)
    if coords is None:
        i = _first(per, lambda s: any(type(v) not in _NUM for p in s for v in p))
        bad = next(v for p in per[i] for v in p if type(v) not in _NUM)
        raise RoIDBInputError(
            f"{source}: {lab(i)} has a polygon coordinate {bad!r:.40} (a polygon is a list of "
            f"numbers x1, y1, x2, y2, ...). Fix the coordinates or remove that polygon.")
    kind = np.fromiter(kinds, np.int8, len(kinds))
    rles = {i: segs[i] for i in np.flatnonzero(kind == SEG_RLE).tolist()}
    return kind, poly_n, np.fromiter(map(len, polys), np.int64, len(polys)), coords, rles


def _keypoints(anns: list, source: str, lab: Callable[[int], str]) -> tuple:
    kps = [a.get("keypoints") for a in anns]
    present = [k for k in kps if k is not None]
    if not set(map(type, present)) <= {list}:
        i = _first(kps, lambda k: k is not None and type(k) is not list)
        raise RoIDBInputError(f"{source}: {lab(i)} has keypoints={kps[i]!r:.80}; expected a "
                              f"list [x1, y1, v1, x2, y2, v2, ...]. Fix that record.")
    kp_len = np.fromiter((-1 if k is None else len(k) for k in kps), np.int64, len(kps))
    vals = _numbers(present)
    if vals is None:
        i = _first(kps, lambda k: k is not None and not set(map(type, k)) <= _NUM)
        bad = next(v for v in kps[i] if type(v) not in _NUM)
        raise RoIDBInputError(
            f"{source}: {lab(i)} has a keypoint value {bad!r:.40}; keypoints are numbers "
            f"[x1, y1, v1, ...] (use 0, 0, 0 for a keypoint that is not labelled). Fix that "
            f"record.")
    return kp_len, vals
