"""``lit-roidata inspect``: look at the training data before training on it.

Prints a roidb statistics table per dataset and writes ``histograms.png`` and
``minibatch_<k>.png`` (the first training minibatches with gt boxes, masks, keypoints and
sampled RoIs) to ``--out``; see docs/cli.md.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import numpy as np
from rich.console import Console

from lit_roidata._optional import require
from lit_roidata.tools.common import data_module_from, tool_parser

__all__ = ["main", "roidb_stats", "plot_histograms", "plot_minibatch"]

_MAX_STAT_ENTRIES = 20000  # per-entry statistics use an even sample above this


def roidb_stats(roidb: Any, max_entries: int = _MAX_STAT_ENTRIES) -> dict[str, dict[str, Any]]:
    """Per-dataset entries, flips, orientations, gt/crowd/proposal counts and classes."""
    n = len(roidb)
    idx = np.arange(n) if n <= max_entries else np.linspace(0, n - 1, max_entries).astype(int)
    horz = np.asarray(roidb.widths) >= np.asarray(roidb.heights)
    stats: dict[str, dict[str, Any]] = {}
    for i in idx:
        e = roidb[int(i)]
        s = stats.setdefault(roidb.dataset_of(int(i)), {
            "entries": 0, "flipped": 0, "horizontal": 0, "gt": [], "crowd": 0, "proposals": [],
            "kp_images": 0, "classes": {}, "sampled": n > max_entries})
        gt, crowd = np.asarray(e["gt_classes"]) > 0, np.asarray(e["is_crowd"], bool)
        s["entries"] += 1
        s["flipped"] += bool(e["flipped"])
        s["horizontal"] += bool(horz[i])
        s["gt"].append(int((gt & ~crowd).sum()))
        s["crowd"] += int((gt & crowd).sum())
        s["proposals"].append(int((~gt).sum()))
        s["kp_images"] += bool(e.get("has_visible_keypoints", False))
        classes = e["dataset"].classes
        for c in np.asarray(e["gt_classes"])[gt & ~crowd]:
            s["classes"][classes[int(c)]] = s["classes"].get(classes[int(c)], 0) + 1
    return stats


def _print_stats(roidb: Any, stats: dict[str, dict[str, Any]]) -> None:
    from rich.table import Column, Table

    con, table = Console(), Table(title=f"roidb: {len(roidb)} entries ({roidb.path})")
    for col in ("dataset", "entries", "flipped", "horiz/vert", "gt boxes/img", "crowd",
                "proposals/img", "kp images"):
        table.add_column(col, justify="right" if col != "dataset" else "left")
    for name, s in stats.items():
        gt, pr = np.asarray(s["gt"]), np.asarray(s["proposals"])
        table.add_row(name + (" (sampled)" if s["sampled"] else ""), str(s["entries"]),
                      str(s["flipped"]), f"{s['horizontal']}/{s['entries'] - s['horizontal']}",
                      f"{gt.mean():.2f} (max {gt.max()})", str(s["crowd"]),
                      f"{pr.mean():.1f} ({pr.min()}-{pr.max()})", str(s["kp_images"]))
    con.print(table)
    classes = Table("dataset", "class", Column("boxes", justify="right"),
                    title="gt boxes per class (non-crowd)")
    for name, s in stats.items():
        for c, k in sorted(s["classes"].items(), key=lambda kv: -kv[1]):
            classes.add_row(name, c, str(k))
    con.print(classes)
    if report := getattr(roidb, "report", None):
        con.print("build report:", report)


def _pyplot() -> Any:
    require("matplotlib", "viz", "lit-roidata inspect (plots)").use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_histograms(roidb: Any, cfg: Any, stats: dict[str, dict[str, Any]], path: str) -> None:
    """Aspect ratios, Detectron image scales, gt boxes and proposals per image."""
    plt = _pyplot()
    w, h = np.asarray(roidb.widths, float), np.asarray(roidb.heights, float)
    short, long_, top = np.minimum(w, h), np.maximum(w, h), cfg.TRAIN.MAX_SIZE
    scales = [np.where(np.round(t / short * long_) > top, top / long_, t / short)
              for t in cfg.TRAIN.SCALES]
    gt = np.concatenate([np.asarray(s["gt"]) for s in stats.values()])
    props = np.concatenate([np.asarray(s["proposals"]) for s in stats.values()])
    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    for a, (values, bins, title) in zip(ax.flat, (
            (w / h, 50, "aspect ratio w/h (>= 1: horizontal group)"),
            (np.concatenate(scales), 50, f"im_scale (TRAIN.SCALES={list(cfg.TRAIN.SCALES)}, "
                                         f"MAX_SIZE={cfg.TRAIN.MAX_SIZE})"),
            (gt, np.arange(gt.max() + 2) - 0.5, "gt boxes per image (non-crowd)"),
            (props, 50, "proposals per image"))):
        a.hist(values, bins=bins)
        a.set_title(title)
    ax[0, 0].axvline(1.0, color="k", ls="--", lw=1)
    _save(plt, fig, path)


def plot_minibatch(blobs: dict[str, Any], entries: Sequence[Any], path: str) -> None:
    """Draw one minibatch (uint8 or float ``data``) with its targets; save a PNG."""
    plt = _pyplot()
    from matplotlib.patches import Polygon, Rectangle

    meta, data = blobs["_meta"], np.asarray(blobs["data"])
    sizes = np.asarray(meta["image_sizes"])
    rois = np.asarray(blobs["rois"]) if "rois" in blobs else np.zeros((0, 5))
    labels = np.asarray(blobs["labels_int32"]) if "labels_int32" in blobs else np.zeros(len(rois))
    fig, axes = plt.subplots(1, len(entries), figsize=(6 * len(entries), 6), squeeze=False)
    for b, (ax, e) in enumerate(zip(axes[0], entries)):
        h, w = (int(v) for v in sizes[b])
        im = data[b, :, :h, :w].transpose(1, 2, 0).astype(np.float32)
        if data.dtype != np.uint8:  # Detectron float blob: add the means back
            im = im + np.asarray(e.get("_pixel_means", (102.9801, 115.9465, 122.7717)))
        ax.imshow(np.clip(im[:, :, ::-1], 0, 255).astype(np.uint8))
        s, sel = float(meta["im_scales"][b]), rois[:, 0] == b
        for r, lab in zip(rois[sel], labels[sel]):
            fg = lab > 0
            ax.add_patch(Rectangle((r[1], r[2]), r[3] - r[1], r[4] - r[2], fill=False,
                                   lw=0.8 if fg else 0.4, alpha=0.9 if fg else 0.35,
                                   ec="lime" if fg else "red"))
        _draw_gt(ax, e, s, Polygon, Rectangle)
        ax.set_title(f"id {e['id']}{' (flipped)' if e['flipped'] else ''} scale {s:.3f}",
                     fontsize=9)
        ax.axis("off")
    _save(plt, fig, path)


def _draw_gt(ax: Any, e: Any, s: float, Polygon: Any, Rectangle: Any) -> None:
    import pycocotools.mask as mask_util

    gt, crowd = np.flatnonzero(np.asarray(e["gt_classes"]) > 0), np.asarray(e["is_crowd"], bool)
    classes = e["dataset"].classes
    for j, row in enumerate(gt):
        x1, y1, x2, y2 = np.asarray(e["boxes"][row], float) * s
        ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, lw=1.5,
                               ec="orange" if crowd[row] else "yellow"))
        ax.text(x1, y1, classes[int(e["gt_classes"][row])], color="yellow", fontsize=7)
        segm = e["segms"][j] if j < len(e["segms"]) else None
        if isinstance(segm, list):
            for poly in segm:
                xy = np.asarray(poly, float).reshape(-1, 2) * s
                ax.add_patch(Polygon(xy, closed=True, fill=True, alpha=0.35, fc="cyan",
                                     ec="cyan", lw=1, zorder=3))
        elif isinstance(segm, dict):
            rle = segm if isinstance(segm.get("counts"), (bytes, str)) else \
                mask_util.frPyObjects(segm, *segm["size"])
            m = mask_util.decode(rle).astype(float)
            H, W = m.shape
            ax.imshow(np.ma.masked_equal(m, 0), cmap="autumn", alpha=0.4,
                      extent=(-0.5 * s, (W - 0.5) * s, (H - 0.5) * s, -0.5 * s))
    kps = e.get("gt_keypoints") if "gt_keypoints" in e else None
    for k in np.asarray(kps if kps is not None else ()):
        vis = k[2] > 0
        ax.scatter(k[0][vis] * s, k[1][vis] * s, s=6, c="magenta")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = tool_parser("inspect", __doc__.split("\n\n")[0])
    parser.add_argument("--out", default="inspect_out", help="folder for the PNG files")
    parser.add_argument("--num_batches", type=int, default=3, help="minibatch pictures")
    cfg, dm = data_module_from(parser, argv or ())
    require("matplotlib", "viz", "lit-roidata inspect (plots)")  # before the roidb build
    dm.prepare_data()
    dm.setup("fit")
    roidb = dm.train_roidb
    stats = roidb_stats(roidb)
    _print_stats(roidb, stats)
    os.makedirs(cfg.out, exist_ok=True)
    written = [os.path.join(cfg.out, "histograms.png")]
    plot_histograms(roidb, dm.cfg, stats, written[0])
    if dm.output.output_format == "detectron":
        sampler = dm.make_sampler(rank=0, world_size=1)
        dataset = dm.make_dataset(sampler=sampler, pixel_format="uint8")
        for k, block in zip(range(cfg.num_batches), sampler):
            blobs = dataset.__getitems__(block)
            entries = [roidb[int(i)] for i in blobs["_meta"]["indices"]]
            written.append(os.path.join(cfg.out, f"minibatch_{k}.png"))
            plot_minibatch(blobs, entries, written[-1])
    Console().print("wrote " + ", ".join(written))
    return 0
