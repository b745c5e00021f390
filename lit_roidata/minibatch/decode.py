"""Read and decode one roidb image, checked against the roidb (Detectron semantics: image
blob steps 1-2).

Where Detectron asserts ``cv2.imread(...) is not None`` (quirk Q33), every failure here
raises :class:`BadImageError`, naming the file, the image id, the dataset and a fix, so
the worker can fail loudly or (``on_bad_image="skip"``) replace the block. Every format
goes through ``cv2.imdecode(..., IMREAD_COLOR)``, the decoder behind ``cv2.imread``: the
pixels are Detectron's bit for bit (EXIF orientation applied; grayscale, CMYK, palette and
alpha to BGR; 16-bit to the high byte: ``benchmarks/decode.py`` checks them), and it is
the fastest decoder measured there.
"""

from __future__ import annotations

from typing import Any, Mapping

import cv2
import numpy as np

from lit_roidata.storage import is_url, read_bytes, redact

__all__ = ["BadImageError", "describe_entry", "decode_bgr", "decode_rgb", "load_image",
           "load_image_rgb"]


class BadImageError(RuntimeError):
    """An image that cannot be used: missing, unreadable, truncated or the wrong size.

    Attributes:
        path: the image file.
        image_id: the roidb entry's ``id``.
        dataset: the dataset name.
        reason: a short machine-readable reason (``missing``, ``unreadable``, ``undecodable``,
            ``size_mismatch``), used to count skips by reason.
    """

    def __init__(self, message: str, *, path: str | None = None, image_id: Any = None,
                 dataset: str | None = None, reason: str = "bad_image") -> None:
        # Keyword defaults let DataLoader re-raise it from a worker with the message only;
        # pickling keeps the attributes (BaseException pickles ``args`` and ``__dict__``).
        super().__init__(message)
        self.path, self.image_id, self.dataset, self.reason = path, image_id, dataset, reason


def dataset_name(entry: Mapping[str, Any]) -> str:
    """The dataset name of an entry (``entry['dataset'].name``, or a plain string)."""
    ds = entry.get("dataset") if hasattr(entry, "get") else None
    return "<unknown dataset>" if ds is None else str(getattr(ds, "name", ds))


def describe_entry(entry: Mapping[str, Any]) -> str:
    """``image id 42 of dataset 'coco_2017_train' (/data/x.jpg)`` for error messages."""
    return (f"image id {entry.get('id', '?')} of dataset '{dataset_name(entry)}' "
            f"({redact(entry.get('image', '?'))})")


def _error(entry: Mapping[str, Any], reason: str, what: str, fix: str) -> BadImageError:
    return BadImageError(f"{describe_entry(entry)}: {what}. Fix: {fix}",
                         path=redact(entry.get("image")),
                         image_id=entry.get("id"), dataset=dataset_name(entry), reason=reason)


def decode_bgr(data: bytes) -> np.ndarray:
    """Decode encoded image bytes to a ``(H, W, 3)`` BGR uint8 array, C-contiguous: the
    array ``cv2.imread`` returns for the same file (EXIF orientation applied).

    Raises:
        ValueError: the bytes are not a decodable image (truncated JPEGs included).
    """
    if not data:
        raise ValueError("the file is empty")
    # A JPEG cut short has no end-of-image marker (FFD9) after its last scan (FFDA; both
    # are real markers: in entropy-coded data FF is followed by 00 or a restart marker).
    # OpenCV 5 refuses it; older releases decode it with a grey bottom and a warning.
    if data[:2] == b"\xff\xd8" and ((eoi := data.rfind(b"\xff\xd9")) < 0
                                     or data.find(b"\xff\xda", eoi) >= 0):
        raise ValueError("truncated JPEG (no end-of-image marker after the last scan)")
    if (im := cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR)) is None:
        raise ValueError("not a known image format, or a corrupt or truncated file")
    return im


def decode_rgb(data: bytes) -> np.ndarray:
    """:func:`decode_bgr` with the channels in RGB order (the same pixels)."""
    return cv2.cvtColor(decode_bgr(data), cv2.COLOR_BGR2RGB)  # SIMD; faster than [..., ::-1]


def load_image(entry: Mapping[str, Any], decode: Any = None) -> np.ndarray:
    """Read, decode (``decode``, default :func:`decode_bgr`), size-check and (for flipped
    entries) mirror one roidb image: ``(height, width, 3)`` uint8, C-contiguous.

    The decoded size must equal the roidb's ``height``/``width``: Detectron computes
    the scale from the decoded image but places every target with the JSON size
    (Detectron quirk Q10, docs/detectron_quirks.md), so a mismatch silently misaligns
    targets there; here it is an error.

    Raises:
        BadImageError: missing/unreadable/undecodable file or size mismatch.
    """
    try:
        data = read_bytes(entry["image"])
    except OSError as exc:  # a URL's: missing (404), else unreadable after the retries
        remote = is_url(entry["image"])
        why = redact(exc) if remote else exc.strerror or exc
        raise _error(entry, "unreadable" if remote and not isinstance(exc, FileNotFoundError)
                     else "missing", f"cannot read the file ({why})",
                     "check the dataset's image directory in the catalog and that the file "
                     "exists and is readable") from exc
    try:
        im = (decode or decode_bgr)(data)
    except ValueError as exc:
        raise _error(entry, "undecodable", f"cannot decode the image ({exc})", "re-download or "
                     "re-encode the file, or set on_bad_image='skip' to skip it") from exc
    h, w = im.shape[:2]
    want_h, want_w = int(entry["height"]), int(entry["width"])
    if (h, w) != (want_h, want_w):
        hint = "" if (h, w) != (want_w, want_h) else (
            " (width and height are swapped: the file probably carries an EXIF "
            "orientation tag that the annotation ignores)")
        raise _error(entry, "size_mismatch",
                     f"decoded image is {w}x{h} (WxH, after EXIF orientation) but the roidb "
                     f"says {want_w}x{want_h}{hint}",
                     "correct width/height in the annotation file, or re-save the image "
                     "without an EXIF orientation tag, then rebuild the roidb cache")
    if entry.get("flipped", False):
        im = cv2.flip(im, 1)  # == im[:, ::-1], contiguous
    return im


def load_image_rgb(entry: Mapping[str, Any]) -> np.ndarray:
    """:func:`load_image` with the channels in RGB order (its ``channel_order``
    attribute says so, and the blob builders write each channel into its BGR plane)."""
    return load_image(entry, decode_rgb)


load_image_rgb.channel_order = "rgb"  # type: ignore[attr-defined]
