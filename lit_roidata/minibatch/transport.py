"""Cheap worker-to-main transport of a blob dict: small tensors travel as one buffer.

A DataLoader worker sends every CPU tensor through its own shared-memory segment (a
file descriptor, an ``mmap`` and a socket message each). A Fast R-CNN FPN batch holds
~30 small blobs, which costs more than the image itself. :func:`packed` wraps the
dict so that, when pickled, every tensor not already in shared memory (up to
``limit`` bytes) is copied into one byte tensor; unpickling (in the main process)
returns a plain dict whose tensors are views into that buffer, in the original key
order. Tensors the worker allocated in shared memory (the image and mask blobs) are
sent as they are.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["packed", "PackedBlobs"]

_ALIGN = 8
SMALL_LIMIT = 1 << 26  # everything not already in shared memory


class PackedBlobs(dict):
    """A dict that pickles its small tensors into one buffer (see module doc)."""

    limit: int = SMALL_LIMIT

    def __reduce__(self) -> tuple:
        return _unpack, _pack(self, self.limit)


def packed(blobs: dict[str, Any], limit: int = SMALL_LIMIT) -> PackedBlobs:
    """Wrap ``blobs`` (nested dicts allowed one level, e.g. ``_meta``) for transport."""
    out = PackedBlobs(blobs)
    out.limit = limit
    return out


def _is_small(v: Any, limit: int) -> bool:
    return (isinstance(v, torch.Tensor) and v.device.type == "cpu" and not v.is_shared()
            and v.numel() * v.element_size() <= limit)


def _pack(d: dict[str, Any], limit: int) -> tuple:
    chunks: list[torch.Tensor] = []
    offset = 0

    def walk(mapping: dict[str, Any]) -> list[tuple]:
        nonlocal offset
        items = []
        for k, v in mapping.items():
            if isinstance(v, dict) and not isinstance(v, PackedBlobs):
                items.append((k, "dict", walk(v)))
            elif _is_small(v, limit):
                t = v.contiguous().reshape(-1)
                raw = t.view(torch.uint8)
                pad = (-offset) % _ALIGN
                if pad:
                    chunks.append(torch.zeros(pad, dtype=torch.uint8))
                    offset += pad
                items.append((k, "view", (offset, raw.numel(), v.dtype, tuple(v.shape))))
                chunks.append(raw)
                offset += raw.numel()
            else:
                items.append((k, "value", v))
        return items

    layout = walk(d)
    buf = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    return (layout, buf)


def _unpack(layout: list[tuple], buf: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, kind, payload in layout:
        if kind == "dict":
            out[k] = _unpack(payload, buf)
        elif kind == "view":
            off, n, dtype, shape = payload
            raw = buf[off:off + n]
            out[k] = raw.view(dtype).view(shape)
        else:
            out[k] = payload
    return out
