"""``lit-roidata make-demo-data``: generate the synthetic demo datasets.

The same data ``configs/demo.yaml`` creates on first use (``DemoRoIDataModule``,
``data.init_args.demo_root``): two training sets and a validation set of shape images in
COCO format, with Detectron proposal files, crowd regions and person keypoints.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from lit_roidata.demo.data import ensure_demo_data, is_demo_data

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Generate (or verify) the demo data under ``--root``; print what is there."""
    parser = argparse.ArgumentParser(prog="lit-roidata make-demo-data",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="demo_data", help="output folder (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="generation seed (default: 0)")
    parser.add_argument("--size", type=json.loads, default=None, metavar="JSON",
                        help='images per dataset, e.g. \'{"demo_train_a": 40}\'')
    parser.add_argument("--force", action="store_true",
                        help="replace an existing folder holding other data (other seed or "
                             "sizes, or not demo data) and its roidb caches under ROOT/cache")
    args = parser.parse_args(list(argv or ()))
    if (refusal := _existing_data(args.root, args.seed, args.size)) and not args.force:
        print(f"lit-roidata make-demo-data: {refusal}; not replacing it. Pass --force to "
              "replace it (its roidb caches under ROOT/cache are removed too), or choose "
              "another --root.", file=sys.stderr)
        return 2
    if refusal:
        shutil.rmtree(os.path.join(args.root, "cache"), ignore_errors=True)
    from rich.console import Console
    from rich.table import Table

    layout = ensure_demo_data(args.root, seed=args.seed, num_images=args.size)
    table = Table("dataset", "images", "annotation file", "proposal file",
                  title=f"demo data in {args.root}")
    for name, info in layout.items():
        table.add_row(name, str(info["num_images"]), info["annotation_file"], info["proposal_file"])
    Console().print(table)
    return 0


def _existing_data(root: str, seed: int, size: Optional[dict[str, Any]]) -> Optional[str]:
    """Why generating into ``root`` would replace something (``None``: nothing there, or
    the same demo data already, which is reused untouched)."""
    path = Path(root)
    if not path.exists():
        return None
    if not path.is_dir():
        return f"{root} exists and is not a folder"
    entries = [e for e in path.iterdir() if e.name != ".demo_data.lock"]
    if not entries or is_demo_data(path, seed=seed, num_images=size):
        return None
    return (f"{root} already holds other data ({len(entries)} entries: not the demo data "
            f"for seed {seed} and these sizes)")
