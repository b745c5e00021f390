"""``lit-roidata convert-proposals``: a proposal pickle → the columnar ``.npz``.

The pickle is read once (streamed) and written as uncompressed ``ids``, ``counts``,
``boxes`` and ``scores`` members that the roidb build reads without unpickling; the roidb
equals one built from the pickle. Unpickling runs any code the file names: convert only
files you trust.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Convert ``IN`` (pickle) into ``OUT`` (.npz); print what was written."""
    parser = argparse.ArgumentParser(prog="lit-roidata convert-proposals",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="Detectron proposal pickle (.pkl)")
    parser.add_argument("output", help="columnar proposal file to write (.npz)")
    parser.add_argument("--annotations", default=None, metavar="JSON",
                        help="COCO json whose images[].file_name map proposal ids that are "
                             "file names to image ids")
    parser.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    args = parser.parse_args(list(argv or ()))
    from lit_roidata.roidb.info import RoIDBInputError
    from lit_roidata.roidb.proposals import convert_proposals

    if not args.output.endswith(".npz"):
        parser.error(f"OUT must end with .npz (got {args.output})")
    if os.path.exists(args.output) and not args.force:
        parser.error(f"{args.output} exists; pass --force to overwrite it")
    try:
        info = convert_proposals(args.input, args.output, annotations=args.annotations,
                                 trust_pickle=True)  # the user named this file to convert
    except (RoIDBInputError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    size = os.path.getsize(args.output) / 2**20
    print(f"wrote {args.output}: {info['images']} images, {info['boxes']} boxes "
          f"({info['dtype']}), {size:.1f} MiB; read {info['seconds_read']:.1f}s, "
          f"write {info['seconds_write']:.1f}s")
    return 0
