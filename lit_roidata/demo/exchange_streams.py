"""Aligned synthetic streams for the exchange examples, tests and benchmark: what two
correctly configured loaders agree on (images, flips, scales per step), from the real
:class:`~lit_roidata.sampler.RoIBatchSampler` and :func:`lit_roidata.rng.block_rng`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from lit_roidata.rng import block_rng

__all__ = ["demo_alignment_stream", "demo_batches"]


def demo_alignment_stream(seed: int, *, num_images: int = 20, ims_per_batch: int = 2,
                          scales: tuple[int, ...] = (600, 700, 800),
                          max_size: int = 1333) -> Iterator[dict[str, Any]]:
    """Yield ``{"image_ids", "flipped", "im_scales"}`` for each block of a fake roidb.

    The roidb has ``num_images // 2`` originals followed by their flipped copies
    (Detectron's order, Detectron semantics: flipping); image sizes alternate
    landscape/portrait so aspect grouping matters. Scales are drawn per block from
    ``block_rng`` like a worker does. ``seed`` is the stream seed (equal in both processes),
    ``num_images`` the (even) roidb length, ``scales`` / ``max_size`` ``TRAIN.SCALES`` /
    ``TRAIN.MAX_SIZE``.
    """
    from lit_roidata.minibatch.image import get_target_scale
    from lit_roidata.sampler import RoIBatchSampler

    half = num_images // 2
    landscape = np.tile(np.arange(half) % 2 == 0, 2)
    widths, heights = np.where(landscape, 640, 480), np.where(landscape, 480, 640)
    ids = np.tile(np.arange(100, 100 + half), 2)
    for block in RoIBatchSampler(widths, heights, ims_per_batch, seed=seed, infinite=True):
        rng = block_rng(seed, block.pass_index, block.block_index)
        targets = rng.choice(np.asarray(scales), size=len(block))
        yield {"image_ids": [int(ids[i]) for i in block],
               "flipped": [bool(i >= half) for i in block],
               "im_scales": [get_target_scale(min(widths[i], heights[i]),
                                              max(widths[i], heights[i]), target, max_size)
                             for i, target in zip(block, targets)]}


def demo_batches(seed: int, num_batches: int, *, image_size: tuple[int, int] = (64, 96),
                 **stream_kwargs: Any) -> list[dict[str, Any]]:
    """Detectron-format toy batches (``data`` + ``_meta``) that follow the aligned stream.

    Pixels are a pure function of the image id and flip, so two processes with the same
    ``seed`` build identical batches. For examples and tests of the callback.
    """
    import torch

    out = []
    for meta in itertools.islice(demo_alignment_stream(seed, **stream_kwargs), num_batches):
        images = [np.random.default_rng(i).integers(0, 256, size=(3, *image_size), dtype=np.uint8)
                  [:, :, ::-1 if flipped else 1]  # pixels: a function of the id and flip only
                  for i, flipped in zip(meta["image_ids"], meta["flipped"])]
        out.append({"data": torch.from_numpy(np.ascontiguousarray(np.stack(images))),
                    "_meta": {k: torch.tensor(v) for k, v in meta.items()}})
    return out
