"""``lit-roidata dump-blobs``: Detectron's blob dump, as ``.npz`` files.

As Detectron's ``RoIDataLoaderSimple`` debugging path: identity order, one image per
minibatch, the first K minibatches saved (Detectron's pixel format by default), each
rebuilt from its stream coordinates. Writes ``<out>/minibatch_00000.npz`` ... and
``<out>/index.json`` (see docs/cli.md).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

import numpy as np
from rich.console import Console

from lit_roidata.tools.common import data_module_from, tool_parser

__all__ = ["main", "dump_blobs"]


def dump_blobs(dm: Any, out: str, num: int, blobs: Optional[Sequence[str]] = None, *,
               pixel_format: str = "detectron", ims_per_batch: int = 1) -> list[dict[str, Any]]:
    """Write the first ``num`` minibatches of ``dm``'s training roidb to ``out``.

    Args:
        dm: a :class:`lit_roidata.RoIDataModule` (``prepare_data``/``setup`` are called).
        blobs: names to save (default: all of ``get_minibatch_blob_names(cfg)``).
        pixel_format: ``"detectron"`` (float32 minus means) or ``"uint8"``.
        ims_per_batch: images per minibatch (Detectron's dump uses 1).

    Returns:
        The index records written to ``index.json``.

    Raises:
        ValueError: unknown blob names (the message lists the valid ones) or a data
            module configured for torchvision output.
    """
    from lit_roidata.minibatch import get_minibatch_blob_names
    from lit_roidata.minibatch.device import expand_masks_on_device, expand_targets

    if dm.output.output_format != "detectron":
        raise ValueError("dump-blobs writes Detectron blobs; set data.output.output_format "
                         "to 'detectron'")
    dm.prepare_data()
    dm.setup("fit")
    names = list(get_minibatch_blob_names(dm.cfg))
    chosen = list(blobs) if blobs else names
    if unknown := [b for b in chosen if b not in names]:
        raise ValueError(f"unknown blob name(s) {unknown}; this config builds {names}")
    sampler = dm.make_sampler(shuffle=False, ims_per_batch=ims_per_batch, rank=0, world_size=1)
    dataset = dm.make_dataset(sampler=sampler, pixel_format=pixel_format)
    os.makedirs(out, exist_ok=True)
    index = []
    for k, block in zip(range(int(num)), sampler):
        mb = dataset.__getitems__(block)
        # Compact masks / RPN targets (the data module's defaults) -> Detectron's blobs.
        if "mask_class_int32" in mb:
            mb["masks_int32"] = expand_masks_on_device(
                mb["masks_int32"], mb.pop("mask_class_int32"), int(dm.cfg.MODEL.NUM_CLASSES))
        expand_targets(mb)
        meta, path = mb["_meta"], os.path.join(out, f"minibatch_{k:05d}.npz")
        np.savez(path, **{n: np.asarray(mb[n]) for n in chosen})
        index.append({"file": os.path.basename(path), **{k: [f(v) for v in meta[k]] for k, f in (
            ("indices", int), ("image_ids", int), ("images", str), ("flipped", bool),
            ("im_scales", float))},
            **{k: int(meta[k]) for k in ("seed", "pass_index", "block_index")},
            "blobs": chosen, "pixel_format": pixel_format})
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
    return index


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = tool_parser("dump-blobs", __doc__.split("\n\n")[0])
    parser.add_argument("--out", default="blob_dump", help="output folder")
    parser.add_argument("--num", type=int, default=4, help="K: minibatches to save")
    parser.add_argument("--blobs", type=Optional[list[str]], default=None,
                        help="blob names to save (default: all)")
    parser.add_argument("--pixel_format", type=str, default="detectron",
                        help="detectron (float32 minus PIXEL_MEANS) or uint8")
    parser.add_argument("--ims_per_batch", type=int, default=1, help="images per minibatch")
    cfg, dm = data_module_from(parser, argv or ())
    index = dump_blobs(dm, cfg.out, cfg.num, cfg.blobs, pixel_format=cfg.pixel_format,
                       ims_per_batch=cfg.ims_per_batch)
    con = Console()
    blobs = ", ".join(index[0]["blobs"]) if index else "-"
    con.print(f"wrote {len(index)} minibatch(es) to {cfg.out}/ (blobs: {blobs})")
    for rec in index:
        con.print(f"  {rec['file']}: image ids {rec['image_ids']} flipped {rec['flipped']} "
                  f"scales {[round(s, 4) for s in rec['im_scales']]}")
    return 0
