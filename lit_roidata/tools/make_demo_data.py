"""``lit-roidata make-demo-data``: generate the synthetic demo datasets.

The same data ``configs/demo.yaml`` creates on first use (``data.init_args.demo_root``):
two training sets and a validation set of shape images in COCO format, with Detectron
proposal files, crowd regions and person keypoints.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Generate (or verify) the demo data under ``--root``; print what is there."""
    parser = argparse.ArgumentParser(prog="lit-roidata make-demo-data",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="demo_data", help="output folder (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="generation seed (default: 0)")
    parser.add_argument("--size", type=json.loads, default=None, metavar="JSON",
                        help='images per dataset, e.g. \'{"demo_train_a": 40}\'')
    args = parser.parse_args(list(argv or ()))
    from rich.console import Console
    from rich.table import Table

    from lit_roidata.demo import ensure_demo_data

    layout = ensure_demo_data(args.root, seed=args.seed, num_images=args.size)
    table = Table(title=f"demo data in {args.root}")
    for col in ("dataset", "images", "annotation file", "proposal file"):
        table.add_column(col)
    for name, info in layout.items():
        table.add_row(name, str(info["num_images"]), info["annotation_file"],
                      info["proposal_file"])
    Console().print(table)
    return 0
